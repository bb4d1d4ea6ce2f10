//! `ringtmp train --strategy ring` options: the flags (and `--config` keys) the ring's planner
//! reads, with how they parse.

use serde::{Deserialize, Serialize};

use crate::plan::partition::{CutInside, StageRanges};
use crate::plan::replica_sync::ReplicaSync;
use crate::run::schedule::Schedule;
use ringtmp_contract::error::{Error, Result};

/// `ringtmp train --strategy ring` options (flags, and keys of a `--config` file).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(rename_all = "kebab-case")]
pub struct RingOptions {
    /// Ring: pipeline schedule [default: async].
    #[cfg_attr(feature = "cli", arg(long, value_enum))]
    pub schedule: Option<Schedule>,
    /// Ring: micro-batches per mini-batch [default: 1 under async, else the number of nodes].
    #[cfg_attr(feature = "cli", arg(long))]
    pub micro_batches: Option<usize>,
    /// Ring, async schedule: most micro-batches in flight [default: enough to cover a
    /// micro-batch's round trip (compute and links) at the slowest stage's pace, at least one
    /// per node].
    #[cfg_attr(feature = "cli", arg(long, value_name = "W"))]
    pub in_flight: Option<usize>,
    /// Ring: use every node given even when the plan predicts fewer train as fast (within 2%)
    /// or faster [default: false — the plan uses the fewest nodes that train fastest, and the
    /// others leave once the ring has formed].
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub use_all_nodes: Option<bool>,
    /// Ring: layer ranges per node instead of the planner, e.g. `0:4,4:8,8:10`.
    #[cfg_attr(feature = "cli", arg(long, value_name = "RANGES"))]
    #[serde(default, with = "ringtmp_contract::text_form")]
    pub partition: Option<StageRanges>,
    /// Ring (gpipe, 1f1b): compute linear weight gradients once per mini-batch rather than per
    /// micro-batch (faster; keeps those layers' inputs until the step) [default: true].
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub defer_weight_grads: Option<bool>,
    /// Ring: the master also holds the last layers (U-shape), so the final activations and
    /// logits never reach another node.
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub master_holds_head: Option<bool>,
    /// Ring: R rings of --nodes / R nodes each, side by side (pipeline × data parallelism): each
    /// trains on its share of every global batch of R × --batch-size, and corresponding stages
    /// average their gradients (ring all-reduce) before their step [default: 1].
    #[cfg_attr(feature = "cli", arg(long, value_name = "R"))]
    pub replicas: Option<usize>,
    /// Ring: rings of S nodes each (rings of rings, as --replicas --nodes/S): the form that
    /// stays valid across a sweep of node counts.
    #[cfg_attr(
        feature = "cli",
        arg(long, value_name = "S", conflicts_with = "replicas")
    )]
    pub ring_nodes: Option<usize>,
    /// Ring, rings of rings: how the copies of a stage stay together. `gradients` (default):
    /// they average their gradients before every step (a flushed schedule; exactly one ring of
    /// the global batch). `every:K`: each ring trains on its own (any schedule, async by
    /// default) and the copies average their parameters every K mini-batches and at the end
    /// (periodic model averaging, "local SGD": K times fewer synchronisations). `adpsgd[:K]`:
    /// each ring trains on its own and the copies gossip their parameters (AD-PSGD's bipartite
    /// pairs, an exchange started every K mini-batches [default: 1], no ring waiting for
    /// another; an even number of rings) and average once at the end.
    /// `diloco:H[:LR:MU[:SCHEDULE]]`: each ring trains on its own and every H mini-batches the
    /// copies of each stage take one DiLoCo outer step together (their mean pseudo-gradient
    /// through SGD with Nesterov momentum, lr 0.7 and momentum 0.9 unless given; SCHEDULE
    /// `inner` makes the outer step follow the inner learning-rate schedule, as DiLoCo's
    /// `--outer-schedule inner`), stage by stage.
    #[cfg_attr(
        feature = "cli",
        arg(long, value_name = "gradients|every:K|adpsgd[:K]|diloco:H")
    )]
    #[serde(default, with = "ringtmp_contract::text_form")]
    pub replica_sync: Option<ReplicaSync>,
    /// Ring: every node also keeps its successor's block and optimizer state, refreshed every K
    /// mini-batches [default K: 20]; when a non-master node dies, its predecessor takes its
    /// layers over and the ring closes around it, without a restart or a checkpoint. With
    /// --replicas (--replica-sync every:K or diloco:H) a round follows every synchronisation,
    /// and a ring heals while the others go on.
    #[cfg_attr(feature = "cli", arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "20"))]
    pub stage_replicas: Option<u64>,
    /// Ring: let the planner cut a linear layer by its output features between two stages
    /// where whole layers cannot balance them (its head ends one stage, its tail starts the
    /// next): `true`, `false`, or the cuts to make, `LAYER:SPLIT[,LAYER:SPLIT]` (layer `LAYER`
    /// after `SPLIT` of its outputs, each a boundary between two stages; the planner places the
    /// others) [default:
    /// true; not with --partition].
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "true|false|L:S,..."))]
    pub cut_inside: Option<CutInsideChoice>,
}

ringtmp_contract::options_merge!(
    RingOptions,
    schedule,
    micro_batches,
    in_flight,
    use_all_nodes,
    partition,
    defer_weight_grads,
    master_holds_head,
    replicas,
    ring_nodes,
    replica_sync,
    stage_replicas,
    cut_inside
);

impl RingOptions {
    /// Rings side by side on `nodes` nodes: `--replicas`, or `--nodes` / `--ring-nodes`.
    pub fn rings(&self, nodes: u32) -> Result<usize> {
        match (self.replicas, self.ring_nodes) {
            (Some(_), Some(_)) => Err(Error::Config(
                "--replicas and --ring-nodes say the same thing: give one".into(),
            )),
            (None, Some(s)) if s < 2 || !(nodes as usize).is_multiple_of(s) => {
                Err(Error::Config(format!(
                    "--ring-nodes {s}: --nodes {nodes} must split into rings of at least 2 nodes \
                 each"
                )))
            }
            (None, Some(s)) => Ok(nodes as usize / s),
            (r, None) => Ok(r.unwrap_or(1)),
        }
    }
}

impl RingOptions {
    /// Refuses settings that cannot work whatever the model.
    pub fn check(&self) -> Result<()> {
        if self.stage_replicas == Some(0) {
            return Err(Error::Config(
                "--stage-replicas K refreshes every K mini-batches: K must be at least 1".into(),
            ));
        }
        if self.stage_replicas.is_some() && self.master_holds_head == Some(true) {
            return Err(Error::Config(
                "--stage-replicas and --master-holds-head do not go together yet: the head's \
                 layers would have no replica"
                    .into(),
            ));
        }
        if let Some(w) = self.in_flight {
            if w == 0 {
                return Err(Error::Config("--in-flight must be at least 1".into()));
            }
            if self.schedule.is_some_and(|s| s != Schedule::Async) {
                return Err(Error::Config(
                    "--in-flight applies to the async schedule only (gpipe and 1f1b keep their \
                     micro-batches in flight)"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

/// `--cut-inside`: whether the planner may cut inside linear layers, or the cuts to make.
#[derive(Clone, Debug, PartialEq)]
pub enum CutInsideChoice {
    /// The planner decides (`true`) or keeps whole layers (`false`).
    Planner(bool),
    /// These cuts, made whatever the planner would choose, each a boundary between two stages.
    At(Vec<CutInside>),
    /// A restarted run's cuts (its first attempt's, so that it computes bit for bit what an
    /// uninterrupted run does): made, and boundaries only where they fit — a ring shrunk by a
    /// lost node may have fewer boundaries than cuts. Written and read back as `At`.
    Kept(Vec<CutInside>),
}

impl std::str::FromStr for CutInsideChoice {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text.trim() {
            "true" | "on" => return Ok(Self::Planner(true)),
            "false" | "off" => return Ok(Self::Planner(false)),
            _ => {}
        }
        let cuts = text
            .split(',')
            .map(|part| {
                let parsed = part.split_once(':').and_then(|(l, s)| {
                    Some(CutInside {
                        layer: l.trim().parse().ok()?,
                        split: s.trim().parse().ok()?,
                    })
                });
                parsed.ok_or_else(|| {
                    format!("{part:?}: expected true, false or LAYER:SPLIT[,LAYER:SPLIT]")
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self::At(cuts))
    }
}

impl std::fmt::Display for CutInsideChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Planner(on) => write!(f, "{on}"),
            Self::At(cuts) | Self::Kept(cuts) => {
                let parts: Vec<String> = cuts
                    .iter()
                    .map(|c| format!("{}:{}", c.layer, c.split))
                    .collect();
                write!(f, "{}", parts.join(","))
            }
        }
    }
}

impl Serialize for CutInsideChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Planner(on) => s.serialize_bool(*on),
            Self::At(_) | Self::Kept(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for CutInsideChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            On(bool),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::On(on) => Ok(Self::Planner(on)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_inside_reads_as_a_flag_a_config_value_or_a_list_of_cuts() {
        use CutInsideChoice::{At, Planner};
        assert_eq!("true".parse(), Ok(Planner(true)));
        assert_eq!("off".parse(), Ok(Planner(false)));
        let cuts = At(vec![
            CutInside {
                layer: 9,
                split: 320,
            },
            CutInside {
                layer: 13,
                split: 64,
            },
        ]);
        assert_eq!("9:320, 13:64".parse(), Ok(cuts.clone()));
        assert!("9".parse::<CutInsideChoice>().is_err());
        assert!("9:-1".parse::<CutInsideChoice>().is_err());
        // A config file's `cut-inside = false` and `cut-inside = "9:320,13:64"` (a boolean or a
        // string, whatever the format).
        let off: CutInsideChoice = serde_json::from_str("false").unwrap();
        assert_eq!(off, Planner(false));
        let at: CutInsideChoice = serde_json::from_str("\"9:320,13:64\"").unwrap();
        assert_eq!(at, cuts);
        assert_eq!(serde_json::to_string(&at).unwrap(), "\"9:320,13:64\"");
        assert_eq!(serde_json::to_string(&off).unwrap(), "false");
    }
}
