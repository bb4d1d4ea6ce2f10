//! The collective layer: the mechanisms several strategies synchronise with, owned by none of
//! them. Strategies and rings of rings import these; nothing here imports a strategy.
//!
//! - [`ring`]: the chunk plan of one ring all-reduce (sans-IO, with its in-memory simulation).
//! - `reduce`: one reduction over the transport, in buckets that overlap the backward pass
//!   (all-reduce's gradients, DiLoCo's pseudo-gradients).
//! - [`regroup`]: re-forming a ring around a dead member (sans-IO, table-tested); `elastic`
//!   carries it out over the transport for any replicated state.
//! - [`mixing`]: gossip's communication graphs (`ring`, `exp`) and their mixing matrices
//!   (D-PSGD, AD-PSGD, rings of rings).
//! - [`outer`]: DiLoCo's outer optimizer, its fragments and when each synchronises (pure; also
//!   the outer step of rings of rings).
//! - [`whole_model`]: a whole model as one message (what the elastic ring re-admits a member
//!   with, and gossip's peers exchange).

pub mod elastic;
pub mod mixing;
pub mod outer;
pub mod reduce;
pub mod regroup;
pub mod ring;
pub mod whole_model;
