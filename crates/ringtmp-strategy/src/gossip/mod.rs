//! Decentralised (gossip) SGD: no server and no global reduction per step; every worker keeps
//! its own model and averages it with its neighbours'.
//!
//! # Layout
//! - [`mixing`]: the communication graphs (`ring`, `exp`) and their mixing matrices.
//! - [`dpsgd`]: D-PSGD (`--strategy dpsgd`), synchronous gossip.
//! - [`adpsgd`]: AD-PSGD (`--strategy adpsgd`), asynchronous pairwise gossip, with rank 0's
//!   bookkeeping in [`coordinator`].

pub mod adpsgd;
pub mod coordinator;
pub mod dpsgd;
pub mod mixing;

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use serde::{Deserialize, Serialize};

use crate::TrainConfig;
use crate::contract::{Cluster, NodeCx, Strategy, options_merge, validate_shared};
use crate::error::{Error, Result};
use crate::spec::RunSpec;
pub use adpsgd::AdpsgdJob;
use mixing::Topology;

/// `--strategy` name of D-PSGD.
pub const NAME: &str = "dpsgd";

/// `ringtmp train --strategy dpsgd` options (flags, and keys of a `--config` file).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DpsgdOptions {
    /// D-PSGD: communication graph, ring or exp (the ring plus links 2^i hops away)
    /// [default: ring].
    #[arg(long, value_enum)]
    pub topology: Option<Topology>,
    /// `--drop-dead-workers`, which the parameter server's options own (one flag for both);
    /// the CLI copies it here.
    #[arg(skip)]
    #[serde(skip)]
    pub drop_dead_workers: Option<bool>,
}

options_merge!(DpsgdOptions, topology, drop_dead_workers);

/// D-PSGD's job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DpsgdJob {
    /// What every job shares; `batch_size` is one worker's share of each global batch.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Workers (every node is one).
    pub workers: usize,
    /// Who averages with whom.
    pub topology: Topology,
    /// Emulated relative speed per rank.
    pub node_speeds: Vec<f64>,
    /// A dead worker is dropped by its neighbours instead of ending the run.
    #[serde(default)]
    pub drop_dead_workers: bool,
}

impl Strategy for DpsgdJob {
    const NAME: &'static str = NAME;
    type Options = DpsgdOptions;

    fn plan(
        config: TrainConfig,
        options: &DpsgdOptions,
        cluster: &Cluster,
        data: &Dataset,
    ) -> Result<Self> {
        // Averaging the models averages their updates: the consensus moves as all-reduce's
        // model does, so the default rate scales with the workers as there.
        let (spec, workers) = crate::data_parallel::plan_spec(NAME, config, cluster, data)?;
        let global = spec.batch_size * workers;
        let topology = options.topology.unwrap_or_default();
        eprintln!(
            "d-psgd: {workers} workers of batch {} (global batch {global}), {topology:?} graph \
             (second eigenvalue of the mixing matrix {:.3}), learning rate {}",
            spec.batch_size,
            mixing::second_eigenvalue(topology, workers as u32),
            spec.lr
        );
        Ok(Self {
            spec,
            workers,
            topology,
            node_speeds: cluster.node_speeds.clone(),
            drop_dead_workers: options.drop_dead_workers.unwrap_or(false),
        })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.workers)?;
        if self.workers < 2 {
            return Err(Error::Config(format!(
                "invalid job: {} workers",
                self.workers
            )));
        }
        crate::data_parallel::check_speeds(&self.node_speeds, self.workers)
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        // The gossip graph, and rank 0 (which gathers the models for the consensus) with all.
        let mut near = mixing::neighbours(self.topology, rank, world);
        if rank == 0 {
            near.extend(1..world);
        } else {
            near.insert(0);
        }
        near
    }

    fn expendable(&self, rank: u32) -> bool {
        self.drop_dead_workers && rank != 0
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        dpsgd::run_worker(self, rank, data, cx.net, cx.on_event).map(|o| o.summary)
    }
}

/// Workers' models by rank.
pub type Models = Vec<(u32, Vec<f32>)>;

/// The mean of the workers' `models` (the consensus model x̄ the papers evaluate) and their
/// consensus distance, mean over workers of ‖x_i − x̄‖ / ‖x̄‖; sums in f64, in the given order.
pub fn consensus(models: &[(u32, Vec<f32>)]) -> (Vec<f32>, f64) {
    let len = models.first().map_or(0, |m| m.1.len());
    let mut sum = vec![0.0f64; len];
    for (_, m) in models {
        sum.iter_mut().zip(m).for_each(|(s, v)| *s += f64::from(*v));
    }
    let k = models.len().max(1) as f64;
    let mean: Vec<f32> = sum.iter().map(|s| (s / k) as f32).collect();
    let norm = mean
        .iter()
        .map(|v| f64::from(*v).powi(2))
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let distance = models
        .iter()
        .map(|(_, m)| {
            let d: f64 = m
                .iter()
                .zip(&mean)
                .map(|(x, a)| f64::from(x - a).powi(2))
                .sum();
            d.sqrt() / norm
        })
        .sum::<f64>()
        / k;
    (mean, distance)
}

/// A whole model as a `Params` tensor of `dtype` on the wire; `step` and `kind` (its
/// `micro_batch`) say what it is for.
pub(crate) fn model_message(
    net: &dyn ringtmp_transport::Transport,
    model: &[f32],
    step: u64,
    kind: u64,
    dtype: ringtmp_wire::Dtype,
) -> ringtmp_wire::Message {
    use ringtmp_wire::{TensorHeader, TensorTag};
    let header = TensorHeader {
        run_id: 0,
        step,
        micro_batch: kind,
        tag: TensorTag::Params,
        dtype,
        shape: vec![model.len() as u32],
    };
    let mut payload = net.buffers().take(model.len() * dtype.size() as usize);
    ringtmp_wire::message::tensor_bytes_into(model, dtype, &mut payload);
    ringtmp_wire::Message::Tensor(header, payload)
}

/// Whether a tensor is a model of `len` values: its header's count (checked against the payload
/// when the frame was decoded; a phantom run's payload carries no values).
pub(crate) fn holds(header: &ringtmp_wire::TensorHeader, len: usize) -> bool {
    header.elements() == Some(len as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn consensus_is_the_mean_and_the_relative_spread() {
        let (mean, distance) = super::consensus(&[(0, vec![1.0, 0.0]), (1, vec![3.0, 0.0])]);
        assert_eq!(mean, [2.0, 0.0]);
        assert!((distance - 0.5).abs() < 1e-12, "{distance}");
    }
}
