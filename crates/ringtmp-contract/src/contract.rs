//! The contract between the strategies and everything around them: the machines a job is
//! planned for ([`Cluster`], parsed from the emulation flags), what a node has at run time
//! ([`NodeCx`]), the [`Strategy`] trait every strategy implements, and the checks and helpers
//! they share. It names no strategy; `job` is the one place that lists them all.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use ringtmp_transport::Transport;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::per_node::{Bytes, PerNode, Speed};
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
    /// Per rank, the node's own profile from rendezvous, when it sent one: the
    /// ring's planner uses its layer times and free memory instead of rank 0's profile scaled
    /// by its speed. Empty, or `None` for a rank: planned from rank 0's profile.
    pub node_profiles: Vec<Option<crate::machine::NodeProfile>>,
    /// Set when every node is a process on this machine, sharing its `cores` without CPU
    /// quotas (the local launcher): what all the nodes compute, and what their links cost the
    /// CPU, must then fit into those cores, which a planner counts. `None`: every node has
    /// its own machine (or its own CPU quota).
    pub shared_machine: Option<SharedMachine>,
}

/// What a planner chose and why (the defaults it filled in, the partition, what a node's own
/// profile changed), a line each, for the caller to show before the run starts: the library
/// prints nothing itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanReport {
    lines: Vec<String>,
}

impl PlanReport {
    /// Adds a line.
    pub fn note(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }

    /// The lines, in the order the planner wrote them.
    pub fn lines(&self) -> &[String] {
        &self.lines
    }
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

    /// Applies `--node-memory-limit`: a limit for every node and per rank.
    pub fn with_memory_limits(mut self, limits: Option<&PerNode<Bytes>>) -> Result<Self> {
        if let Some(limits) = limits {
            self.memory_limits = limits
                .resolve(self.nodes, "--node-memory-limit")?
                .into_iter()
                .map(|l| l.map(|b| b.0))
                .collect();
        }
        Ok(self)
    }

    /// Applies `--node-speed`: an emulated speed for every node and per rank (default 1).
    pub fn with_speeds(mut self, speeds: &PerNode<Speed>) -> Result<Self> {
        self.node_speeds = speeds
            .resolve(self.nodes, "--node-speed")?
            .into_iter()
            .map(|s| s.map_or(1.0, |s| s.0))
            .collect();
        Ok(self)
    }
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

/// How a strategy divides the work among the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// One process holds and trains the whole model.
    Single,
    /// Every node holds a contiguous block of the layers (model parallel: the ring).
    Pipeline,
    /// Every worker holds a whole replica and the workers agree on it (all-reduce, gossip,
    /// DiLoCo).
    Replicas,
    /// Servers hold shards of the parameters; workers hold replicas they pull and push.
    ParameterServer,
}

impl Family {
    /// Whether every worker trains a whole replica on its share of the data.
    pub fn is_data_parallel(self) -> bool {
        matches!(self, Self::Replicas | Self::ParameterServer)
    }
}

/// A training strategy: its job is planned on rank 0 and handed to every node.
pub trait Strategy: Sized {
    /// `--strategy NAME`.
    const NAME: &'static str;
    /// How it divides the work (what `compare` groups its claims by).
    const FAMILY: Family;
    /// The option of `compare`'s short form `NAME:VALUE` (`ring:1f1b` is `--schedule 1f1b`,
    /// `ps:ssp:2` is `--consistency ssp:2`), and what its value is called in help; `None`: the
    /// strategy has only its name.
    const SHORT_FORM: Option<(&'static str, &'static str)> = None;
    /// Its options (`ringtmp train` flags and config keys of their own).
    type Options: Clone + Default;
    /// Plans the job for `cluster` from the run's configuration and the options, saying in
    /// `report` what it chose and why.
    fn plan(
        config: TrainConfig,
        options: &Self::Options,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
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

    /// Whether it clips gradients by their global L2 norm (`--clip-grad-norm`): each step's
    /// whole gradient where the workers share one, else the gradient each worker applies. A
    /// strategy that does not refuses the option.
    const CLIPS: bool = false;

    /// The workers that share each global batch in a run of `nodes` nodes (what a resumed
    /// checkpoint's global batch is split over): the nodes, by default.
    fn workers(_options: &Self::Options, nodes: u32) -> Result<usize> {
        Ok(nodes as usize)
    }

    /// What every node should time at rendezvous so that the plan can use its own figures;
    /// `None` (the default) for strategies whose plan does not depend on the nodes' speeds.
    fn profile_request(
        _config: TrainConfig,
        _options: &Self::Options,
        _cluster: &Cluster,
        _data: &Dataset,
        _budget_seconds: f64,
    ) -> Result<Option<crate::machine::ProfileRequest>> {
        Ok(None)
    }

    /// The rank whose progress events (steps, evaluations) a launcher shows.
    fn progress_rank(&self) -> u32 {
        0
    }

    /// What `rank` holds and does in this job, in a few words: the line a node started by hand
    /// prints, so that every machine says what it is for.
    fn role(&self, _rank: u32) -> String {
        "a worker: a whole copy of the model, training on its share of every batch".into()
    }

    /// The plan's prediction of one step, where the strategy plans one: what bounds the wait
    /// for progress until steps have been measured ([`ringtmp_transport::progress`]).
    fn predicted_step(&self) -> Option<std::time::Duration> {
        None
    }
}

/// The options of a strategy that has none of its own.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct NoOptions {}

impl NoOptions {
    /// Nothing to merge.
    pub fn merged_over(&self, _: &Self) -> Self {
        Self {}
    }

    /// No flags.
    pub fn given(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Bytes as the planner's messages show them: whole MiB.
pub fn show_bytes(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Checks what every job shares for a run of `world` nodes, of which the job needs `nodes`.
pub fn validate_shared(spec: &RunSpec, world: u32, nodes: usize) -> Result<()> {
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
#[macro_export]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_neighbours_wrap_around() {
        assert_eq!(ring_neighbours(0, 4), BTreeSet::from([1, 3]));
        assert_eq!(ring_neighbours(3, 4), BTreeSet::from([0, 2]));
        assert_eq!(ring_neighbours(1, 2), BTreeSet::from([0]));
        assert!(ring_neighbours(0, 1).is_empty());
    }
}
