//! `ringtmp-strategy`: how nodes cooperate to train. Each strategy computes through
//! `ringtmp-model` stages and reads data through `ringtmp-data`, and reports through
//! `ringtmp-metrics`, so strategies differ only in who computes what and what travels.
//!
//! # Layout
//! The contract every strategy implements, and the modules they share:
//! - [`contract`]: [`Strategy`], [`NodeCx`], [`Cluster`] and the checks strategies share; it
//!   names no strategy.
//! - [`config`]: the validated run configuration; [`RunSpec`]: what every strategy's job shares
//!   (the configuration and what follows from the data), declared once.
//! - [`event`], [`evaluation`], [`clipping`], [`resume`], [`recorder`]: progress events,
//!   evaluation passes, global-norm clipping, resuming from a checkpoint, and `metrics.jsonl` /
//!   `summary.json`, the same for every strategy.
//! - [`machine`]: what this machine offers a node (the memory it may still use).
//! - [`messages`]: a strategy's own wire messages, declared in its folder.
//! - [`data_parallel`]: what the data-parallel strategies share (planning, a worker's report).
//! - [`collective`]: the mechanisms several strategies synchronise with — the ring all-reduce's
//!   chunks and bucketed reduction, the elastic ring and its regroup, gossip's mixing, DiLoCo's
//!   outer optimizer — owned by none of them.
//!
//! The strategies, one folder or file each:
//! - [`local`]: one process holding the whole model — plain mini-batch training and the oracle
//!   every distributed strategy is tested against.
//! - [`ring`]: RingTMP, ring-pipelined model parallelism.
//! - [`param_server`]: the sharded parameter server (BSP, SSP, ASP, DSSP).
//! - [`allreduce`]: ring all-reduce SGD (data parallel, bucketed, overlapped).
//! - [`gossip`]: decentralised SGD (D-PSGD, AD-PSGD).
//! - [`diloco`]: DiLoCo, data parallelism that synchronises every H steps through an outer
//!   optimizer (on the collective layer's reduction and elastic ring).
//!
//! Above them: [`job`], the [`Job`] enum that lists every strategy; [`simulate`] and
//! [`failures`] (the strategies on the simulated network with compute priced by a cost model;
//! the useful fraction of time under failures); [`selftest`] (connectivity and link
//! measurements on a ring of nodes).

pub mod allreduce;
pub mod batch_scaling;
pub mod clipping;
pub mod collective;
pub mod config;
pub mod contract;
pub mod data_parallel;
pub mod diloco;
mod error;
pub mod evaluation;
pub mod event;
pub mod failures;
pub mod generate;
pub mod gossip;
pub mod job;
pub mod local;
pub mod machine;
pub mod memory_floor;
pub mod messages;
pub mod param_server;
pub mod per_node;
pub mod recorder;
pub mod resume;
pub mod ring;
pub mod selftest;
pub mod simulate;
mod spec;
pub mod text_form;

pub use config::{CHECKPOINT_AT_END, DEFAULT_RECV_TIMEOUT_SECS, TextSource, TrainConfig};
pub use contract::{Cluster, Family, NodeCx, PlanReport, SharedMachine, Strategy};
pub use error::{Error, Result};
pub use event::Event;
pub use job::{Job, StrategyOptions};
pub use local::{LocalJob, train_local};
pub use spec::{ResumePoint, RunSpec, layers_for, model_shapes, sequence_of, vocabulary_of};
