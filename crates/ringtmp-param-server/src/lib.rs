//! The parameter-server strategy: `S` servers own contiguous shards of the parameters with their
//! optimizer state, `W` workers train replicas on units of every global batch.
//!
//! # Layout
//! - [`consistency`]: BSP, SSP, ASP and DSSP as one gate over the workers' positions, with the
//!   DSSP synchronisation controller.
//! - [`admission`]: when a server answers a pull, and with which unit (sans-IO).
//! - [`driver`]: the job, its messages, and the worker's loop over the links.
//! - [`server`]: what each input does to a server's shard, as a sans-I/O machine, and its loop.
//! - [`node`]: the strategy's shape: a rank's role, its report, server 0's summary.
//! - [`plan`]: `--strategy ps` options into the job every node runs.

pub mod admission;
pub mod consistency;
pub mod driver;
pub mod node;
pub mod plan;
pub mod server;
