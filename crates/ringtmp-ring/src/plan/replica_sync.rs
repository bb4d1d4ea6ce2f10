//! `--replica-sync`: how the copies of a stage agree when rings of rings train side by side —
//! their gradients averaged before every step, their parameters averaged every K mini-batches,
//! gossiped AD-PSGD's way, or one DiLoCo outer step every H mini-batches — as a typed value
//! parsed where the flag or the config file is read.
//!
//! Invariant: [`ReplicaSync`]'s text (its `Display`) parses back to the same value.

use std::fmt;
use std::str::FromStr;

use ringtmp_collective::outer::OuterConfig;

/// How the copies of a stage agree (`--replica-sync`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReplicaSync {
    /// `gradients`: the copies average their gradients before every step (the rings stay
    /// identical).
    Gradients,
    /// `every:K`: each ring trains alone; the copies average their parameters every K
    /// mini-batches.
    Every(u64),
    /// `adpsgd[:K]`: the copies gossip, an exchange started every K mini-batches.
    Gossip(u64),
    /// `diloco:H[:LR:MU[:SCHEDULE]]`: every H mini-batches the copies take one DiLoCo outer step
    /// together.
    Diloco {
        /// Mini-batches between outer steps.
        h: u64,
        /// The outer optimizer.
        outer: OuterConfig,
    },
}

impl ReplicaSync {
    /// (average every K, gossip every K, the outer optimizer): 0 where the rule does not.
    pub fn periods(self) -> (u64, u64, Option<OuterConfig>) {
        match self {
            Self::Gradients => (0, 0, None),
            Self::Every(k) => (k, 0, None),
            Self::Gossip(k) => (0, k, None),
            Self::Diloco { h, outer } => (h, 0, Some(outer)),
        }
    }
}

impl FromStr for ReplicaSync {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{text:?}: expected gradients, every:K, adpsgd, adpsgd:K or \
                 diloco:H[:LR:MOMENTUM[:SCHEDULE]] (K, H ≥ 1; an outer rate > 0, a momentum in \
                 [0, 1), the outer schedule constant or inner)"
            )
        };
        let count = |k: &str| k.parse::<u64>().ok().filter(|k| *k >= 1).ok_or_else(bad);
        let parts: Vec<&str> = text.trim().split(':').collect();
        match parts.as_slice() {
            ["gradients"] => Ok(Self::Gradients),
            ["every", k] => Ok(Self::Every(count(k)?)),
            ["adpsgd"] => Ok(Self::Gossip(1)),
            ["adpsgd", k] => Ok(Self::Gossip(count(k)?)),
            ["diloco", h, rest @ ..] => {
                let mut outer = OuterConfig::PAPER;
                match rest {
                    [] => {}
                    [lr, mu, schedule @ ..] if schedule.len() <= 1 => {
                        outer.lr = lr.parse().map_err(|_| bad())?;
                        outer.momentum = mu.parse().map_err(|_| bad())?;
                        outer.follow_schedule = match schedule.first() {
                            None | Some(&"constant") => false,
                            Some(&"inner") => true,
                            Some(_) => return Err(bad()),
                        };
                    }
                    _ => return Err(bad()),
                }
                if !(outer.lr.is_finite() && outer.lr > 0.0 && (0.0..1.0).contains(&outer.momentum))
                {
                    return Err(bad());
                }
                Ok(Self::Diloco {
                    h: count(h)?,
                    outer,
                })
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for ReplicaSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Gradients => f.write_str("gradients"),
            Self::Every(k) => write!(f, "every:{k}"),
            Self::Gossip(1) => f.write_str("adpsgd"),
            Self::Gossip(k) => write!(f, "adpsgd:{k}"),
            Self::Diloco { h, outer } if outer == OuterConfig::PAPER => write!(f, "diloco:{h}"),
            Self::Diloco { h, outer } => {
                let schedule = if outer.follow_schedule { ":inner" } else { "" };
                write!(f, "diloco:{h}:{}:{}{schedule}", outer.lr, outer.momentum)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper's outer step unless given, the schedule-following one under `inner`; anything
    /// else is refused; every value's text reads back as itself.
    #[test]
    fn diloco_replica_sync_reads_its_outer_step() {
        let read = |text: &str| text.parse::<ReplicaSync>();
        let paper = OuterConfig::PAPER;
        assert_eq!(read("diloco:50").unwrap().periods(), (50, 0, Some(paper)));
        let (_, _, outer) = read("diloco:50:0.5:0.8").unwrap().periods();
        let outer = outer.unwrap();
        assert_eq!((outer.lr, outer.momentum), (0.5, 0.8));
        assert!(!outer.follow_schedule);
        let constant = read("diloco:50:0.5:0.8:constant").unwrap().periods().2;
        assert!(!constant.unwrap().follow_schedule);
        let inner = read("diloco:50:0.5:0.8:inner").unwrap().periods().2;
        assert!(inner.unwrap().follow_schedule);
        for bad in [
            "diloco:50:0.5",
            "diloco:50:0.5:0.8:later",
            "diloco:50:0.5:0.8:inner:x",
            "diloco:0",
            "diloco:50:0:0.9",
            "diloco:50:0.7:1",
            "every:0",
            "adpsgd:x",
            "sometimes",
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
        for text in [
            "gradients",
            "every:3",
            "adpsgd",
            "adpsgd:4",
            "diloco:50",
            "diloco:50:0.5:0.8",
            "diloco:50:0.5:0.8:inner",
        ] {
            let value = read(text).unwrap();
            assert_eq!(value.to_string(), text);
            assert_eq!(read(&value.to_string()).unwrap(), value);
        }
        assert_eq!(read("adpsgd").unwrap().periods(), (0, 1, None));
        assert_eq!(read("every:7").unwrap().periods(), (7, 0, None));
    }
}
