//! Real CPU limits for local node processes (`ringtmp train --node-cpu RANK:CORES`): each
//! limited node gets a cgroup of its own with a CFS quota of CORES × period, so a node emulating
//! a half-core board gets half a core from the kernel, not a sleep after each computation.
//!
//! Works on cgroup v2 (the `cpu` controller enabled for the group's parent, `cpu.max`) and on
//! cgroup v1 (the `cpu` hierarchy, `cpu.cfs_quota_us`). Where neither is writable the run is
//! refused before any node starts, with what was tried and why it failed. Invariant: every group
//! created is removed when the [`NodeCgroups`] is dropped (after the nodes have exited); a group
//! that cannot be removed is reported, not silently left.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::error::UsageError;

/// CFS period: 100 ms, the kernel's default.
const PERIOD_US: u64 = 100_000;

/// Which cgroup interface a group is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// The groups of one launch's limited nodes.
#[derive(Debug, Default)]
pub struct NodeCgroups {
    groups: Vec<(u32, PathBuf, Version)>,
}

/// `RANK:CORES` entries (comma-separated or repeated) → cores per rank (`None`: unlimited).
pub fn parse_node_cpu(entries: &[String], nodes: u32) -> Result<Vec<Option<f64>>> {
    let mut cores = vec![None; nodes as usize];
    for entry in entries {
        for part in entry.split(',') {
            let bad = |why: String| UsageError(format!("--node-cpu {part:?}: {why}"));
            let (rank, share) = part
                .split_once(':')
                .ok_or_else(|| bad("expected RANK:CORES, e.g. 2:0.5".into()))?;
            let rank: u32 = rank
                .trim()
                .parse()
                .map_err(|_| bad(format!("{rank:?} is not a rank")))?;
            if rank >= nodes {
                return Err(bad(format!(
                    "rank {rank} does not exist in a run of {nodes} nodes"
                ))
                .into());
            }
            let share: f64 = share
                .trim()
                .parse()
                .map_err(|_| bad(format!("{share:?} is not a number of cores")))?;
            if !(share.is_finite() && share > 0.0) {
                return Err(bad(format!(
                    "a CPU share must be more than zero cores, got {share}"
                ))
                .into());
            }
            // The kernel's smallest quota is 1 ms per period.
            if share * (PERIOD_US as f64) < 1000.0 {
                return Err(bad(format!(
                    "{share} cores is below the kernel's 0.01-core minimum"
                ))
                .into());
            }
            cores[rank as usize] = Some(share);
        }
    }
    Ok(cores)
}

/// Where a new group can be made: the v2 root (or this process's own v2 group's parent) with the
/// cpu controller, else the v1 cpu hierarchy. An error says what was tried.
fn parent() -> std::result::Result<(PathBuf, Version), String> {
    let mut tried = Vec::new();
    let v2 = Path::new("/sys/fs/cgroup");
    match std::fs::read_to_string(v2.join("cgroup.controllers")) {
        Ok(controllers) if controllers.split_whitespace().any(|c| c == "cpu") => {
            let control = v2.join("cgroup.subtree_control");
            match std::fs::write(&control, "+cpu") {
                Ok(()) => return Ok((v2.to_path_buf(), Version::V2)),
                Err(e) => tried.push(format!("{} (v2): {e}", control.display())),
            }
        }
        Ok(_) => tried.push(format!("{} (v2): no cpu controller", v2.display())),
        Err(e) => tried.push(format!(
            "{} (v2): {e}",
            v2.join("cgroup.controllers").display()
        )),
    }
    let v1 = Path::new("/sys/fs/cgroup/cpu");
    if v1.join("cpu.cfs_quota_us").is_file() {
        let probe = v1.join(format!("ringtmp-probe-{}", std::process::id()));
        match std::fs::create_dir(&probe) {
            Ok(()) => {
                let _ = std::fs::remove_dir(&probe);
                return Ok((v1.to_path_buf(), Version::V1));
            }
            Err(e) => tried.push(format!("{} (v1): {e}", v1.display())),
        }
    } else {
        tried.push(format!("{} (v1): no cpu.cfs_quota_us", v1.display()));
    }
    Err(tried.join("; "))
}

impl NodeCgroups {
    /// Checks that groups can be made when any node is limited (before any node starts).
    pub fn check(cores: &[Option<f64>]) -> Result<()> {
        if cores.iter().all(Option::is_none) {
            return Ok(());
        }
        parent().map(|_| ()).map_err(|tried| {
            UsageError(format!(
                "--node-cpu needs a writable cgroup cpu controller, and none was found \
                 (tried {tried}); run as root, or in a container or systemd unit with a \
                 delegated cgroup, or use --node-speed to emulate slow nodes instead"
            ))
            .into()
        })
    }

    /// Puts process `pid` (node `rank`) under a quota of `cores` cores.
    pub fn limit(&mut self, rank: u32, pid: u32, cores: f64) -> Result<()> {
        let (parent, version) = parent().map_err(|tried| anyhow::anyhow!("cgroups: {tried}"))?;
        let dir = parent.join(format!("ringtmp-{}-rank{rank}", std::process::id()));
        let io = |what: &str, e: std::io::Error| {
            anyhow::anyhow!("limiting rank {rank} to {cores} cores: {what}: {e}")
        };
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir.display().to_string(), e))?;
        self.groups.push((rank, dir.clone(), version));
        let quota = (cores * PERIOD_US as f64).round() as u64;
        match version {
            Version::V2 => {
                std::fs::write(dir.join("cpu.max"), format!("{quota} {PERIOD_US}"))
                    .map_err(|e| io("cpu.max", e))?;
            }
            Version::V1 => {
                std::fs::write(dir.join("cpu.cfs_period_us"), PERIOD_US.to_string())
                    .map_err(|e| io("cpu.cfs_period_us", e))?;
                std::fs::write(dir.join("cpu.cfs_quota_us"), quota.to_string())
                    .map_err(|e| io("cpu.cfs_quota_us", e))?;
            }
        }
        std::fs::write(dir.join("cgroup.procs"), pid.to_string())
            .map_err(|e| io("cgroup.procs", e))?;
        Ok(())
    }
}

impl Drop for NodeCgroups {
    fn drop(&mut self) {
        for (rank, dir, _) in self.groups.drain(..) {
            // The node has exited, but the kernel may take a moment to empty the group.
            let mut removed = false;
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    removed = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if !removed {
                eprintln!(
                    "launcher: could not remove rank {rank}'s cgroup {}; remove it with rmdir",
                    dir.display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_and_bad_ones_are_named() {
        let cores = parse_node_cpu(&["1:0.5,3:2".into()], 4).unwrap();
        assert_eq!(cores, [None, Some(0.5), None, Some(2.0)]);
        for (bad, needle) in [
            ("1:0", "more than zero"),
            ("4:1", "rank 4 does not exist"),
            ("1", "expected RANK:CORES"),
            ("1:x", "not a number"),
            ("1:0.001", "minimum"),
        ] {
            let e = parse_node_cpu(&[bad.into()], 4).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
