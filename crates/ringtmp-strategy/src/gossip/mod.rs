//! Decentralised (gossip) SGD: no server and no global reduction per step; every worker keeps
//! its own model and averages it with its neighbours'.
//!
//! # Layout
//! - [`mixing`]: the communication graphs (`ring`, `exp`) and their mixing matrices.
//! - [`mod@consensus`]: the mean of the workers' models and their distance from it.
//! - [`dpsgd`]: D-PSGD (`--strategy dpsgd`), synchronous gossip.
//! - [`adpsgd`]: AD-PSGD (`--strategy adpsgd`), asynchronous pairwise gossip, with rank 0's
//!   bookkeeping in [`coordinator`].

pub mod adpsgd;
pub mod consensus;
pub mod coordinator;
pub mod dpsgd;
pub mod mixing;
pub mod pairing;

pub use adpsgd::AdpsgdJob;
pub use consensus::{Models, consensus};
pub use dpsgd::{DpsgdJob, DpsgdOptions, NAME};
