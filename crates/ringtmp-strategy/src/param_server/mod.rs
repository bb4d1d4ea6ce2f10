//! The parameter-server strategy (issue 5, in progress). So far: the consistency models as a
//! sans-IO gate, with the DSSP synchronisation controller, tested on a simulated cluster with
//! virtual time. The server/worker drivers come next.
//!
//! # Layout
//! - [`consistency`]: BSP, SSP, ASP and DSSP as one gate over the workers' clocks.
//! - [`driver`]: server and worker loops over the links.

pub mod consistency;
pub mod driver;
