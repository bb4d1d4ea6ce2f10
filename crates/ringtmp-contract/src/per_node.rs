//! Values given for the nodes of a run — one for every node (`256M`) or per rank
//! (`1:256M,2:1G`) — as typed values: `--node-memory-limit` is a [`PerNode<Bytes>`],
//! `--node-speed` a [`PerNode<Speed>`]. They are parsed where the flags and config files are
//! read ([`std::str::FromStr`], which clap and serde call), so the planner receives numbers,
//! never their text.
//!
//! Invariants: displaying a value gives a text that parses back to the same value (config files
//! and a run's `train.toml` hold the text); a value is checked on its own when parsed (a size,
//! a speed in (0, 1]) and its ranks against the run's node count when resolved for a run
//! ([`PerNode::resolve`]), since a config file does not know how many nodes it will run on.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// One node's value of a per-node option: how it reads and writes its text.
pub trait NodeValue: Sized + Clone + PartialEq + fmt::Debug {
    /// What a value is, for errors (`a size`).
    const WHAT: &'static str;
    /// Parses one value.
    fn parse(text: &str) -> std::result::Result<Self, String>;
    /// Its text, which [`NodeValue::parse`] reads back as the same value.
    fn show(&self) -> String;
}

/// A number of bytes: `4096`, `200M`, `1.5GiB` (K, M, G are powers of 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl NodeValue for Bytes {
    const WHAT: &'static str = "a size (bytes, or with K, M or G)";

    fn parse(text: &str) -> std::result::Result<Self, String> {
        let t = text.trim();
        let (number, unit) = t
            .find(|c: char| c.is_ascii_alphabetic())
            .map_or((t, ""), |i| t.split_at(i));
        let n: f64 = number
            .trim()
            .parse()
            .map_err(|_| format!("{text:?} is not a size"))?;
        let scale = match unit
            .to_ascii_uppercase()
            .trim_end_matches('B')
            .trim_end_matches('I')
        {
            "" => 1.0,
            "K" => 1024.0,
            "M" => 1024.0 * 1024.0,
            "G" => 1024.0 * 1024.0 * 1024.0,
            _ => return Err(format!("unknown unit in {text:?}; use K, M or G")),
        };
        if !(n.is_finite() && n >= 0.0) {
            return Err(format!("{text:?} is not a size"));
        }
        Ok(Self((n * scale) as u64))
    }

    fn show(&self) -> String {
        for (unit, scale) in [("G", 1u64 << 30), ("M", 1 << 20), ("K", 1 << 10)] {
            if self.0 >= scale && self.0.is_multiple_of(scale) {
                return format!("{}{unit}", self.0 / scale);
            }
        }
        self.0.to_string()
    }
}

/// A node's emulated relative speed, in (0, 1]: 0.5 is a node half as fast.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speed(pub f64);

impl NodeValue for Speed {
    const WHAT: &'static str = "a speed factor FACTOR with 0 < FACTOR ≤ 1";

    fn parse(text: &str) -> std::result::Result<Self, String> {
        match text.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(Self(f)),
            _ => Err(format!("{text:?} is not a factor with 0 < FACTOR ≤ 1")),
        }
    }

    fn show(&self) -> String {
        self.0.to_string()
    }
}

/// A value for every node and per rank (a rank's own wins), as `VALUE` and `RANK:VALUE` entries
/// separated by commas.
#[derive(Clone, Debug, PartialEq)]
pub struct PerNode<T> {
    /// The value of every node not named.
    pub every: Option<T>,
    /// Ranks' own values, in the order given (a later entry for a rank wins).
    pub ranks: Vec<(u32, T)>,
}

impl<T> Default for PerNode<T> {
    fn default() -> Self {
        Self {
            every: None,
            ranks: Vec::new(),
        }
    }
}

impl<T: NodeValue> PerNode<T> {
    /// The value of each of `nodes` nodes (`None` where none is given); a rank not below
    /// `nodes` is an error naming `flag`.
    pub fn resolve(&self, nodes: u32, flag: &str) -> Result<Vec<Option<T>>> {
        let mut out = vec![self.every.clone(); nodes as usize];
        for (rank, value) in &self.ranks {
            let slot = out.get_mut(*rank as usize).ok_or_else(|| {
                Error::Config(format!(
                    "{flag} {rank}:{}: rank {rank} out of range (a run of {nodes} nodes)",
                    value.show()
                ))
            })?;
            *slot = Some(value.clone());
        }
        Ok(out)
    }

    /// The values of a run without node `dead`: its entry dropped, the ranks above it moved
    /// down one (as the nodes are when the run is planned again without it).
    pub fn without_rank(&mut self, dead: u32) {
        self.ranks.retain(|(r, _)| *r != dead);
        for (r, _) in &mut self.ranks {
            if *r > dead {
                *r -= 1;
            }
        }
    }

    /// Whether no value is given.
    pub fn is_empty(&self) -> bool {
        self.every.is_none() && self.ranks.is_empty()
    }

    /// The entries of several (a flag given more than once), in order.
    pub fn joined<'a>(lists: impl IntoIterator<Item = &'a Self>) -> Self
    where
        T: 'a,
    {
        let mut out = Self::default();
        for list in lists {
            if list.every.is_some() {
                out.every.clone_from(&list.every);
            }
            out.ranks.extend(list.ranks.iter().cloned());
        }
        out
    }
}

impl<T: NodeValue> FromStr for PerNode<T> {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let mut out = Self::default();
        for part in text.split(',').map(str::trim) {
            let bad = |why: String| format!("{part:?}: {why}; expected VALUE or RANK:VALUE");
            match part.split_once(':') {
                Some((rank, value)) => {
                    let rank: u32 = rank
                        .trim()
                        .parse()
                        .map_err(|_| bad(format!("{rank:?} is not a rank")))?;
                    out.ranks.push((rank, T::parse(value).map_err(bad)?));
                }
                None => out.every = Some(T::parse(part).map_err(bad)?),
            }
        }
        Ok(out)
    }
}

impl<T: NodeValue> fmt::Display for PerNode<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let every = self.every.iter().map(NodeValue::show);
        let ranks = self.ranks.iter().map(|(r, v)| format!("{r}:{}", v.show()));
        let parts: Vec<String> = every.chain(ranks).collect();
        f.write_str(&parts.join(","))
    }
}

impl<T: NodeValue> Serialize for PerNode<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de, T: NodeValue> Deserialize<'de> for PerNode<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_show_back() {
        for (text, bytes) in [
            ("200M", 200 << 20),
            ("1.5GiB", 3 << 29),
            ("4096", 4096),
            ("1K", 1024),
        ] {
            let b = Bytes::parse(text).unwrap();
            assert_eq!(b, Bytes(bytes), "{text}");
            assert_eq!(Bytes::parse(&b.show()).unwrap(), b, "{text}");
        }
        assert!(Bytes::parse("12Q").is_err());
        assert!(Bytes::parse("-1M").is_err());
    }

    #[test]
    fn a_value_for_every_node_and_per_rank() {
        let limits: PerNode<Bytes> = "256M,1:1K".parse().unwrap();
        assert_eq!(
            limits.resolve(3, "--node-memory-limit").unwrap(),
            [
                Some(Bytes(256 << 20)),
                Some(Bytes(1024)),
                Some(Bytes(256 << 20))
            ]
        );
        let text = limits.to_string();
        assert_eq!(text.parse::<PerNode<Bytes>>().unwrap(), limits, "{text}");
        let only: PerNode<Bytes> = "1:1K".parse().unwrap();
        assert_eq!(
            only.resolve(3, "--node-memory-limit").unwrap(),
            [None, Some(Bytes(1024)), None]
        );
        let err = only.resolve(1, "--node-memory-limit").unwrap_err();
        assert!(err.to_string().contains("rank 1 out of range"), "{err}");
    }

    #[test]
    fn speeds_are_factors_of_at_most_one() {
        let speeds: PerNode<Speed> = "1:0.25".parse().unwrap();
        assert_eq!(
            speeds.resolve(2, "--node-speed").unwrap(),
            [None, Some(Speed(0.25))]
        );
        assert!(speeds.resolve(1, "--node-speed").is_err());
        assert!("1:1.5".parse::<PerNode<Speed>>().is_err());
        assert!("1:0".parse::<PerNode<Speed>>().is_err());
        assert!("x:0.5".parse::<PerNode<Speed>>().is_err());
    }

    #[test]
    fn a_run_without_a_rank_renumbers_the_rest() {
        let mut limits: PerNode<Bytes> = "256M,1:1K,3:1G".parse().unwrap();
        limits.without_rank(1);
        assert_eq!(limits.to_string(), "256M,2:1G");
    }
}
