//! One shape for every strategy. A strategy is a folder under this crate, one variant of [`Job`]
//! and one options struct that the CLI flattens into `ringtmp train`; it implements [`Strategy`]:
//! how to plan a job for N nodes, check one that arrived from a file or the network, which ranks
//! each rank links to, which ranks may die without ending the run, and how a rank runs.
//!
//! Everything strategies share (model, data, optimizer, schedule, steps, evaluation, checkpoints,
//! seed, output, timeouts) is in the job's [`RunSpec`]; what a node needs at run time (its
//! network, the data when its role reads it, where progress goes) is its [`NodeCx`].
//! `docs/architecture.md` ("Where to change what") walks through adding one.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use serde::{Deserialize, Serialize};

use crate::allreduce::{AllReduceJob, AllReduceOptions};
use crate::config::TrainConfig;
use crate::contract::{Cluster, NodeCx, PlanReport, Strategy};
use crate::error::{Error, Result};
use crate::gossip::{AdpsgdJob, DpsgdJob, DpsgdOptions};
use crate::local::LocalJob;
use crate::param_server::driver::PsJob;
use crate::param_server::plan::PsOptions;
use crate::ring::plan::RingOptions;
use crate::ring::run::driver::RingJob;
use crate::spec::RunSpec;

/// Every strategy's job, tagged by the strategy's name (`job.json`, and what rank 0 hands every
/// node at rendezvous).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case")]
pub enum Job {
    /// One process trains the whole model: the oracle.
    Local(LocalJob),
    /// RingTMP.
    Ring(RingJob),
    /// The parameter server.
    Ps(PsJob),
    /// Ring all-reduce SGD.
    #[serde(rename = "allreduce")]
    AllReduce(AllReduceJob),
    /// D-PSGD.
    Dpsgd(DpsgdJob),
    /// AD-PSGD.
    Adpsgd(AdpsgdJob),
}

/// Every strategy's options, as the CLI collects them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StrategyOptions {
    /// The ring's.
    pub ring: RingOptions,
    /// The parameter server's.
    pub ps: PsOptions,
    /// All-reduce's.
    pub allreduce: AllReduceOptions,
    /// D-PSGD's.
    pub dpsgd: DpsgdOptions,
}

macro_rules! each {
    ($job:expr, $j:ident => $body:expr) => {
        match $job {
            Job::Local($j) => $body,
            Job::Ring($j) => $body,
            Job::Ps($j) => $body,
            Job::AllReduce($j) => $body,
            Job::Dpsgd($j) => $body,
            Job::Adpsgd($j) => $body,
        }
    };
}

impl Job {
    /// The names `--strategy` takes.
    pub const NAMES: [&'static str; 6] = [
        LocalJob::NAME,
        RingJob::NAME,
        PsJob::NAME,
        AllReduceJob::NAME,
        DpsgdJob::NAME,
        AdpsgdJob::NAME,
    ];

    /// Plans strategy `name`'s job.
    pub fn plan(
        name: &str,
        config: TrainConfig,
        options: &StrategyOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        if config.clip_grad_norm.is_some()
            && ![LocalJob::NAME, RingJob::NAME, AllReduceJob::NAME].contains(&name)
        {
            return Err(Error::Config(format!(
                "--clip-grad-norm: {name} does not clip gradients (local, ring and allreduce do, \
                 by the global norm of each step's gradient); --clip-grad-norm 0 trains without"
            )));
        }
        Ok(match name {
            LocalJob::NAME => Self::Local(LocalJob::plan(config, &(), cluster, data, report)?),
            RingJob::NAME => {
                Self::Ring(RingJob::plan(config, &options.ring, cluster, data, report)?)
            }
            PsJob::NAME => Self::Ps(PsJob::plan(config, &options.ps, cluster, data, report)?),
            AllReduceJob::NAME => Self::AllReduce(AllReduceJob::plan(
                config,
                &options.allreduce,
                cluster,
                data,
                report,
            )?),
            DpsgdJob::NAME => Self::Dpsgd(DpsgdJob::plan(
                config,
                &options.dpsgd,
                cluster,
                data,
                report,
            )?),
            AdpsgdJob::NAME => Self::Adpsgd(AdpsgdJob::plan(config, &(), cluster, data, report)?),
            other => {
                return Err(Error::Config(format!(
                    "unknown strategy {other:?}; known: {}",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }

    /// What every node should time at rendezvous so that `name`'s plan can use its own
    /// figures (issue 17.2): the ring's partition only; `None` for strategies whose plan does
    /// not depend on the nodes' speeds.
    pub fn profile_request(
        name: &str,
        config: TrainConfig,
        options: &StrategyOptions,
        cluster: &Cluster,
        data: &Dataset,
        budget_seconds: f64,
    ) -> Result<Option<crate::ring::plan::node_profile::ProfileRequest>> {
        match name {
            RingJob::NAME => crate::ring::plan::profile_request(
                config,
                &options.ring,
                cluster,
                data,
                budget_seconds,
            )
            .map(Some),
            _ => Ok(None),
        }
    }

    /// The strategy's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Local(_) => LocalJob::NAME,
            Self::Ring(_) => RingJob::NAME,
            Self::Ps(_) => PsJob::NAME,
            Self::AllReduce(_) => AllReduceJob::NAME,
            Self::Dpsgd(_) => DpsgdJob::NAME,
            Self::Adpsgd(_) => AdpsgdJob::NAME,
        }
    }

    /// See [`Strategy::spec`].
    pub fn spec(&self) -> &RunSpec {
        each!(self, j => j.spec())
    }

    /// The spec, to change what a launcher decides after planning (the checkpoint interval
    /// `--max-restarts` chooses).
    pub fn spec_mut(&mut self) -> &mut RunSpec {
        each!(self, j => &mut j.spec)
    }

    /// See [`Strategy::validate`].
    pub fn validate(&self, world: u32) -> Result<()> {
        each!(self, j => j.validate(world))
    }

    /// See [`Strategy::neighbours`].
    pub fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        each!(self, j => j.neighbours(rank, world))
    }

    /// See [`Strategy::needs_data`].
    pub fn needs_data(&self, rank: u32) -> bool {
        each!(self, j => j.needs_data(rank))
    }

    /// See [`Strategy::expendable`].
    pub fn expendable(&self, rank: u32) -> bool {
        each!(self, j => j.expendable(rank))
    }

    /// The rank whose progress events (steps, evaluations) a launcher shows: the master, or
    /// the parameter server's worker 0 (the servers see no losses).
    pub fn progress_rank(&self) -> u32 {
        match self {
            Job::Ps(job) => job.servers as u32,
            _ => 0,
        }
    }

    /// The plan's prediction of one step, where the strategy plans one: what bounds the wait
    /// for progress until steps have been measured ([`ringtmp_transport::progress`]).
    pub fn predicted_step(&self) -> Option<std::time::Duration> {
        match self {
            Job::Ring(job) => {
                // Every stage's compute and card in turn, for each micro-batch: a step's length
                // with no overlap at all, so a bound above it.
                let one: f64 = job
                    .partition
                    .iter()
                    .map(|s| s.predicted_seconds + s.predicted_link_seconds)
                    .sum();
                let step = one * job.micro_batches as f64;
                (step.is_finite() && step > 0.0).then(|| std::time::Duration::from_secs_f64(step))
            }
            _ => None,
        }
    }

    /// See [`Strategy::run`].
    pub fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        each!(self, j => j.run(rank, cx))
    }
}
