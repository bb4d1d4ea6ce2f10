//! Decoding a language model a few positions at a time, for generation: a [`Decoder`] runs a
//! stage's layers over the new positions of one sequence only, each attention reading the keys
//! and values of the earlier positions from its cache (a KV cache) and adding the new ones'.
//! A stage of a split model decodes its own layers with its own cache, so a ring generates
//! with every node holding the cache of its layers alone.
//!
//! The layers decode position by position (embeddings at their absolute position, norms, linear
//! layers, GELU, dropout as the identity) except attention, which needs the cache. A stage with
//! a layer that mixes positions otherwise (a convolution, pooling, a flatten, a linear layer cut
//! in two) is not a sequence model here, and [`Decoder::new`] says which layer.
//!
//! Invariants: the cache holds the positions `0..position()` of every attention of the stage,
//! never more than the model's context (`capacity()`); the logits of each position equal those of
//! the full forward ([`crate::Stage::infer`]) over the same tokens up to float rounding (tested below);
//! decoding reads the parameters and writes nothing but the cache and its own buffers.

use crate::error::{Error, Result};
use crate::kernels::{relu_forward, set_len};
use crate::layers::{KeyValues, LayerKind};
use crate::packed::{DecodeStage, Params, matrix_forward};

/// A stage's decoding state: the position reached and each attention's cache.
#[derive(Debug)]
pub struct Decoder {
    /// Per layer of the stage: its cache, for attentions and blocks.
    caches: Vec<Option<KeyValues>>,
    /// Positions decoded so far.
    position: usize,
    /// The model's context: positions per sequence.
    capacity: usize,
    /// Activations between layers.
    a: Vec<f32>,
    b: Vec<f32>,
    stats: Vec<f32>,
    scratch: Vec<f32>,
    /// Whether [`Decoder::step`] returns the last position's output alone.
    last_only: bool,
    /// The first layer after which no layer mixes positions (embeddings count as mixing: they
    /// read the position).
    positionwise_from: usize,
}

impl Decoder {
    /// A decoder for `stage`, at position 0; refuses a stage with a layer that cannot decode
    /// position by position.
    pub fn new<S: DecodeStage + ?Sized>(stage: &S) -> Result<Self> {
        Self::for_layers(stage.layers())
    }

    /// A decoder for a stage of `layers` (the check needs no parameters: a launcher that
    /// checks a split must not build the model it splits).
    pub fn for_layers(layers: &[crate::Layer]) -> Result<Self> {
        let refuse = |index: usize, what: &str| Error::Config {
            source_name: format!("layer {index}"),
            reason: format!(
                "{what} mixes positions: only a sequence model (embeddings, transformer blocks, \
                 norms, linear layers, GELU, dropout) generates token by token"
            ),
        };
        let mut capacity = None;
        let mut caches = Vec::new();
        for layer in layers {
            let seq = match &layer.kind {
                LayerKind::Embedding(e) => Some(e.seq),
                LayerKind::Block(b) => Some(b.seq),
                LayerKind::LlamaBlock(b) => Some(b.seq),
                LayerKind::CausalSelfAttention(a) => Some(a.seq),
                LayerKind::Linear(l) if layer.input.numel() % l.in_features.max(1) == 0 => None,
                LayerKind::Norm(_) | LayerKind::Gelu | LayerKind::Relu | LayerKind::Dropout(_) => {
                    None
                }
                LayerKind::Linear(_) => return Err(refuse(layer.index, "a linear layer")),
                LayerKind::Conv2d(_) => return Err(refuse(layer.index, "a convolution")),
                LayerKind::MaxPool2d(_) => return Err(refuse(layer.index, "pooling")),
                LayerKind::Flatten => return Err(refuse(layer.index, "a flatten")),
                LayerKind::LinearHead(_) | LayerKind::LinearTail(_) => {
                    return Err(refuse(layer.index, "a linear layer cut in two"));
                }
            };
            if let Some(seq) = seq {
                capacity = Some(capacity.map_or(seq, |c: usize| c.min(seq)));
            }
            caches.push(
                matches!(
                    layer.kind,
                    LayerKind::Block(_)
                        | LayerKind::LlamaBlock(_)
                        | LayerKind::CausalSelfAttention(_)
                )
                .then(KeyValues::default),
            );
        }
        let positionwise_from = layers
            .iter()
            .rposition(|l| {
                matches!(
                    l.kind,
                    LayerKind::Embedding(_)
                        | LayerKind::Block(_)
                        | LayerKind::LlamaBlock(_)
                        | LayerKind::CausalSelfAttention(_)
                )
            })
            .map_or(0, |i| i + 1);
        Ok(Self {
            positionwise_from,
            last_only: false,
            caches,
            position: 0,
            // A stage of position-wise layers alone (a split model's last norm and head) takes
            // any number of positions: the stages before it bound the sequence.
            capacity: capacity.unwrap_or(usize::MAX),
            a: Vec::new(),
            b: Vec::new(),
            stats: Vec::new(),
            scratch: Vec::new(),
        })
    }

    /// This decoder's [`Decoder::step`] returns the last position's output alone, computing
    /// the position-wise layers after the stage's last attention for it alone (a
    /// generating chain's last stage: only the last position's logits are sampled).
    pub fn last_position_only(mut self) -> Self {
        self.last_only = true;
        self
    }

    /// Positions decoded so far (the next one's index).
    pub fn position(&self) -> usize {
        self.position
    }

    /// The most positions a sequence may have (the model's context; unbounded for a stage
    /// without embeddings or attention).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position: the next [`Decoder::step`] starts a sequence.
    pub fn reset(&mut self) {
        self.position = 0;
        for cache in self.caches.iter_mut().flatten() {
            cache.keys.clear();
            cache.values.clear();
        }
    }

    /// Bytes the caches hold now.
    pub fn cache_bytes(&self) -> usize {
        self.caches
            .iter()
            .flatten()
            .map(|c| (c.keys.len() + c.values.len()) * 4)
            .sum()
    }

    /// Runs `stage` over `rows` new positions: `x` is their input to the stage (token ids as
    /// `f32` on the first stage, `[rows, width]` activations after it); returns their output
    /// (`[rows, width]`, or `[rows, vocab]` logits from the last stage; the last row alone after
    /// [`Decoder::last_position_only`]) and moves the position on by `rows`.
    pub fn step<S: DecodeStage + ?Sized>(
        &mut self,
        stage: &S,
        x: &[f32],
        rows: usize,
    ) -> Result<&[f32]> {
        let at = self.position;
        if at + rows > self.capacity {
            return Err(Error::Config {
                source_name: format!("stage at layer {}", stage.first_layer()),
                reason: format!(
                    "positions {at}..{} exceed the model's context of {}",
                    at + rows,
                    self.capacity
                ),
            });
        }
        let per_row = stage.layers().first().map_or(0, row_width);
        if x.len() != rows * per_row {
            return Err(Error::Config {
                source_name: format!("stage at layer {}", stage.first_layer()),
                reason: format!("{} input values for {rows} positions of {per_row}", x.len()),
            });
        }
        let threads = stage.threads();
        self.a.clear();
        self.a.extend_from_slice(x);
        let mut rows_now = rows;
        for (i, layer) in stage.layers().iter().enumerate() {
            if self.last_only && rows_now > 1 && i >= self.positionwise_from {
                // The layers from here on treat positions apart: only the last one's output
                // is wanted (a prompt's logits over a vocabulary cost as much as its layers).
                let width = self.a.len() / rows_now;
                self.a.drain(..(rows_now - 1) * width);
                rows_now = 1;
            }
            let p = stage.layer_params(i);
            let cache = &mut self.caches[i];
            let (x, y) = (&self.a, &mut self.b);
            set_len(y, rows_now * layer.output.numel() / seq_of(layer));
            let flat = || {
                p.flat()
                    .expect("only embeddings, linear layers and Llama blocks hold packed weights")
            };
            match &layer.kind {
                LayerKind::Embedding(e) => match p.flat() {
                    Some(p) => e.forward_at(p, x, at, y),
                    None => embed_held(e, p, x, at, y),
                },
                LayerKind::Linear(l) => {
                    let w = (0, l.in_features * l.out_features);
                    let bias = p.vector((w.1, layer.param_count() - w.1));
                    let (n, k) = (l.out_features, l.in_features);
                    matrix_forward(y, rows_now, n, k, x, &p.matrix(w), bias, threads);
                }
                LayerKind::Norm(norm) => {
                    set_len(&mut self.stats, 2 * rows_now);
                    let p = p.vector((0, layer.param_count()));
                    norm.forward(p, x, y, &mut self.stats, threads);
                }
                LayerKind::Gelu => crate::layers::gelu_forward_threaded(x, y, threads),
                LayerKind::Relu => relu_forward(x, y),
                LayerKind::Dropout(_) => y.copy_from_slice(x),
                LayerKind::CausalSelfAttention(a) => {
                    let cache = cache.as_mut().expect("an attention has a cache");
                    a.decode(
                        flat(),
                        x,
                        rows_now,
                        at,
                        cache,
                        y,
                        &mut self.scratch,
                        threads,
                    );
                }
                LayerKind::Block(b) => {
                    let cache = cache.as_mut().expect("a block has a cache");
                    b.decode(
                        flat(),
                        x,
                        rows_now,
                        at,
                        cache,
                        y,
                        &mut self.scratch,
                        threads,
                    );
                }
                LayerKind::LlamaBlock(b) => {
                    let cache = cache.as_mut().expect("a block has a cache");
                    b.decode(p, x, rows_now, at, cache, y, &mut self.scratch, threads);
                }
                LayerKind::Conv2d(_)
                | LayerKind::MaxPool2d(_)
                | LayerKind::Flatten
                | LayerKind::LinearHead(_)
                | LayerKind::LinearTail(_) => unreachable!("refused by Decoder::new"),
            }
            std::mem::swap(&mut self.a, &mut self.b);
        }
        if self.last_only && rows_now > 1 {
            let width = self.a.len() / rows_now;
            self.a.drain(..(rows_now - 1) * width);
        }
        self.position += rows;
        Ok(&self.a)
    }
}

/// An embedding whose table is held packed: each token's row dequantised, its position's row
/// (`f32`) added when there are learned positions.
fn embed_held(e: &crate::layers::Embedding, p: Params<'_>, x: &[f32], at: usize, y: &mut [f32]) {
    let table = p.matrix((0, e.vocab * e.width));
    let positions = p.vector((
        e.vocab * e.width,
        if e.positions { e.seq * e.width } else { 0 },
    ));
    for (i, (&token, out)) in x.iter().zip(y.chunks_exact_mut(e.width)).enumerate() {
        let id = (token.max(0.0) as usize).min(e.vocab - 1);
        table.row(id, e.width, out);
        if e.positions {
            let pos = &positions[(at + i) * e.width..(at + i + 1) * e.width];
            for (o, v) in out.iter_mut().zip(pos) {
                *o += v;
            }
        }
    }
}

/// Positions in a layer's per-sample input (1 for a layer whose input is one row).
fn seq_of(layer: &crate::Layer) -> usize {
    match &layer.kind {
        LayerKind::Embedding(e) => e.seq,
        _ => (layer.input.numel() / row_width(layer)).max(1),
    }
}

/// Values of one position of a layer's input.
fn row_width(layer: &crate::Layer) -> usize {
    match &layer.kind {
        LayerKind::Embedding(_) => 1,
        LayerKind::Linear(l) => l.in_features,
        LayerKind::Norm(n) => n.features,
        LayerKind::Block(b) => b.width,
        LayerKind::LlamaBlock(b) => b.width,
        LayerKind::CausalSelfAttention(a) => a.width,
        _ => {
            // Element-wise layers keep their input's rows: the width is the last dimension.
            layer.input.0.last().copied().unwrap_or(1)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Shape;
    use crate::spec::ModelSpec;
    use crate::stage::Stage;

    /// A small GPT with a dropout between its blocks and attentions of different head counts.
    pub(crate) fn gpt(seq: usize) -> Vec<crate::Layer> {
        use crate::spec::LayerSpec::*;
        let spec = ModelSpec {
            name: "tiny-gpt".into(),
            layers: vec![
                Embedding {
                    vocab: 11,
                    width: 16,
                    positions: true,
                },
                Block {
                    heads: 2,
                    mlp_ratio: 4,
                },
                Dropout { p: 0.1 },
                Block {
                    heads: 4,
                    mlp_ratio: 2,
                },
                LayerNorm {
                    eps: crate::layers::NORM_EPS,
                },
                Linear {
                    out: 11,
                    bias: true,
                },
            ],
            tie_embeddings: false,
            stale_momentum: None,
        };
        spec.build_for(&Shape::flat(seq), &Shape(vec![seq, 11]))
            .unwrap()
    }

    /// The full forward's logits of `tokens` (left-aligned, padded to the context) at their
    /// positions.
    fn full_logits(stage: &mut Stage, tokens: &[u32], seq: usize, vocab: usize) -> Vec<f32> {
        let mut x = vec![0.0f32; seq];
        for (x, t) in x.iter_mut().zip(tokens) {
            *x = *t as f32;
        }
        stage.infer(&x, 1).unwrap()[..tokens.len() * vocab].to_vec()
    }

    #[test]
    fn decoding_with_the_cache_gives_the_full_forwards_logits() {
        let (seq, vocab) = (12, 11);
        let layers = gpt(seq);
        let mut whole = Stage::new(&layers, 0..layers.len(), 5, 1);
        let tokens: Vec<u32> = (0..seq as u32).map(|i| (i * 7 + 3) % 11).collect();
        let want = full_logits(&mut whole, &tokens, seq, vocab);
        // A prompt of 5 in one step, then one position at a time; and split in two stages.
        let mut decoder = Decoder::new(&whole).unwrap();
        let ids: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        let mut got = decoder.step(&whole, &ids[..5], 5).unwrap().to_vec();
        for t in 5..seq {
            got.extend_from_slice(decoder.step(&whole, &ids[t..t + 1], 1).unwrap());
        }
        assert_eq!(decoder.position(), seq);
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "decoded logits differ by {worst}");

        let (front, back) = (
            Stage::new(&layers, 0..2, 5, 1),
            Stage::new(&layers, 2..layers.len(), 5, 2),
        );
        let (mut d0, mut d1) = (Decoder::new(&front).unwrap(), Decoder::new(&back).unwrap());
        let mut split = Vec::new();
        for t in 0..seq {
            let h = d0.step(&front, &ids[t..t + 1], 1).unwrap().to_vec();
            split.extend_from_slice(d1.step(&back, &h, 1).unwrap());
        }
        let worst = want
            .iter()
            .zip(&split)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "split decoding differs by {worst}");
        assert!(d1.cache_bytes() > 0 && d0.cache_bytes() > 0);
    }

    #[test]
    fn the_context_bounds_a_sequence_and_reset_starts_another() {
        let layers = gpt(4);
        let stage = Stage::new(&layers, 0..layers.len(), 1, 1);
        let mut decoder = Decoder::new(&stage).unwrap();
        assert_eq!(decoder.capacity(), 4);
        decoder.step(&stage, &[1.0, 2.0, 3.0], 3).unwrap();
        let e = decoder
            .step(&stage, &[1.0, 2.0], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("exceed the model's context of 4"), "{e}");
        let first = decoder.step(&stage, &[4.0], 1).unwrap().to_vec();
        decoder.reset();
        assert_eq!((decoder.position(), decoder.cache_bytes()), (0, 0));
        decoder.step(&stage, &[1.0, 2.0, 3.0], 3).unwrap();
        assert_eq!(decoder.step(&stage, &[4.0], 1).unwrap(), &first[..]);
    }

    #[test]
    fn an_image_model_is_refused_naming_the_layer() {
        let spec = ModelSpec::preset("cnn", 10).unwrap();
        let layers = spec.build(&Shape::image(28, 28, 1), 10).unwrap();
        let stage = Stage::new(&layers, 0..layers.len(), 1, 1);
        let e = Decoder::new(&stage).unwrap_err().to_string();
        assert!(e.contains("layer 0") && e.contains("convolution"), "{e}");
    }
}
