//! Weights held for inference in fewer bytes than `f32`: a model's matrices as its file gives
//! them (bf16 from a Hugging Face directory, ggml's 8- and 4-bit blocks from a GGUF file) or
//! converted on load (`--weights-dtype`), with the products the decoder needs computed from
//! them directly. Decoding reads every weight once per token, so a token costs the bytes held;
//! training keeps `f32` ([`crate::Stage`]).
//!
//! A layer's weights ([`LayerWeights`]) keep its flat layout's offsets: each tensor (as the
//! layer's `param_tensors` name them) is a piece, packed ([`PackedTensor`]) or `f32`, and
//! adjacent `f32` pieces are one. The layer's code asks for a vector (a norm's gain, a bias) or
//! a matrix (a fused q/k/v projection may be three pieces of different formats) by the span
//! it would read from the flat layout ([`Params`]), so one code path serves both.
//!
//! Invariants: a span asked as a vector lies inside one `f32` piece; a span asked as a matrix
//! is whole packed pieces and parts of `f32` ones; a packed piece may be shared (a tied head
//! and its embedding, `Arc`), and [`InferenceStage::bytes`] counts it once.

mod cpu;
mod dot;
mod format;
mod panel;
pub(crate) mod pool;
mod quantised;
mod stage;
mod weights;
mod widen;

pub use dot::dot_rows;
pub use format::{Format, PackedTensor, SharedBytes, bf16_bits, dequantize, quantize_q8_0};
pub use quantised::{Activations, Precision, QuantisedX, dot_rows_int8, takes_int8};
pub use stage::{DecodeStage, InferenceStage, packable};
pub use weights::{LayerWeights, Matrix, Params, Segment, Store, matrix_forward};
