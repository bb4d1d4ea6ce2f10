//! `ringtmp-metrics`: what a run measures and how it is written down — the `summary.json` contract
//! of DESIGN.md §6, the `metrics.jsonl` event stream, and process resource readings (peak RSS,
//! CPU time).
//!
//! Every number in a summary is measured; fields that are estimates say so in their name
//! (`estimated_…`).
//!
//! # Layout
//! - [`Summary`], [`NodeSummary`], [`DroppedNode`]: the output contract.
//! - [`EventLog`]: append-only JSON-lines writer.
//! - [`resources`]: peak resident set size and CPU seconds of this process.

pub mod resources;
mod summary;

pub use summary::{
    DroppedNode, EventLog, LanguageSummary, MAX_REPORTED_STEPS, NodeSummary, RegressionSummary,
    Restart, Summary,
};
