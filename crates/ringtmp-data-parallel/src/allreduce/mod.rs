//! Ring all-reduce SGD (`--strategy allreduce`): data parallelism as PyTorch DDP and Horovod do
//! it. Every worker holds a replica and trains on its share of each global batch (worker batch
//! b, global N·b, in the same example order as every other strategy); the workers average their
//! gradients with the bandwidth-optimal ring all-reduce — reduce-scatter then all-gather, N − 1
//! steps each, 2(N − 1)/N of the gradients sent per worker per step — in buckets that overlap the
//! backward pass. The oracle: N workers of batch b equal `local` with batch N·b. A worker that
//! dies does not stop the run: the survivors re-form the ring from rank 0's replica and split
//! the same global batch among themselves, so the oracle holds across the failure too.
//!
//! # Layout
//! - [`job`]: the job and its options.
//! - [`driver`]: one worker: the overlapped reduction of its gradients, evaluation and outputs
//!   on rank 0.
//!
//! The ring's chunk plan, the bucketed reduction and the ring's re-formation around the dead are
//! the collective layer's ([`ringtmp_collective`]), which DiLoCo and rings of rings use too.

pub mod driver;
pub mod job;

pub use job::{AllReduceJob, AllReduceOptions, DEFAULT_BUCKET_MB, NAME};

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;

use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

impl Strategy for AllReduceJob {
    const NAME: &'static str = NAME;
    const FAMILY: ringtmp_contract::contract::Family = ringtmp_contract::contract::Family::Replicas;
    const CLIPS: bool = true;
    type Options = AllReduceOptions;

    fn plan(
        config: TrainConfig,
        options: &AllReduceOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        let bucket_mb = options.bucket_mb.unwrap_or(DEFAULT_BUCKET_MB);
        if !(bucket_mb.is_finite() && bucket_mb > 0.0) {
            return Err(Error::Config(format!(
                "--bucket-mb must be a positive number, got {bucket_mb}"
            )));
        }
        let (spec, workers) = crate::replicas::plan_spec(NAME, config, cluster, data, report)?;
        let global = spec.batch_size * workers;
        report.note(format!(
            "all-reduce: {workers} workers of batch {} (global batch {global}), buckets of {bucket_mb} MB{}, learning rate {}",
            spec.batch_size,
            if options.overlap.unwrap_or(true) {
                " overlapping the backward pass"
            } else {
                ""
            },
            spec.lr
        ));
        Ok(Self {
            spec,
            workers,
            bucket_bytes: (bucket_mb * 1e6) as usize,
            overlap: options.overlap.unwrap_or(true),
            node_speeds: cluster.node_speeds.clone(),
        })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.workers)?;
        if self.workers < 2 || self.bucket_bytes == 0 {
            return Err(Error::Config(format!(
                "invalid job: {} workers, buckets of {} bytes",
                self.workers, self.bucket_bytes
            )));
        }
        crate::replicas::check_speeds(&self.node_speeds, self.workers)
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        crate::replicas::every_other(rank, world)
    }

    fn expendable(&self, rank: u32) -> bool {
        rank != 0
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        driver::run_worker(self, rank, data, cx.net, cx.on_event).map(|o| o.summary)
    }
}
