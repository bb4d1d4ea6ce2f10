//! DiLoCo (`--strategy diloco`; Douillard et al., "DiLoCo: Distributed Low-Communication
//! Training of Language Models", 2023, and "Streaming DiLoCo", 2025): data parallelism that
//! talks every H steps instead of every step. Every worker trains its replica alone for H inner
//! steps (its share of each global batch, in the same example order as every other strategy,
//! with the job's optimizer as the inner one); then the workers average their pseudo-gradients
//! (outer parameters − their own) with all-reduce SGD's bucketed ring all-reduce and apply one
//! outer step, SGD with Nesterov momentum (lr 0.7, momentum 0.9: the paper's). With F
//! fragments, each fragment of the model's tensors synchronises every H steps in turn, H/F steps
//! apart, so the link carries 1/F of the model at a time.
//!
//! Oracles: with H = 1 and an outer SGD of rate 1 without momentum, DiLoCo is all-reduce SGD
//! (the mean of the workers' stepped replicas is the step of the mean gradient); the outer step
//! on a tiny model equals a hand-computed one (`tests/diloco.rs`, and
//! [`ringtmp_collective::outer`]'s tests).
//!
//! # Layout
//! - [`job`]: the job and its options.
//! - `cadence`: when rounds launch, land and start again (the rules, without links).
//! - `round`: one synchronisation: pseudo-gradients, their reduction, the outer step.
//! - [`driver`]: one worker: inner steps, synchronisations, the ring re-formed around the dead.
//!
//! The outer optimizer, the fragments and when each synchronises are the collective layer's
//! ([`ringtmp_collective::outer`]), as are the reduction and the elastic ring it runs on.

mod cadence;
pub mod driver;
pub mod job;
mod round;

pub use job::{DilocoJob, DilocoOptions, NAME, OuterDtype, OuterSchedule};

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;

use ringtmp_collective::outer::OuterConfig;
use ringtmp_collective::reduce::DEFAULT_BUCKET_MB;
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

impl Strategy for DilocoJob {
    const NAME: &'static str = NAME;
    const FAMILY: ringtmp_contract::contract::Family = ringtmp_contract::contract::Family::Replicas;
    const SHORT_FORM: Option<(&'static str, &'static str)> = Some(("--inner-steps", "H"));
    const CLIPS: bool = true;
    type Options = DilocoOptions;

    fn plan(
        config: TrainConfig,
        options: &DilocoOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        // A worker holds a replica and its inner optimizer (as all-reduce's do) and the outer
        // parameters and momentum.
        let layers = ringtmp_contract::layers_for(&config.model, data)?;
        let mut floor = ringtmp_contract::memory_floor::whole_replica(&layers, &config.optimizer);
        floor.values += 2;
        floor.what.push_str(", the outer parameters and momentum");
        ringtmp_contract::memory_floor::check(NAME, &floor, 0..cluster.nodes as usize, cluster)?;
        // An inner step is one worker's batch alone: the one-node defaults hold.
        let (spec, workers) =
            crate::replicas::plan_spec_with(NAME, config, cluster, data, report, false)?;
        let inner_steps = options.inner_steps.unwrap_or(if spec.sequence.is_some() {
            job::DEFAULT_INNER_STEPS_TEXT
        } else {
            job::DEFAULT_INNER_STEPS
        });
        let outer = OuterConfig {
            lr: options.outer_lr.unwrap_or(OuterConfig::PAPER.lr),
            momentum: options
                .outer_momentum
                .unwrap_or(OuterConfig::PAPER.momentum),
            nesterov: options
                .outer_nesterov
                .unwrap_or(OuterConfig::PAPER.nesterov),
            follow_schedule: options.outer_schedule == Some(job::OuterSchedule::Inner),
        };
        let fragments = options.outer_fragments.unwrap_or(1);
        if inner_steps == 0 || fragments == 0 || fragments as u64 > inner_steps {
            return Err(Error::Config(format!(
                "--inner-steps {inner_steps} --outer-fragments {fragments}: both at least 1, and \
                 no more fragments than inner steps (each synchronises every H/F steps)"
            )));
        }
        let interval = inner_steps / fragments as u64;
        let overlap = options.outer_overlap.unwrap_or(u64::from(fragments > 1));
        if overlap > interval {
            return Err(Error::Config(format!(
                "--outer-overlap {overlap}: a synchronisation must land by the time the next one \
                 starts, {interval} steps later (--inner-steps / --outer-fragments)"
            )));
        }
        let mix = options.outer_mix.unwrap_or(0.5);
        if !(0.0..1.0).contains(&mix) {
            return Err(Error::Config(format!(
                "--outer-mix {mix}: a share of the fragment's own parameters in [0, 1)"
            )));
        }
        if !(outer.lr.is_finite() && outer.lr > 0.0 && (0.0..1.0).contains(&outer.momentum)) {
            return Err(Error::Config(format!(
                "--outer-lr {} --outer-momentum {}: a positive rate and a momentum in [0, 1)",
                outer.lr, outer.momentum
            )));
        }
        if let Some(s) = options.inner_seconds
            && !(s.is_finite() && s > 0.0)
        {
            return Err(Error::Config(format!(
                "--inner-seconds must be a positive number of seconds, got {s}"
            )));
        }
        let outer_dtype = options.outer_dtype.unwrap_or(job::OuterDtype::F32);
        report.note(format!(
            "diloco: {workers} workers of batch {} (global batch {}), {inner_steps} inner steps \
             at learning rate {} between synchronisations{}; outer SGD lr {} momentum {}{}{}, \
             pseudo-gradients as {:?}{}",
            spec.batch_size,
            spec.batch_size * workers,
            spec.lr,
            if fragments > 1 {
                format!(
                    " of each of {fragments} fragments, {} steps apart",
                    inner_steps / fragments as u64
                )
            } else {
                String::new()
            },
            outer.lr,
            outer.momentum,
            if outer.nesterov { " (Nesterov)" } else { "" },
            if outer.follow_schedule {
                ", following the inner schedule"
            } else {
                ""
            },
            outer_dtype,
            options
                .inner_seconds
                .map(|s| format!("; inner steps bounded to {s} s per {inner_steps} steps"))
                .unwrap_or_default()
        ));
        Ok(Self {
            spec,
            workers,
            inner_steps,
            outer,
            fragments,
            overlap,
            mix,
            outer_dtype,
            inner_seconds: options.inner_seconds,
            bucket_bytes: (DEFAULT_BUCKET_MB * 1e6) as usize,
            node_speeds: cluster.node_speeds.clone(),
        })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.workers)?;
        if self.workers < 2
            || self.bucket_bytes == 0
            || self.inner_steps == 0
            || self.fragments == 0
            || self.fragments as u64 > self.inner_steps
            || self.overlap > self.inner_steps / self.fragments as u64
            || !(0.0..1.0).contains(&self.mix)
        {
            return Err(Error::Config(format!(
                "invalid job: {} workers, {} inner steps, {} fragments, buckets of {} bytes",
                self.workers, self.inner_steps, self.fragments, self.bucket_bytes
            )));
        }
        crate::replicas::check_speeds(&self.node_speeds, self.workers)
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        // As all-reduce SGD's: the elastic ring.
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
