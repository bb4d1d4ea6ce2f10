//! The emulated links' flags, declared once for `train`, `node`, `selftest` and `simulate`, and
//! resolved once into typed values: a node's card ([`Card`]: Mbit/s and one-way latency) and the
//! per-rank overrides of `--link` ([`LinkSpec`]).
//!
//! Invariants: a bandwidth is finite and positive, a latency finite and ≥ 0, whether it came from
//! a flag (checked as clap parses it) or from a `--config` file (checked by [`CardArgs::card`]);
//! the one text form of a card or an override is the flags' own, so a node process is given its
//! card by the same flags a user types.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use ringtmp_transport::Shaping;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::UsageError;

/// A node's emulated network card.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Card {
    /// Mbit/s of its one sending budget shared by all its links; `None`: unlimited.
    pub mbit: Option<f64>,
    /// One-way latency added to every frame it sends, ms.
    pub latency_ms: f64,
}

impl Card {
    /// What the transport applies.
    pub fn shaping(self) -> Shaping {
        Shaping {
            bandwidth_bps: self.mbit.map(|m| (m * 1e6) as u64).filter(|b| *b > 0),
            latency: Duration::from_secs_f64(self.latency_ms / 1e3),
        }
    }

    /// The flags that give a node process this card.
    pub fn to_args(self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(mbit) = self.mbit {
            args.extend(["--bandwidth-mbit".to_string(), mbit.to_string()]);
        }
        if self.latency_ms > 0.0 {
            args.extend(["--latency-ms".to_string(), self.latency_ms.to_string()]);
        }
        args
    }
}

/// A bandwidth in Mbit/s: finite and positive.
fn mbit(v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "a bandwidth must be a positive number of Mbit/s, got {v}"
        ))
    }
}

/// A latency in ms: finite and ≥ 0.
fn ms(v: f64) -> Result<f64, String> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("a latency must be a number of ms ≥ 0, got {v}"))
    }
}

fn parse_mbit(text: &str) -> Result<f64, String> {
    mbit(
        text.trim()
            .parse::<f64>()
            .map_err(|_| format!("{text:?} is not a number"))?,
    )
}

fn parse_ms(text: &str) -> Result<f64, String> {
    ms(text
        .trim()
        .parse::<f64>()
        .map_err(|_| format!("{text:?} is not a number"))?)
}

/// `--bandwidth-mbit` and `--latency-ms`: every node's card (`train`, `selftest`, `simulate`) or
/// this node's (`node`).
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CardArgs {
    /// Emulated network card, Mbit/s: one sending budget shared by all of a node's outgoing
    /// links [default: unlimited].
    #[arg(long, value_name = "MBIT", value_parser = parse_mbit)]
    pub bandwidth_mbit: Option<f64>,
    /// Emulated one-way latency of every frame a node sends, milliseconds [default: 0].
    #[arg(long, value_name = "MS", value_parser = parse_ms)]
    pub latency_ms: Option<f64>,
}

impl CardArgs {
    /// The card these flags (or a config file's keys) describe.
    pub fn card(&self) -> Result<Card, UsageError> {
        let flag = |name: &str, e: String| UsageError(format!("--{name}: {e}"));
        Ok(Card {
            mbit: self
                .bandwidth_mbit
                .map(|b| mbit(b).map_err(|e| flag("bandwidth-mbit", e)))
                .transpose()?,
            latency_ms: self
                .latency_ms
                .map(|l| ms(l).map_err(|e| flag("latency-ms", e)))
                .transpose()?
                .unwrap_or(0.0),
        })
    }

    /// These flags, with `other`'s where these leave one unset.
    pub fn merged_over(&self, other: &Self) -> Self {
        Self {
            bandwidth_mbit: self.bandwidth_mbit.or(other.bandwidth_mbit),
            latency_ms: self.latency_ms.or(other.latency_ms),
        }
    }
}

/// One `--link RANK:MBIT[:MS]` override: that rank's card (its latency, where not given, the
/// run's `--latency-ms`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSpec {
    /// The node.
    pub rank: u32,
    /// Its card's Mbit/s.
    pub mbit: f64,
    /// Its latency, ms.
    pub latency_ms: Option<f64>,
}

impl FromStr for LinkSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = |why: String| format!("{text:?}: {why}");
        let fields: Vec<&str> = text.split(':').map(str::trim).collect();
        if !(2..=3).contains(&fields.len()) {
            return Err(bad("expected RANK:MBIT or RANK:MBIT:MS".into()));
        }
        let rank = fields[0]
            .parse()
            .map_err(|_| bad(format!("{:?} is not a rank", fields[0])))?;
        let mbit = parse_mbit(fields[1]).map_err(bad)?;
        let latency_ms = fields
            .get(2)
            .map(|t| parse_ms(t))
            .transpose()
            .map_err(bad)?;
        Ok(Self {
            rank,
            mbit,
            latency_ms,
        })
    }
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.rank, self.mbit)?;
        match self.latency_ms {
            Some(ms) => write!(f, ":{ms}"),
            None => Ok(()),
        }
    }
}

impl Serialize for LinkSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LinkSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `--link` overrides from a config file: a list of strings, each one override or several
/// separated by commas (as on the command line).
pub fn specs_from_strings<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<LinkSpec>>, D::Error> {
    let Some(entries) = Option::<Vec<String>>::deserialize(d)? else {
        return Ok(None);
    };
    let mut specs = Vec::new();
    for entry in entries {
        for part in entry.split(',').filter(|p| !p.trim().is_empty()) {
            specs.push(
                part.parse()
                    .map_err(|e| serde::de::Error::custom(format!("link {e}")))?,
            );
        }
    }
    Ok(Some(specs))
}

/// Every node's card in a run of `nodes`: `base` for all, then the overrides by rank.
pub fn node_cards(base: Card, overrides: &[LinkSpec], nodes: u32) -> Result<Vec<Card>, UsageError> {
    let mut cards = vec![base; nodes as usize];
    for spec in overrides {
        let card = cards.get_mut(spec.rank as usize).ok_or_else(|| {
            UsageError(format!(
                "--link {spec}: rank {} does not exist in a run of {nodes} nodes",
                spec.rank
            ))
        })?;
        *card = Card {
            mbit: Some(spec.mbit),
            latency_ms: spec.latency_ms.unwrap_or(base.latency_ms),
        };
    }
    Ok(cards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_print_and_apply_by_rank() {
        let spec: LinkSpec = "2:100:5".parse().unwrap();
        assert_eq!(spec.to_string(), "2:100:5");
        assert_eq!("1:50".parse::<LinkSpec>().unwrap().latency_ms, None);
        for bad in [
            "1",
            "x:100",
            "1:0",
            "1:-3",
            "1:100:-1",
            "1:100:2:3",
            "1:inf",
        ] {
            assert!(bad.parse::<LinkSpec>().is_err(), "{bad}");
        }
        let base = CardArgs {
            bandwidth_mbit: Some(1000.0),
            latency_ms: Some(2.0),
        }
        .card()
        .unwrap();
        let cards = node_cards(base, &["1:50".parse().unwrap()], 3).unwrap();
        assert_eq!(
            cards[1],
            Card {
                mbit: Some(50.0),
                latency_ms: 2.0
            }
        );
        assert_eq!(cards[2], base);
        assert!(node_cards(base, &["3:50".parse().unwrap()], 3).is_err());
        assert_eq!(
            base.to_args(),
            ["--bandwidth-mbit", "1000", "--latency-ms", "2"]
        );
        assert_eq!(base.shaping().bandwidth_bps, Some(1_000_000_000));
        let from_file = CardArgs {
            bandwidth_mbit: Some(-1.0),
            latency_ms: None,
        };
        assert!(from_file.card().is_err());
    }

    #[test]
    fn a_config_files_overrides_may_be_comma_separated() {
        #[derive(Deserialize)]
        struct File {
            #[serde(default, deserialize_with = "specs_from_strings")]
            link: Option<Vec<LinkSpec>>,
        }
        let file: File = toml::from_str("link = [\"1:50,2:10:4\", \"3:20\"]").unwrap();
        let ranks: Vec<u32> = file.link.unwrap().iter().map(|s| s.rank).collect();
        assert_eq!(ranks, [1, 2, 3]);
    }
}
