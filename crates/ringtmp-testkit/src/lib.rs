//! `ringtmp-testkit`: what the test suites of ringtmp share, so no test file repeats another's
//! fixtures. A dev-dependency only.
//!
//! # Layout
//! - [`fixtures`]: the bundled digits, small models as TOML, parameter comparisons.
//! - [`formats`]: a dataset written out as NumPy arrays, CSV tables, PNG folders.
//! - [`jobs`]: ring and parameter-server jobs derived from the oracle's own configuration.
//! - [`oracle`]: the `local` strategy's final parameters, the reference every distributed
//!   strategy is checked against.
//! - [`nodes`]: one test body over many networks: real loopback TCP links or the seeded simulated
//!   network, on any topology.
//! - [`run`]: the ring and the parameter server run as `ringtmp node` runs them, on any network.
//! - [`process`]: running the `ringtmp` binary with a deadline and reading what it printed.

pub mod fixtures;
pub mod formats;
pub mod jobs;
pub mod nodes;
pub mod oracle;
pub mod process;
pub mod run;
