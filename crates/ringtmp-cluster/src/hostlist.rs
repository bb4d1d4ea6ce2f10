//! Slurm host lists: `node[01-03,07],login1` means node01, node02, node03, node07, login1.
//! Ranges keep the zero padding of their first bound; several bracket groups in one name expand as
//! a cartesian product (`r[1-2]n[1-2]` → r1n1, r1n2, r2n1, r2n2).

/// Why a host list cannot be expanded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid Slurm host list {list:?}: {reason}")]
pub struct HostListError {
    /// The list as given.
    pub list: String,
    /// What is wrong.
    pub reason: String,
}

/// Most hosts one list may expand to (a guard against `n[0-999999999]`).
pub const MAX_HOSTS: usize = 100_000;

/// Expands a host list into host names, in order.
pub fn expand(list: &str) -> Result<Vec<String>, HostListError> {
    let err = |reason: &str| HostListError {
        list: list.to_string(),
        reason: reason.to_string(),
    };
    let mut hosts = Vec::new();
    for item in split_top_level(list).map_err(|r| err(&r))? {
        if item.is_empty() {
            continue;
        }
        let mut partial = vec![String::new()];
        let mut rest = item.as_str();
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    partial.iter_mut().for_each(|p| p.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let prefix = &rest[..open];
                    let close = rest[open..]
                        .find(']')
                        .map(|c| c + open)
                        .ok_or_else(|| err("unclosed '['"))?;
                    let choices = expand_ranges(&rest[open + 1..close]).map_err(|r| err(&r))?;
                    let mut next = Vec::with_capacity(partial.len() * choices.len());
                    for p in &partial {
                        for c in &choices {
                            next.push(format!("{p}{prefix}{c}"));
                            if next.len() + hosts.len() > MAX_HOSTS {
                                return Err(err("expands to too many hosts"));
                            }
                        }
                    }
                    partial = next;
                    rest = &rest[close + 1..];
                }
            }
        }
        hosts.extend(partial);
    }
    if hosts.is_empty() {
        return Err(err("no hosts"));
    }
    Ok(hosts)
}

/// The first host of a list, without expanding the rest.
pub fn first_host(list: &str) -> Result<String, HostListError> {
    let first = split_top_level(list)
        .map_err(|reason| HostListError {
            list: list.to_string(),
            reason,
        })?
        .into_iter()
        .find(|s| !s.is_empty())
        .unwrap_or_default();
    // Expanding one item yields its first host first; bound the work by taking only that.
    let bounded = first
        .split('[')
        .enumerate()
        .map(|(i, part)| {
            if i == 0 {
                return part.to_string();
            }
            // Keep only the first range of each bracket group: `01-03,07]x` → `01]x`.
            match part.split_once(']') {
                Some((ranges, tail)) => {
                    let first_range = ranges.split(',').next().unwrap_or("");
                    let first_value = first_range.split('-').next().unwrap_or("");
                    format!("{first_value}]{tail}")
                }
                None => part.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("[");
    expand(&bounded)
        .map(|mut h| h.swap_remove(0))
        .map_err(|e| HostListError {
            list: list.to_string(),
            ..e
        })
}

fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let (mut items, mut current, mut depth) = (Vec::new(), String::new(), 0i32);
    for ch in list.trim().chars() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced brackets".into());
        }
        if ch == ',' && depth == 0 {
            items.push(std::mem::take(&mut current));
        } else {
            current.push(ch);
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    items.push(current);
    Ok(items)
}

fn expand_ranges(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u64, u64) = match (lo.parse(), hi.parse()) {
            (Ok(a), Ok(b)) if a <= b => (a, b),
            _ => return Err(format!("bad range {part:?}")),
        };
        if (b - a) as usize >= MAX_HOSTS {
            return Err(format!("range {part:?} is too large"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_ranges_lists_and_products() {
        assert_eq!(
            expand("node[01-03,07],login1").unwrap(),
            ["node01", "node02", "node03", "node07", "login1"]
        );
        assert_eq!(
            expand("r[1-2]n[8-9]").unwrap(),
            ["r1n8", "r1n9", "r2n8", "r2n9"]
        );
        assert_eq!(
            expand("gpu[098-100]-ib").unwrap(),
            ["gpu098-ib", "gpu099-ib", "gpu100-ib"]
        );
        assert_eq!(expand("single").unwrap(), ["single"]);
    }

    #[test]
    fn first_host_does_not_expand_everything() {
        assert_eq!(first_host("node[0000001-9999999]").unwrap(), "node0000001");
        assert_eq!(first_host("a[3-4],b[1-2]").unwrap(), "a3");
        assert_eq!(first_host("r[1-2]n[8-9]").unwrap(), "r1n8");
    }

    #[test]
    fn malformed_lists_are_errors() {
        for bad in [
            "node[1-",
            "node[3-1]",
            "node[a-b]",
            "n]1[",
            "",
            "x[[1]]",
            "n[1-9999999]",
        ] {
            assert!(expand(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
