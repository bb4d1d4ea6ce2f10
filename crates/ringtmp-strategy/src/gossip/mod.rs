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
use crate::error::{Error, Result};
use crate::job::{Cluster, NodeCx, Strategy, options_merge, ring_neighbours, validate_shared};
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
}

options_merge!(DpsgdOptions, topology);

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
        // The gossip graph, and the ring links the consensus all-reduce runs on.
        let mut near = mixing::neighbours(self.topology, rank, world);
        near.extend(ring_neighbours(rank, world));
        near
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        dpsgd::run_worker(self, rank, data, cx.net, cx.on_event).map(|o| o.summary)
    }
}
