//! `ringtmp-contract`: what every strategy implements and shares. Each strategy computes through
//! `ringtmp-model` stages, reads data through `ringtmp-data` and reports through
//! `ringtmp-metrics`; this crate holds the rest of what they have in common, and names none of
//! them (Cargo keeps it so: no strategy crate is among its dependencies).
//!
//! - [`contract`]: [`Strategy`], [`NodeCx`], [`Cluster`], [`PlanReport`] and the checks
//!   strategies share.
//! - [`config`]: the validated run configuration; [`RunSpec`]: what every strategy's job shares
//!   (the configuration and what follows from the data), declared once.
//! - [`event`], [`evaluation`], [`clipping`], [`resume`], [`recorder`]: progress events,
//!   evaluation passes, global-norm clipping, resuming from a checkpoint, and `metrics.jsonl` /
//!   `summary.json`, the same for every strategy.
//! - [`machine`], [`memory_floor`]: what this machine offers a node, and the least memory a
//!   node's share of a model needs.
//! - [`messages`]: a strategy's own wire messages, declared in its crate.
//! - [`batch_scaling`], [`per_node`], [`text_form`], [`defaulted`]: the rate's scaling with the
//!   global batch, values given per rank (`1:256M`), the serde adapter of typed flags, and a
//!   value with its origin (the user's, or a default the planners may adapt).

pub mod batch_scaling;
pub mod clipping;
pub mod config;
pub mod contract;
pub mod defaulted;
pub mod error;
pub mod evaluation;
pub mod event;
pub mod machine;
pub mod memory_floor;
pub mod messages;
pub mod per_node;
pub mod recorder;
pub mod resume;
pub mod spec;
pub mod text_form;

pub use config::{CHECKPOINT_AT_END, DEFAULT_RECV_TIMEOUT_SECS, TextSource, TrainConfig};
pub use contract::{Cluster, Family, NodeCx, PlanReport, SharedMachine, Strategy};
pub use defaulted::{Defaulted, Origin};
pub use error::{Error, Result};
pub use event::Event;
pub use spec::{ResumePoint, RunSpec, layers_for, model_shapes, sequence_of, vocabulary_of};
