//! RingTMP: ring-pipelined model parallelism. Nodes form a ring `0 → 1 → … → N−1 → 0`; node `s`
//! owns stage `s` (a contiguous block of layers) with its parameters and optimizer state. Rank 0,
//! the master, also holds the data and the labels: micro-batches' activations travel clockwise
//! through every stage and return to the master, which computes the loss; gradients travel
//! anticlockwise back to the master.
//!
//! # Layout
//! - [`profile`]: per-layer time and memory measurements for the planner.
//! - [`schedule`]: the per-stage decision rules (`gpipe`, `1f1b`) and their simulation.
//! - [`driver`]: the job every node runs and what master and stage nodes share; `master` (rank
//!   0: data, stage 0, loss, outputs) and `worker` (every other stage) run it.
//! - [`heal`]: stage replicas (`--stage-replicas`) and the ring's re-formation around a lost
//!   node.
//! - [`partition`]: the planner that splits layers into stages.
//! - [`rings`]: rings of rings (`--replicas R`): the view that runs one ring of several and
//!   averages each stage with its copies; `replica_gossip`: their asynchronous gossip
//!   (`--replica-sync adpsgd`).
//! - [`node_profile`]: every node times the layers on its own hardware at rendezvous.
//! - [`plan`]: `--strategy ring` options into the job every node runs.
//! - [`node`]: the strategy's shape: a rank's role and the job's checks.

pub mod driver;
pub mod heal;
mod master;
pub mod node;
pub mod node_profile;
pub mod partition;
pub mod plan;
pub mod profile;
mod replica_gossip;
pub mod replicas;
pub mod rings;
pub mod schedule;
mod worker;
