//! The data-parallel strategies: every node is a worker with a whole replica of the model that
//! trains on its share of each global batch; they differ in how the replicas agree.
//!
//! - [`worker_loop`]: the one training loop of a replica (opening, batches, clocks, recording,
//!   evaluation and checkpoints, the end), with synchronisation as a hook, its `SyncRule`.
//! - [`replicas`]: what the strategies share beside the loop (planning, a worker's share of a
//!   batch, its clock and report, the model checkpoint).
//! - [`allreduce`]: ring all-reduce SGD, every step (bucketed, overlapped with the backward).
//! - [`diloco`]: DiLoCo, every H steps through an outer optimizer, whole or in fragments.
//! - [`gossip`]: decentralised SGD — D-PSGD's mixing every step and AD-PSGD's asynchronous
//!   pairs (its own loop: its workers never step together).
//!
//! The strategies name the loop, the contract and the collective layer, not each other.

pub mod allreduce;
pub mod diloco;
pub mod gossip;
pub mod replicas;
pub mod worker_loop;
