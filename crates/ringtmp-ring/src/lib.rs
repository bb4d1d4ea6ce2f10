//! RingTMP: ring-pipelined model parallelism. Nodes form a ring `0 → 1 → … → N−1 → 0`; node `s`
//! owns stage `s` (a contiguous block of layers) with its parameters and optimizer state. Rank 0,
//! the master, also holds the data and the labels: micro-batches' activations travel clockwise
//! through every stage and return to the master, which computes the loss; gradients travel
//! anticlockwise back to the master.
//!
//! # Layout, by concern
//! - [`node`]: the strategy's shape (the [`ringtmp_contract::Strategy`] implementation): a rank's role and
//!   the job's checks.
//! - [`plan`]: `--strategy ring` options into the job every node runs — per-layer measurements
//!   ([`plan::profile`], and every node's own at rendezvous: [`plan::node_profile`]) and the
//!   partition that splits the layers into stages ([`plan::partition`]).
//! - [`run`]: running the ring — the job, the master's and the stages' loops, the schedules.
//! - [`net`]: a ring node's network — messages, and the hooks rings of rings implement.
//! - [`heal`]: stage replicas (`--stage-replicas`, [`heal::replicas`]) and the ring's
//!   re-formation around a lost node.
//! - [`rings`]: rings of rings (`--replicas R`): the view that runs one ring of several and
//!   averages each stage with its copies, or gossips among them (`--replica-sync adpsgd`).
//!
//! Dependencies run one way: `node` → `plan`, `run`, `heal`, `rings`; `heal` and `rings` → `run`;
//! `run` and `plan` name each other's types only through the job ([`run::driver::RingJob`]).

pub mod heal;
pub mod net;
pub mod node;
pub mod plan;
pub mod rings;
pub mod run;
