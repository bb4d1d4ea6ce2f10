//! Decentralised (gossip) SGD: no server and no global reduction per step; every worker keeps
//! its own model and averages it with its neighbours'.
//!
//! # Layout
//! - [`mod@consensus`]: the mean of the workers' models and their distance from it.
//! - [`dpsgd`]: D-PSGD (`--strategy dpsgd`), synchronous gossip.
//! - [`adpsgd`]: AD-PSGD (`--strategy adpsgd`), asynchronous pairwise gossip, with rank 0's
//!   bookkeeping in [`coordinator`].
//!
//! The communication graphs and their mixing matrices are the collective layer's
//! ([`ringtmp_collective::mixing`]), which rings of rings gossip over too.

pub mod adpsgd;
pub mod consensus;
pub mod coordinator;
pub mod dpsgd;
pub mod pairing;

pub use adpsgd::AdpsgdJob;
pub use consensus::{Models, consensus};
pub use dpsgd::{DpsgdJob, DpsgdOptions, NAME};
