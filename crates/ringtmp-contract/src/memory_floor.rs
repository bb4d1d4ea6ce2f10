//! Refusing, before any node starts, a run whose nodes cannot hold what their role needs.
//!
//! The data-parallel strategies give every worker a whole replica, and a parameter server's
//! workers hold the whole model too. Where the nodes have memory limits (`--node-memory-limit`)
//! a model larger than a node would start, allocate, and be killed minutes later. This module
//! counts the *floor* of what a node holds — parameters, gradients, the optimizer state it
//! keeps, and the process's own baseline — which activations, messages and buffers only add
//! to: a run refused here cannot fit, and one that passes may still not (the ring's planner,
//! which profiles, is the one that fits a model to its nodes).

use ringtmp_model::{Layer, OptimizerConfig};

use crate::contract::{Cluster, show_bytes};
use crate::error::{Error, Result};

/// What a node process needs besides its stage's parameters, gradients, optimizer state and
/// stashes, and besides its GEMM workspace: the binary, the runtimes' threads and buffers, the
/// allocator. Measured (docs/BENCHMARKS.md): a lenet ring node with a 0.1 MB stage
/// peaks at 14–17 MB; wide-mlp's master, 25 MiB beyond its stage, workspace and dataset.
pub const PROCESS_BASELINE_BYTES: u64 = 32 << 20;

/// Optimizer state values per parameter: SGD's velocity (none without momentum), Adam's two
/// moments.
pub fn state_copies(optimizer: &OptimizerConfig) -> u64 {
    match optimizer {
        OptimizerConfig::Sgd { momentum, .. } if *momentum == 0.0 => 0,
        OptimizerConfig::Sgd { .. } => 1,
        OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. } => 2,
    }
}

/// What a node holds at least: `values` f32 values per parameter of `params` parameters, and
/// the process's baseline.
#[derive(Clone, Debug)]
pub struct Floor {
    /// Who holds it (`each worker`, `each server`).
    pub who: String,
    /// Parameters held.
    pub params: u64,
    /// Values per parameter (the parameters, gradients, optimizer state).
    pub values: u64,
    /// What those values are, for the message.
    pub what: String,
}

impl Floor {
    /// Bytes.
    pub fn bytes(&self) -> u64 {
        self.params * self.values * 4 + PROCESS_BASELINE_BYTES
    }
}

/// Parameters of `layers`.
pub fn params_of(layers: &[Layer]) -> u64 {
    layers.iter().map(|l| l.param_count() as u64).sum()
}

/// The name of the optimizer state per parameter, for messages.
pub fn state_words(optimizer: &OptimizerConfig) -> &'static str {
    match state_copies(optimizer) {
        0 => "",
        1 => " and SGD's velocity",
        _ => " and Adam's two moments",
    }
}

/// Refuses `strategy` when a node given to `floor.who` (ranks `ranks`) has a memory limit below
/// the floor, with the figures and the way out.
pub fn check(
    strategy: &str,
    floor: &Floor,
    ranks: std::ops::Range<usize>,
    cluster: &Cluster,
) -> Result<()> {
    let need = floor.bytes();
    let tightest = cluster.memory_limits
        [ranks.start.min(cluster.memory_limits.len())..ranks.end.min(cluster.memory_limits.len())]
        .iter()
        .enumerate()
        .filter_map(|(i, l)| l.map(|l| (ranks.start + i, l)))
        .min_by_key(|&(_, l)| l);
    match tightest {
        Some((rank, limit)) if need > limit => Err(Error::Config(format!(
            "--strategy {strategy}: {} holds {:.1} M parameters{} ({}) plus the process's {} \
             before any activation: {} in all, more than node {rank}'s limit of {} \
             (--node-memory-limit); the ring splits the model over its nodes (--strategy ring)",
            floor.who,
            floor.params as f64 / 1e6,
            floor.what,
            show_bytes(floor.params * floor.values * 4),
            show_bytes(PROCESS_BASELINE_BYTES),
            show_bytes(need),
            show_bytes(limit),
        ))),
        _ => Ok(()),
    }
}

/// The floor of a data-parallel worker: a whole replica's parameters, gradients and optimizer
/// state.
pub fn whole_replica(layers: &[Layer], optimizer: &OptimizerConfig) -> Floor {
    Floor {
        who: "each worker".into(),
        params: params_of(layers),
        values: 2 + state_copies(optimizer),
        what: format!(", their gradients{}", state_words(optimizer)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_over_the_limit_is_refused_with_its_figures_and_one_under_passes() {
        let layers = ringtmp_model::ModelSpec::preset("mlp", 10)
            .unwrap()
            .build(&ringtmp_model::Shape::image(28, 28, 1), 10)
            .unwrap();
        let adam = OptimizerConfig::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let floor = whole_replica(&layers, &adam);
        // 2,913,290 parameters × 4 values × 4 bytes = 46.6 MB, plus the 32 MiB baseline.
        assert_eq!(floor.bytes(), 2_913_290 * 16 + (32 << 20));
        let mut cluster = Cluster::local(3);
        cluster.memory_limits = vec![None, Some(64 << 20), Some(256 << 20)];
        let e = check("allreduce", &floor, 0..3, &cluster)
            .unwrap_err()
            .to_string();
        for needle in [
            "each worker holds 2.9 M parameters",
            "Adam's two moments (44 MiB)",
            "76 MiB in all",
            "node 1's limit of 64 MiB",
            "--strategy ring",
        ] {
            assert!(e.contains(needle), "{needle:?} in {e}");
        }
        assert!(check("allreduce", &floor, 2..3, &cluster).is_ok());
    }
}
