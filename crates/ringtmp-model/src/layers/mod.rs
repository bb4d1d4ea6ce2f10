//! The layers: explicit forward and backward passes, no autograd.
//!
//! A [`Layer`] knows its per-sample input and output shapes (fixed when the model is built), the
//! number of parameters it owns and how to initialise them. Parameters and gradients live in the
//! owning [`Stage`](crate::Stage)'s flat buffers; a layer only ever sees its own slice.
//!
//! Invariants every layer keeps:
//! - `forward` overwrites all of `y` and records in [`Aux`] whatever `backward` needs besides the
//!   layer's input and output (pooling indices, dropout masks).
//! - `backward` either overwrites (`accumulate == false`) or adds to its parameter gradients, and
//!   overwrites all of `dx` when one is asked for.
//! - Nothing depends on state left by a previous micro-batch, so forwards and backwards of
//!   different micro-batches may interleave in any order.

mod attention;
mod block;
mod conv2d;
mod conv_direct;
mod conv_shape;
mod cut;
mod dropout;
mod embedding;
mod heads;
mod linear;
mod linear_part;
mod llama;
mod norm;
mod pass;
mod pool;
pub mod rope;
mod swiglu;

pub use attention::{CausalSelfAttention, KeyValues};
pub use block::Block;
pub use conv_shape::Conv2d;
pub(crate) use conv2d::{Fused, OutputGrad};
pub use cut::cut_linear;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use linear::Linear;
pub use linear_part::LinearPart;
pub(crate) use linear_part::Side;
pub use llama::LlamaBlock;
pub(crate) use norm::gelu_forward_threaded;
pub use norm::{NORM_EPS, Norm, NormKind, gelu_backward, gelu_forward};
pub use pass::{Aux, Pass, mix};
pub use pool::MaxPool2d;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::kernels::{self, set_len};
use crate::shape::Shape;

/// The operation a layer performs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LayerKind {
    /// Fully connected layer.
    Linear(Linear),
    /// 2-D convolution over a channels-last image.
    Conv2d(Conv2d),
    /// 2-D max-pooling over a channels-last image.
    MaxPool2d(MaxPool2d),
    /// Rectified linear unit.
    Relu,
    /// Reinterprets an image as a flat vector (no data movement beyond a copy).
    Flatten,
    /// Inverted dropout.
    Dropout(Dropout),
    /// The first output features of a linear layer cut in two (see [`LinearPart`]): passes its
    /// input on with them.
    LinearHead(LinearPart),
    /// The rest of a linear layer cut in two: the whole layer's output from the head's.
    LinearTail(LinearPart),
    /// LayerNorm or RMSNorm over the last dimension.
    Norm(Norm),
    /// GELU, tanh form.
    Gelu,
    /// Causal multi-head self-attention over `[seq, width]`.
    CausalSelfAttention(CausalSelfAttention),
    /// Token and position embeddings: `[seq]` ids to `[seq, width]`.
    Embedding(Embedding),
    /// A pre-norm transformer block over `[seq, width]`.
    Block(Block),
    /// The Llama family's decoder block over `[seq, width]` (RMSNorm, RoPE, grouped-query
    /// attention, SwiGLU).
    LlamaBlock(LlamaBlock),
}

/// One layer of a model, with its place in the model and its shapes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// Index in the whole (unpartitioned) model; seeds the initialisation.
    pub index: usize,
    /// The operation.
    pub kind: LayerKind,
    /// Per-sample input shape.
    pub input: Shape,
    /// Per-sample output shape.
    pub output: Shape,
    /// Standard deviation factor of the weight initialisation: `std = sqrt(gain / fan_in)`; 2 (He)
    /// for weights feeding a ReLU, 1 (LeCun) otherwise.
    pub init_gain: f32,
    /// The model index of the embedding whose token table this layer's weight is (weight tying,
    /// see the `tie` module): set on a language model's head when the model ties them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_to: Option<usize>,
}

impl Layer {
    /// Short lowercase name of the layer kind, as used in model files.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            LayerKind::Linear(_) => "linear",
            LayerKind::Conv2d(_) => "conv2d",
            LayerKind::MaxPool2d(_) => "max_pool2d",
            LayerKind::Relu => "relu",
            LayerKind::Flatten => "flatten",
            LayerKind::Dropout(_) => "dropout",
            LayerKind::LinearHead(_) => "linear_head",
            LayerKind::LinearTail(_) => "linear_tail",
            LayerKind::Norm(Norm {
                kind: NormKind::Layer,
                ..
            }) => "layer_norm",
            LayerKind::Norm(Norm {
                kind: NormKind::Rms,
                ..
            }) => "rms_norm",
            LayerKind::Gelu => "gelu",
            LayerKind::CausalSelfAttention(_) => "causal_self_attention",
            LayerKind::Embedding(_) => "embedding",
            LayerKind::Block(_) => "block",
            LayerKind::LlamaBlock(_) => "llama_block",
        }
    }

    /// The rows a pass of `rows` rows counts for in the meter, which prices work by the model's
    /// layer (the simulator's cost model): `rows`, or for a part of a cut linear layer its share
    /// of them by output features — the head's rounded, the tail's the rest, so that the two
    /// count for exactly the whole layer's rows.
    pub fn metered_rows(&self, rows: usize) -> usize {
        let head = |p: &LinearPart| (rows * p.split + p.out_features / 2) / p.out_features.max(1);
        match &self.kind {
            LayerKind::LinearHead(p) => head(p),
            LayerKind::LinearTail(p) => rows - head(p),
            _ => rows,
        }
    }

    /// Rows a pass of `n` samples runs this layer on: a linear layer over a sequence
    /// `[positions, features]` runs on every position; every other layer on the samples.
    pub fn rows_for(&self, n: usize) -> usize {
        match &self.kind {
            LayerKind::Linear(l) => n * (self.input.numel() / l.in_features.max(1)),
            _ => n,
        }
    }

    /// A fixed, valid input of `rows` samples for timing the layer alone (the planner's profile,
    /// the simulator's calibration): token ids spread over the vocabulary for an embedding,
    /// values in [-0.5, 0.5) for every other layer.
    pub fn sample_input(&self, rows: usize) -> Vec<f32> {
        let n = rows * self.input.numel();
        match &self.kind {
            LayerKind::Embedding(e) => (0..n).map(|k| ((k * 7919) % e.vocab) as f32).collect(),
            _ => (0..n)
                .map(|k| ((k * 7919) % 17) as f32 / 17.0 - 0.5)
                .collect(),
        }
    }

    /// Number of trainable parameters (weights then biases, in that order in the flat buffer).
    pub fn param_count(&self) -> usize {
        match &self.kind {
            LayerKind::Linear(l) => l.param_count(),
            LayerKind::Conv2d(c) => c.param_count(),
            LayerKind::LinearHead(p) => p.head_param_count(),
            LayerKind::LinearTail(p) => p.tail_param_count(),
            LayerKind::Norm(n) => n.param_count(),
            LayerKind::CausalSelfAttention(a) => a.param_count(),
            LayerKind::Embedding(e) => e.param_count(),
            LayerKind::Block(b) => b.param_count(),
            LayerKind::LlamaBlock(b) => b.param_count(),
            _ => 0,
        }
    }

    /// `(skipped, weight_len, fan_in)` for layers with weights: the layer's weights are values
    /// `skipped..skipped + weight_len` of the whole layer's (a cut linear layer's tail skips the
    /// head's rows).
    fn weight_geometry(&self) -> Option<(usize, usize, usize)> {
        match &self.kind {
            LayerKind::Linear(l) => Some((0, l.in_features * l.out_features, l.in_features)),
            LayerKind::Conv2d(c) => Some((0, c.weight_len(), c.fan_in())),
            LayerKind::LinearHead(p) => Some((0, p.split * p.in_features, p.in_features)),
            LayerKind::LinearTail(p) => Some((
                p.split * p.in_features,
                (p.out_features - p.split) * p.in_features,
                p.in_features,
            )),
            _ => None,
        }
    }

    /// Names and shapes of the parameter tensors, for checkpoints. A part of a cut linear layer
    /// names its share of the whole layer's tensors as a piece: `<name>@<offset>`, flat.
    pub fn param_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match &self.kind {
            LayerKind::Linear(l) => {
                let mut t = vec![(
                    format!("layers.{}.weight", self.index),
                    vec![l.out_features, l.in_features],
                )];
                if l.bias {
                    t.push((format!("layers.{}.bias", self.index), vec![l.out_features]));
                }
                t
            }
            LayerKind::Conv2d(c) => vec![
                (
                    format!("layers.{}.weight", self.index),
                    vec![c.out_channels, c.kernel, c.kernel, c.in_channels],
                ),
                (format!("layers.{}.bias", self.index), vec![c.out_channels]),
            ],
            // The rows of the whole layer's tensors each part holds, as pieces of them
            // (`<name>@<offset>`, flat): a checkpoint of a cut model is one of the unsplit model.
            LayerKind::LinearHead(p) => vec![
                (
                    format!("layers.{}.weight@0", self.index),
                    vec![p.split * p.in_features],
                ),
                (format!("layers.{}.bias@0", self.index), vec![p.split]),
            ],
            LayerKind::LinearTail(p) => vec![
                (
                    format!("layers.{}.weight@{}", self.index, p.split * p.in_features),
                    vec![(p.out_features - p.split) * p.in_features],
                ),
                (
                    format!("layers.{}.bias@{}", self.index, p.split),
                    vec![p.out_features - p.split],
                ),
            ],
            // PyTorch's names: `weight` (γ) and, for LayerNorm, `bias` (β).
            LayerKind::Norm(n) => {
                let mut t = vec![(format!("layers.{}.weight", self.index), vec![n.features])];
                if n.kind == NormKind::Layer {
                    t.push((format!("layers.{}.bias", self.index), vec![n.features]));
                }
                t
            }
            // GPT-2's (nanoGPT's) names, under the layer's.
            LayerKind::CausalSelfAttention(a) => {
                let c = a.width;
                vec![
                    (
                        format!("layers.{}.c_attn.weight", self.index),
                        vec![3 * c, c],
                    ),
                    (format!("layers.{}.c_attn.bias", self.index), vec![3 * c]),
                    (format!("layers.{}.c_proj.weight", self.index), vec![c, c]),
                    (format!("layers.{}.c_proj.bias", self.index), vec![c]),
                ]
            }
            LayerKind::Block(b) => b.param_tensors(&format!("layers.{}", self.index)),
            LayerKind::LlamaBlock(b) => b.param_tensors(&format!("layers.{}", self.index)),
            LayerKind::Embedding(e) => {
                let mut t = vec![(
                    format!("layers.{}.wte.weight", self.index),
                    vec![e.vocab, e.width],
                )];
                if e.positions {
                    t.push((
                        format!("layers.{}.wpe.weight", self.index),
                        vec![e.seq, e.width],
                    ));
                }
                t
            }
            _ => vec![],
        }
    }

    /// Writes the initial parameters: normal weights with `std = sqrt(gain / fan_in)` and zero
    /// biases, drawn from a generator seeded by `(seed, index)` only, so any partition of a model
    /// starts bit-identical to the whole model.
    pub fn init(&self, params: &mut [f32], seed: u64) {
        debug_assert_eq!(params.len(), self.param_count());
        if let LayerKind::Norm(n) = &self.kind {
            n.init(params);
            return;
        }
        if let LayerKind::CausalSelfAttention(a) = &self.kind {
            // Both projections' weights normal with `std = sqrt(gain / width)`, biases zero.
            let std = (self.init_gain / a.width as f32).sqrt();
            let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, self.index as u64));
            let [wqkv, bqkv, wproj, bproj] = a.tensors();
            for (o, l) in [wqkv, wproj] {
                for v in &mut params[o..o + l] {
                    let z: f32 = StandardNormal.sample(&mut rng);
                    *v = z * std;
                }
            }
            for (o, l) in [bqkv, bproj] {
                params[o..o + l].fill(0.0);
            }
            return;
        }
        if let LayerKind::Block(b) = &self.kind {
            let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, self.index as u64));
            b.init(params, || StandardNormal.sample(&mut rng));
            return;
        }
        if let LayerKind::LlamaBlock(b) = &self.kind {
            let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, self.index as u64));
            b.init(params, || StandardNormal.sample(&mut rng));
            return;
        }
        if let LayerKind::Embedding(_) = &self.kind {
            // GPT-2's: normal with standard deviation 0.02, both tables.
            let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, self.index as u64));
            for v in params.iter_mut() {
                let z: f32 = StandardNormal.sample(&mut rng);
                *v = z * 0.02;
            }
            return;
        }
        let Some((skipped, weight_len, fan_in)) = self.weight_geometry() else {
            return;
        };
        let std = (self.init_gain / fan_in as f32).sqrt();
        let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, self.index as u64));
        for _ in 0..skipped {
            let _: f32 = StandardNormal.sample(&mut rng);
        }
        let (w, b) = params.split_at_mut(weight_len);
        for v in w {
            let z: f32 = StandardNormal.sample(&mut rng);
            *v = z * std;
        }
        b.fill(0.0);
    }

    /// Computes `y` (`[n, output]`) from `x` (`[n, input]`).
    pub fn forward(
        &self,
        params: &[f32],
        x: &[f32],
        n: usize,
        y: &mut Vec<f32>,
        aux: &mut Aux,
        pass: &Pass,
        threads: usize,
    ) {
        set_len(y, n * self.output.numel());
        match &self.kind {
            LayerKind::Linear(l) => l.forward(params, x, self.rows_for(n), y, threads),
            LayerKind::Conv2d(c) => c.forward(
                params,
                x,
                n,
                y,
                conv2d::Fused::Nothing,
                &mut aux.indices,
                threads,
            ),
            LayerKind::MaxPool2d(p) => p.forward(x, n, y, aux, threads),
            LayerKind::Relu => kernels::relu_forward(x, y),
            LayerKind::Flatten => y.copy_from_slice(x),
            LayerKind::Dropout(d) => d.forward(self.index, x, n, y, aux, pass),
            LayerKind::LinearHead(p) => p.head_forward(params, x, n, y, threads),
            LayerKind::LinearTail(p) => p.tail_forward(params, x, n, y, &mut aux.values, threads),
            LayerKind::Norm(norm) => {
                set_len(&mut aux.values, 2 * x.len() / norm.features);
                norm.forward(params, x, y, &mut aux.values, threads);
            }
            LayerKind::Gelu => norm::gelu_forward_threaded(x, y, threads),
            LayerKind::CausalSelfAttention(a) => {
                set_len(&mut aux.values, a.stash_len(n));
                a.forward(params, x, n, y, &mut aux.values, threads);
            }
            LayerKind::Embedding(e) => e.forward(params, x, y),
            LayerKind::Block(b) => {
                set_len(&mut aux.values, b.stash_len(n));
                b.forward(params, x, n, y, &mut aux.values, threads);
            }
            LayerKind::LlamaBlock(b) => {
                set_len(&mut aux.values, b.stash_len(n));
                b.forward(params, x, n, y, &mut aux.values, threads);
            }
        }
    }

    /// Back-propagates `dy` (`[n, output]`): adds to (or overwrites, when `!accumulate`) the
    /// parameter gradients `grads` and, when `dx` is given, overwrites it with `[n, input]`
    /// input gradients. `x`, `y` and `aux` are what this layer's forward saw and produced.
    pub fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        accumulate: bool,
        x: &[f32],
        y: &[f32],
        aux: &Aux,
        dy: &[f32],
        n: usize,
        dx: Option<&mut Vec<f32>>,
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let mut dx = dx;
        if let Some(dx) = dx.as_deref_mut() {
            set_len(dx, n * self.input.numel());
        }
        match &self.kind {
            LayerKind::Linear(l) => {
                let rows = self.rows_for(n);
                l.backward(params, grads, accumulate, x, dy, rows, dx, threads);
            }
            LayerKind::Conv2d(c) => c.backward(
                params,
                grads,
                accumulate,
                x,
                conv2d::OutputGrad::Plain(dy),
                n,
                dx,
                scratch,
                threads,
            ),
            LayerKind::MaxPool2d(_) => {
                if let Some(dx) = dx {
                    pool::MaxPool2d::backward(aux, dy, dx);
                }
            }
            LayerKind::Relu => {
                if let Some(dx) = dx {
                    kernels::relu_backward(y, dy, dx);
                }
            }
            LayerKind::Flatten => {
                if let Some(dx) = dx {
                    dx.copy_from_slice(dy);
                }
            }
            LayerKind::Dropout(_) => {
                if let Some(dx) = dx {
                    Dropout::backward(aux, dy, dx);
                }
            }
            LayerKind::LinearHead(p) => {
                p.backward(Side::Head, params, grads, accumulate, x, dy, n, dx, threads);
            }
            LayerKind::LinearTail(p) => {
                let x = &aux.values;
                p.backward(Side::Tail, params, grads, accumulate, x, dy, n, dx, threads);
            }
            LayerKind::Norm(norm) => {
                let dx = dx.map(|d| d.as_mut_slice());
                norm.backward(params, grads, accumulate, x, &aux.values, dy, dx);
            }
            LayerKind::Gelu => {
                if let Some(dx) = dx {
                    dx.copy_from_slice(dy);
                    norm::gelu_backward_in_place_threaded(x, dx, threads);
                }
            }
            LayerKind::CausalSelfAttention(a) => {
                let dx = dx.map(|d| d.as_mut_slice());
                let stash = &aux.values;
                set_len(scratch, a.scratch_len(n));
                a.backward(
                    params, grads, accumulate, x, stash, dy, n, dx, scratch, threads,
                );
            }
            LayerKind::Embedding(e) => e.backward(grads, accumulate, x, dy, dx),
            LayerKind::Block(b) => {
                let dx = dx.map(|d| d.as_mut_slice());
                let stash = &aux.values;
                b.backward(
                    params, grads, accumulate, x, stash, dy, n, dx, scratch, threads,
                );
            }
            LayerKind::LlamaBlock(b) => {
                let dx = dx.map(|d| d.as_mut_slice());
                let stash = &aux.values;
                b.backward(
                    params, grads, accumulate, x, stash, dy, n, dx, scratch, threads,
                );
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod gradcheck;
