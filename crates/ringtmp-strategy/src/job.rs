//! One shape for every strategy. A strategy is a folder under this crate, one variant of [`Job`]
//! and one options struct that the CLI flattens into `ringtmp train`; it implements [`Strategy`]:
//! how to plan a job for N nodes, check one that arrived from a file or the network, which ranks
//! each rank links to, which ranks may die without ending the run, and how a rank runs.
//!
//! Everything strategies share (model, data, optimizer, schedule, steps, evaluation, checkpoints,
//! seed, output, timeouts) is in the job's [`RunSpec`]; what a node needs at run time (its
//! network, the data when its role reads it, where progress goes) is its [`NodeCx`].
//! `docs/architecture.md` ("How to add a strategy") walks through adding one.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use ringtmp_transport::Transport;
use serde::{Deserialize, Serialize};

use crate::allreduce::{AllReduceJob, AllReduceOptions};
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::gossip::{AdpsgdJob, DpsgdJob, DpsgdOptions};
use crate::local::LocalJob;
use crate::param_server::driver::PsJob;
use crate::param_server::plan::PsOptions;
use crate::ring::driver::RingJob;
use crate::ring::plan::RingOptions;
use crate::spec::RunSpec;

/// The machines a job is planned for.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// Nodes (processes) in the run.
    pub nodes: u32,
    /// Relative speed per rank (1 = full speed; `--node-speed` emulates slower ones).
    pub node_speeds: Vec<f64>,
    /// Memory per rank (`--node-memory-limit`), in bytes: what a planner must fit a node's
    /// process into; `None`: unlimited.
    pub memory_limits: Vec<Option<u64>>,
    /// Compute threads per node when the user chose them; `None`: the strategy shares `cores`.
    pub threads: Option<usize>,
    /// Cores of the machine the local nodes share.
    pub cores: usize,
    /// Per rank, its card's bandwidth in Mbit/s (`None`: not known) and its links' latency in
    /// ms (`--bandwidth-mbit`, `--latency-ms`, `--link`): what planners count links with.
    pub links: Vec<(Option<f64>, f64)>,
    /// Per rank, the node's own profile from rendezvous (issue 17.2), when it sent one: the
    /// ring's planner uses its layer times and free memory instead of rank 0's profile scaled
    /// by its speed. Empty, or `None` for a rank: planned from rank 0's profile.
    pub node_profiles: Vec<Option<crate::ring::node_profile::NodeProfile>>,
    /// Set when every node is a process on this machine, sharing its `cores` without CPU
    /// quotas (the local launcher): what all the nodes compute, and what their links cost the
    /// CPU, must then fit into those cores, which a planner counts. `None`: every node has
    /// its own machine (or its own CPU quota).
    pub shared_machine: Option<SharedMachine>,
}

/// Nodes that share one machine's cores (see [`Cluster::shared_machine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMachine {
    /// Cores the nodes share.
    pub cores: usize,
    /// Whether their links are private (sealed records, the default), which costs CPU per byte.
    pub private_links: bool,
}

impl Cluster {
    /// `nodes` nodes at full speed on this machine, threads chosen by the strategy.
    pub fn local(nodes: u32) -> Self {
        Self {
            nodes,
            node_speeds: vec![1.0; nodes as usize],
            memory_limits: vec![None; nodes as usize],
            threads: None,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            links: vec![(None, 0.0); nodes as usize],
            node_profiles: Vec::new(),
            shared_machine: None,
        }
    }

    /// Applies `--node-memory-limit` (`200M`, or per rank `1:200M,2:1G`).
    pub fn with_memory_limits(mut self, spec: Option<&str>) -> Result<Self> {
        self.memory_limits = crate::ring::plan::memory_limits(spec, self.nodes)?;
        Ok(self)
    }

    /// Applies `--node-speed` entries (`RANK:FACTOR`, comma-separated or repeated).
    pub fn with_speeds(mut self, entries: &[String]) -> Result<Self> {
        self.node_speeds = node_speeds(entries, self.nodes)?;
        Ok(self)
    }
}

/// `RANK:FACTOR` entries → a speed per node (default 1).
pub fn node_speeds(entries: &[String], nodes: u32) -> Result<Vec<f64>> {
    let mut speeds = vec![1.0; nodes as usize];
    for e in entries {
        for part in e.split(',') {
            let bad = || {
                Error::Config(format!(
                    "--node-speed {part:?}: expected RANK:FACTOR with 0 < FACTOR ≤ 1 and RANK < {nodes}"
                ))
            };
            let (r, f) = part.split_once(':').ok_or_else(bad)?;
            let (r, f): (usize, f64) = (
                r.trim().parse().map_err(|_| bad())?,
                f.trim().parse().map_err(|_| bad())?,
            );
            if r >= nodes as usize || !(f > 0.0 && f <= 1.0) {
                return Err(bad());
            }
            speeds[r] = f;
        }
    }
    Ok(speeds)
}

/// What one node has at run time.
pub struct NodeCx<'a> {
    /// Its links (TCP or simulated).
    pub net: &'a mut dyn Transport,
    /// The dataset, where [`Strategy::needs_data`] says this rank reads it.
    pub data: Option<&'a Dataset>,
    /// Where progress goes (the terminal, a test, nothing).
    pub on_event: &'a mut dyn FnMut(&Event),
}

impl<'a> NodeCx<'a> {
    /// The dataset; an error naming the rank when the node was started without it.
    pub fn data(&self) -> Result<&'a Dataset> {
        self.data.ok_or_else(|| {
            Error::Config(format!(
                "rank {} needs the dataset but was started without it",
                self.net.rank()
            ))
        })
    }
}

/// A training strategy: its job is planned on rank 0 and handed to every node.
pub trait Strategy: Sized {
    /// `--strategy NAME`.
    const NAME: &'static str;
    /// Its options (`ringtmp train` flags and config keys of their own).
    type Options: Clone + Default;
    /// Plans the job for `cluster` from the run's configuration and the options.
    fn plan(
        config: TrainConfig,
        options: &Self::Options,
        cluster: &Cluster,
        data: &Dataset,
    ) -> Result<Self>;
    /// The shared part of the job.
    fn spec(&self) -> &RunSpec;
    /// Checks a job that came from a file or the network, for a run of `world` nodes.
    fn validate(&self, world: u32) -> Result<()>;
    /// The ranks `rank` links to.
    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32>;
    /// Whether `rank` reads the dataset.
    fn needs_data(&self, rank: u32) -> bool;
    /// Whether the run goes on when `rank` dies.
    fn expendable(&self, _rank: u32) -> bool {
        false
    }
    /// Runs rank `rank`; the rank that writes the run's summary returns it.
    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>>;
}

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
            LocalJob::NAME => Self::Local(LocalJob::plan(config, &(), cluster, data)?),
            RingJob::NAME => Self::Ring(RingJob::plan(config, &options.ring, cluster, data)?),
            PsJob::NAME => Self::Ps(PsJob::plan(config, &options.ps, cluster, data)?),
            AllReduceJob::NAME => Self::AllReduce(AllReduceJob::plan(
                config,
                &options.allreduce,
                cluster,
                data,
            )?),
            DpsgdJob::NAME => Self::Dpsgd(DpsgdJob::plan(config, &options.dpsgd, cluster, data)?),
            AdpsgdJob::NAME => Self::Adpsgd(AdpsgdJob::plan(config, &(), cluster, data)?),
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
    ) -> Result<Option<crate::ring::node_profile::ProfileRequest>> {
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

/// Checks what every job shares for a run of `world` nodes, of which the job needs `nodes`.
pub(crate) fn validate_shared(spec: &RunSpec, world: u32, nodes: usize) -> Result<()> {
    spec.validate()?;
    if world as usize != nodes {
        return Err(Error::Config(format!(
            "invalid job: planned for {nodes} nodes, but the run has {world}"
        )));
    }
    Ok(())
}

/// Ring neighbours: predecessor and successor (one peer when there are two nodes, none alone).
pub fn ring_neighbours(rank: u32, world: u32) -> BTreeSet<u32> {
    if world < 2 {
        return BTreeSet::new();
    }
    BTreeSet::from([(rank + 1) % world, (rank + world - 1) % world])
}

/// Implements, for an options struct whose fields are all `Option`s, `merged_over` (these
/// options over another set, e.g. flags over a config file) and `given` (the flags set).
macro_rules! options_merge {
    ($ty:ty, $($field:ident),* $(,)?) => {
        impl $ty {
            /// These options, with `other`'s where these leave one unset.
            pub fn merged_over(&self, other: &Self) -> Self {
                Self {
                    $($field: self.$field.clone().or_else(|| other.$field.clone()),)*
                }
            }

            /// The flags (long names) that are set.
            pub fn given(&self) -> Vec<String> {
                let mut set = Vec::new();
                $(if self.$field.is_some() {
                    set.push(stringify!($field).replace('_', "-"));
                })*
                set
            }
        }
    };
}
pub(crate) use options_merge;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_parse() {
        assert_eq!(node_speeds(&["1:0.25".into()], 2).unwrap(), [1.0, 0.25]);
        assert!(node_speeds(&["2:0.5".into()], 2).is_err());
        assert!(node_speeds(&["1:1.5".into()], 2).is_err());
    }

    #[test]
    fn ring_neighbours_wrap_around() {
        assert_eq!(ring_neighbours(0, 4), BTreeSet::from([1, 3]));
        assert_eq!(ring_neighbours(3, 4), BTreeSet::from([0, 2]));
        assert_eq!(ring_neighbours(1, 2), BTreeSet::from([0]));
        assert!(ring_neighbours(0, 1).is_empty());
    }
}
