//! `ringtmp-model`: the compute engine of ringtmp — layers with hand-written forward and backward
//! passes over the `gemm` crate, stages (contiguous blocks of layers), the loss, optimizers and
//! checkpoints. No I/O beyond checkpoint files, no async, no networking: every strategy computes
//! through this crate, and the `local` strategy built on it is the oracle they are tested against.
//!
//! # Layout
//! - [`spec`]: model descriptions (presets, TOML files) and shape inference.
//! - [`layers`]: the layers and their kernels.
//! - [`Stage`]: a block of layers with flat parameters and gradients and a per-micro-batch stash.
//! - [`loss`]: softmax cross-entropy.
//! - [`optim`]: SGD with momentum, Adam, learning-rate schedules.
//! - [`packed`]: weights held for generation in fewer bytes (bf16, f16, ggml's 8- and 4-bit
//!   blocks) and the matrix–vector kernels that read them.
//! - [`checkpoint`]: safetensors files and a hashed manifest, written atomically.
//!
//! # Example
//! ```
//! use ringtmp_model::{ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage, loss};
//!
//! let spec = ModelSpec::preset("mlp", 10).unwrap();
//! let layers = spec.build(&Shape::image(28, 28, 1), 10).unwrap();
//! let mut model = Stage::new(&layers, 0..layers.len(), 42, 1);
//! let mut opt = Optimizer::new(OptimizerConfig::Sgd { momentum: 0.9, weight_decay: 0.0 }, model.params().len());
//!
//! let (x, labels) = (vec![0.5f32; 2 * 784], [3u32, 7]);
//! let pass = Pass { train: true, seed: 42, step: 0, row_offset: 0 };
//! let logits = model.forward(0, &x, 2, &pass).unwrap().to_vec();
//! let mut dlogits = vec![0.0; logits.len()];
//! let out = loss::softmax_cross_entropy(&logits, &labels, 10, 0.5, &mut dlogits).unwrap();
//! model.backward(0, &dlogits).unwrap();
//! model.step(&mut opt, 0.05);
//! assert!(out.loss_sum > 0.0);
//! ```

pub mod arch;
pub mod checkpoint;
pub mod decode;
mod error;
pub mod generate;
pub mod interop;
pub mod kernels;
pub mod layers;
pub mod loss;
pub mod optim;
pub mod packed;
mod shape;
pub mod spec;
mod stage;
mod tie;

pub use error::{Error, Result, is_the_users_path};
pub use layers::{Layer, LayerKind, Pass};
pub use optim::{LrSchedule, Optimizer, OptimizerConfig};
pub use shape::Shape;
pub use spec::{LayerSpec, ModelSpec};
pub use stage::{LayerTime, Stage};
