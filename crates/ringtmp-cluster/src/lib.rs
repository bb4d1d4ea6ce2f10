//! `ringtmp-cluster`: how the nodes of a run find each other — which rank this process is, how
//! many there are and where rank 0 listens, from command-line flags or whichever launcher started
//! the process (torchrun, Slurm, Open MPI, PMI, Kubernetes indexed jobs). No home-made cluster
//! manager: these engines place the processes; ringtmp only meets.
//!
//! # Layout
//! - [`launch`]: the placement of this process, resolved from flags and environment.
//! - [`hostlist`]: Slurm's compressed host-list syntax.
//! - [`node`]: bringing a node up (listener, rendezvous, links).
//! - [`rendezvous`]: rank 0 collects listening addresses and hands out the table.

pub mod hostlist;
pub mod launch;
pub mod node;
pub mod rendezvous;

pub use launch::{LaunchFlags, Placement, Source, resolve};
