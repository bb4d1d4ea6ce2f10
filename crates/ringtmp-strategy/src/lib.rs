//! `ringtmp-strategy`: how nodes cooperate to train. Each strategy computes through
//! `ringtmp-model` stages and reads data through `ringtmp-data`, and reports through
//! `ringtmp-metrics`, so strategies differ only in who computes what and what travels.
//!
//! # Layout
//! - [`allreduce`]: ring all-reduce SGD (data parallel, bucketed, overlapped).
//! - [`data_parallel`]: what the data-parallel strategies share (planning, a worker's report).
//! - [`gossip`]: decentralised SGD (D-PSGD) over ring and exponential graphs.
//! - [`config`]: the validated run configuration shared by every strategy.
//! - [`RunSpec`]: what every strategy's job shares (the configuration and what follows from the
//!   data), declared once.
//! - [`job`]: one shape for every strategy ([`Strategy`], [`Job`], [`NodeCx`]).
//! - [`local`]: one process, one stage holding the whole model — plain mini-batch training and
//!   the oracle every distributed strategy is tested against.
//! - [`recorder`]: `metrics.jsonl`, the evaluation cadence, time to target and `summary.json`,
//!   written the same way by every strategy.
//! - [`param_server`]: the parameter server's consistency models (in progress).
//! - [`ring`]: RingTMP, ring-pipelined model parallelism.
//! - [`selftest`]: connectivity and link measurements on a ring of nodes.
//! - [`simulate`]: the strategies on the simulated network with compute priced by a cost model
//!   and tensors as sizes (`ringtmp simulate`).
//! - [`failures`]: a simulated run's useful fraction of time when nodes fail at a given rate,
//!   with the strategy's own recovery (`ringtmp simulate --failures-per-node-hour`).

pub mod allreduce;
pub mod clipping;
pub mod config;
pub mod contract;
pub mod data_parallel;
mod error;
pub mod evaluation;
pub mod event;
pub mod failures;
pub mod gossip;
pub mod job;
pub mod local;
pub mod param_server;
pub mod recorder;
pub mod resume;
pub mod ring;
pub mod selftest;
pub mod simulate;
mod spec;

pub use config::{DEFAULT_RECV_TIMEOUT_SECS, TextSource, TrainConfig};
pub use contract::{Cluster, NodeCx, SharedMachine, Strategy};
pub use error::{Error, Result};
pub use event::Event;
pub use job::{Job, StrategyOptions};
pub use local::{LocalJob, train_local};
pub use spec::{ResumePoint, RunSpec, layers_for, model_shapes, sequence_of};
