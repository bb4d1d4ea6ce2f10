//! `ringtmp-strategy`: how nodes cooperate to train, in one place for the CLI and the tests.
//! The strategies live in crates of their own over a contract crate, so Cargo refuses a
//! strategy that names another:
//!
//! - `ringtmp-contract` ([`contract`], [`config`], [`RunSpec`], [`recorder`], …): what every
//!   strategy implements and shares; it names no strategy.
//! - `ringtmp-collective` ([`collective`]): the mechanisms several strategies synchronise with —
//!   the ring all-reduce's chunks and bucketed reduction, the elastic ring and its regroup,
//!   gossip's mixing, DiLoCo's outer optimizer, a whole model as one message.
//! - The strategy families, each a crate over those two: `ringtmp-ring` ([`ring`]: RingTMP,
//!   ring-pipelined model parallelism), `ringtmp-data-parallel` ([`data_parallel`], the one
//!   replica loop, with [`allreduce`], [`diloco`] and [`gossip`]: D-PSGD, AD-PSGD as its
//!   synchronisation rules), `ringtmp-param-server` ([`param_server`]: BSP, SSP, ASP, DSSP).
//!
//! This crate re-exports them under the names above and adds what names them all: [`local`]
//! (one process holding the whole model — plain mini-batch training and the oracle every
//! distributed strategy is tested against), [`job`] (the [`Job`] enum, the one list of
//! strategies), [`simulate`] and [`failures`] (the strategies on the simulated network with
//! compute priced by a cost model; the useful fraction of time under failures), [`generate`]
//! (sampling from a model split over nodes) and [`selftest`] (connectivity and link
//! measurements on a ring of nodes).

pub use ringtmp_collective as collective;
pub use ringtmp_contract::{
    batch_scaling, clipping, config, contract, defaulted, evaluation, event, machine, memory_floor,
    messages, per_node, recorder, resume, text_form,
};
pub use ringtmp_data_parallel::{allreduce, diloco, gossip};
pub use ringtmp_param_server as param_server;
pub use ringtmp_ring as ring;

/// What the data-parallel strategies share: their loop and what they plan and report alike.
pub mod data_parallel {
    pub use ringtmp_data_parallel::replicas::*;
    pub use ringtmp_data_parallel::worker_loop;
}

pub mod failures;
pub mod generate;
pub mod job;
pub mod local;
pub mod selftest;
pub mod simulate;

pub use job::{Job, StrategyOptions};
pub use local::{LocalJob, train_local};
pub use ringtmp_contract::{
    CHECKPOINT_AT_END, Cluster, DEFAULT_RECV_TIMEOUT_SECS, Defaulted, Error, Event, Family, NodeCx,
    Origin, PlanReport, Result, ResumePoint, RunSpec, SharedMachine, Strategy, TextSource,
    TrainConfig, layers_for, model_shapes, sequence_of, vocabulary_of,
};
