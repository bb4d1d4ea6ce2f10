//! A pretrained model as ringtmp's chain of layers: the description ([`ModelSpec`]) its
//! architecture makes — the embedding, one layer a decoder block, the final norm, the head —
//! and its weights read into a stage's parameters, layer by layer, only the layers the stage
//! holds (so a ring node never reads, let alone holds, another node's blocks).
//!
//! Invariants: every tensor read is checked against the shape its layer wants before a value
//! is copied (a mismatch names the file, the tensor and both shapes); the file's conventions
//! are undone here and nowhere else — GPT-2's Conv1D weights stored `[in, out]` in Hugging
//! Face's files are transposed, and the Llama rows of `q` and `k` that llama.cpp's converter
//! interleaves for its rotation are put back in the rotate-half order the blocks use.

use std::ops::Range;
use std::path::{Path, PathBuf};

use ringtmp_model::layers::NORM_EPS;
use ringtmp_model::{Layer, LayerKind, LayerSpec, ModelSpec, Shape};

use crate::config::{ConfigError, Family, ModelConfig};
use crate::gguf::{Gguf, GgufError};
use crate::hf::{HfError, HfModel};
use crate::vocabulary::Vocabulary;

/// What went wrong turning a pretrained model's files into layers.
#[derive(Debug, thiserror::Error)]
pub enum PretrainedError {
    /// The architecture.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A GGUF file.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A Hugging Face directory.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// A tensor of another shape than its layer's.
    #[error("{}: tensor {tensor:?} is {got:?}, the model's {family:?} architecture wants {want:?}", path.display())]
    Shape {
        /// The file or directory.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its family.
        family: Family,
        /// The shape the layer wants (PyTorch's order).
        want: Vec<usize>,
        /// The file's (PyTorch's order).
        got: Vec<usize>,
    },
    /// Anything else about the model (a context longer than its positions, say).
    #[error("{}: {what}", path.display())]
    Model {
        /// The file or directory.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
}

/// Where the weights are.
pub(crate) enum Source {
    Gguf(Box<Gguf>),
    Hf(Box<HfModel>),
}

/// A pretrained model's files, opened: its architecture, and its tensors on demand.
pub struct Pretrained {
    path: PathBuf,
    /// The architecture.
    pub config: ModelConfig,
    pub(crate) source: Source,
}

/// How one of a layer's tensors is stored in the file.
pub(crate) struct Stored {
    pub(crate) name: String,
    /// Stored `[in, out]` (GPT-2's Conv1D in Hugging Face's files).
    pub(crate) transposed: bool,
    /// llama.cpp's interleaved rows, in heads of this many rows.
    pub(crate) interleaved_heads: Option<usize>,
}

impl Stored {
    fn plain(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            transposed: false,
            interleaved_heads: None,
        }
    }
}

impl Pretrained {
    /// Opens a `.gguf` file or a Hugging Face model directory and reads its architecture.
    pub fn open(path: &Path) -> Result<Self, PretrainedError> {
        Self::open_as(path, Gguf::open)
    }

    /// [`Pretrained::open`] for a process that computes layers and never tokenizes (a node of
    /// a split model): a GGUF file's tokenizer is not read ([`Gguf::open_weights`]), so
    /// [`Pretrained::vocabulary`] refuses it.
    pub fn open_weights(path: &Path) -> Result<Self, PretrainedError> {
        Self::open_as(path, Gguf::open_weights)
    }

    fn open_as(
        path: &Path,
        gguf: fn(&Path) -> Result<Gguf, crate::gguf::GgufError>,
    ) -> Result<Self, PretrainedError> {
        let (config, source) = if path.is_dir() {
            let hf = HfModel::open(path)?;
            let config = ModelConfig::from_hf(&path.join("config.json"), &hf.config)?;
            (config, Source::Hf(Box::new(hf)))
        } else {
            let gguf = gguf(path)?;
            (ModelConfig::from_gguf(&gguf)?, Source::Gguf(Box::new(gguf)))
        };
        Ok(Self {
            path: path.to_path_buf(),
            config,
            source,
        })
    }

    /// The file or directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tokenizer, its framing tokens and its chat template.
    pub fn vocabulary(&self) -> Result<Vocabulary, PretrainedError> {
        Ok(match &self.source {
            Source::Gguf(g) => g.vocabulary()?,
            Source::Hf(h) => h.vocabulary()?,
        })
    }

    /// The chain of layers the model runs as, over windows of `seq` positions: the embedding,
    /// a layer a block, the final norm and the head (tied to the embedding where the model ties
    /// them). Refuses a window longer than the model's context.
    pub fn spec(&self, seq: usize) -> Result<ModelSpec, PretrainedError> {
        let c = &self.config;
        if seq == 0 || seq > c.context {
            return Err(self.model_error(format!(
                "a window of {seq} positions: the model's context is {}",
                c.context
            )));
        }
        let gpt2 = c.family == Family::Gpt2;
        let mut layers = vec![LayerSpec::Embedding {
            vocab: c.vocab,
            width: c.width,
            positions: gpt2,
        }];
        let eps = c.norm_eps as f32;
        if gpt2 {
            if !c.intermediate.is_multiple_of(c.width) || eps.to_bits() != NORM_EPS.to_bits() {
                return Err(self.model_error(format!(
                    "GPT-2 with an MLP of {} over a width of {} and a norm epsilon of {eps}: \
                     ringtmp's GPT-2 blocks take a whole multiple and {NORM_EPS}",
                    c.intermediate, c.width
                )));
            }
            layers.extend((0..c.layers).map(|_| LayerSpec::Block {
                heads: c.heads,
                mlp_ratio: c.intermediate / c.width,
            }));
            layers.push(LayerSpec::LayerNorm { eps });
        } else {
            layers.extend((0..c.layers).map(|_| LayerSpec::LlamaBlock {
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                hidden: c.intermediate,
                rope_theta: c.rope_theta,
                rope_scaling: c.rope_scaling.clone(),
                eps,
                qkv_bias: c.family == Family::Qwen2,
                qk_norm: c.family == Family::Qwen3,
            }));
            layers.push(LayerSpec::RmsNorm { eps });
        }
        layers.push(LayerSpec::Linear {
            out: c.vocab,
            bias: false,
        });
        Ok(ModelSpec {
            name: self
                .path
                .file_name()
                .map_or_else(|| "pretrained".into(), |n| n.to_string_lossy().into_owned()),
            layers,
            tie_embeddings: c.tie_embeddings,
            stale_momentum: None,
        })
    }

    /// The layers of [`Pretrained::spec`] built over windows of `seq` positions, checked
    /// against the file's tensor table ([`Pretrained::check`]).
    pub fn layers(&self, seq: usize) -> Result<Vec<Layer>, PretrainedError> {
        let spec = self.spec(seq)?;
        let layers = spec
            .build_for(&Shape::flat(seq), &Shape(vec![seq, self.config.vocab]))
            .map_err(|e| self.model_error(e.to_string()))?;
        self.check(&layers)?;
        Ok(layers)
    }

    /// Reads the weights of `layers[range]` into `params`, laid out as a stage holding those
    /// layers lays its parameters out (layer after layer, each as its `param_tensors` name
    /// them). A tied head is filled from the embedding's table.
    pub fn load(
        &self,
        layers: &[Layer],
        range: Range<usize>,
        params: &mut [f32],
    ) -> Result<(), PretrainedError> {
        let want: usize = layers[range.clone()].iter().map(Layer::param_count).sum();
        if params.len() != want {
            return Err(self.model_error(format!(
                "{} values to fill for layers {range:?}, which hold {want}",
                params.len()
            )));
        }
        let mut at = 0;
        for (position, layer) in layers.iter().enumerate().take(range.end).skip(range.start) {
            let stored = self.stored(layers.len(), position, layer)?;
            for ((_, shape), stored) in layer.param_tensors().into_iter().zip(stored) {
                let len: usize = shape.iter().product();
                self.read_into(&stored, &shape, &mut params[at..at + len])?;
                at += len;
            }
        }
        Ok(())
    }

    /// A stage holding `layers[range]` with the model's weights (read straight into it, with
    /// no seeded initialisation first), on `threads` threads.
    pub fn stage(
        &self,
        layers: &[Layer],
        range: Range<usize>,
        threads: usize,
    ) -> Result<ringtmp_model::Stage, PretrainedError> {
        ringtmp_model::Stage::loaded(layers, range.clone(), threads, |params| {
            self.load(layers, range, params)
        })
    }

    pub(crate) fn model_error(&self, what: String) -> PretrainedError {
        PretrainedError::Model {
            path: self.path.clone(),
            what,
        }
    }

    /// How the file stores the tensors of the layer at `position` of a chain of `count`, in
    /// the order of its `param_tensors`.
    pub(crate) fn stored(
        &self,
        count: usize,
        position: usize,
        layer: &Layer,
    ) -> Result<Vec<Stored>, PretrainedError> {
        let gguf = matches!(self.source, Source::Gguf(_));
        let c = &self.config;
        let gpt2 = c.family == Family::Gpt2;
        let hf_gpt2 = |name: &str| {
            let prefixed = format!("transformer.{name}");
            match &self.source {
                Source::Hf(h) if !h.tensors.contains_key(&prefixed) => name.to_string(),
                _ => prefixed,
            }
        };
        Ok(match (&layer.kind, position) {
            (LayerKind::Embedding(_), 0) => match (gguf, gpt2) {
                (true, true) => vec![
                    Stored::plain("token_embd.weight"),
                    Stored::plain("position_embd.weight"),
                ],
                (true, false) => vec![Stored::plain("token_embd.weight")],
                (false, true) => vec![
                    Stored::plain(hf_gpt2("wte.weight")),
                    Stored::plain(hf_gpt2("wpe.weight")),
                ],
                (false, false) => vec![Stored::plain("model.embed_tokens.weight")],
            },
            (LayerKind::Norm(_), p) if p + 2 == count => match (gguf, gpt2) {
                (true, true) => vec![
                    Stored::plain("output_norm.weight"),
                    Stored::plain("output_norm.bias"),
                ],
                (true, false) => vec![Stored::plain("output_norm.weight")],
                (false, true) => vec![
                    Stored::plain(hf_gpt2("ln_f.weight")),
                    Stored::plain(hf_gpt2("ln_f.bias")),
                ],
                (false, false) => vec![Stored::plain("model.norm.weight")],
            },
            (LayerKind::Linear(_), p) if p + 1 == count => {
                let name = match (gguf, c.tie_embeddings, gpt2) {
                    (true, false, _) => "output.weight".into(),
                    (true, true, _) => "token_embd.weight".into(),
                    (false, false, _) => "lm_head.weight".into(),
                    (false, true, true) => hf_gpt2("wte.weight"),
                    (false, true, false) => "model.embed_tokens.weight".into(),
                };
                vec![Stored::plain(name)]
            }
            (LayerKind::Block(b), p) => {
                let i = p - 1;
                let names: Vec<(String, bool)> = b
                    .param_tensors("")
                    .into_iter()
                    .map(|(name, _)| {
                        let name = name.trim_start_matches('.');
                        let conv1d = name.ends_with("c_attn.weight")
                            || name.ends_with("c_proj.weight")
                            || name.ends_with("c_fc.weight");
                        if gguf {
                            (gguf_gpt2_name(i, name), false)
                        } else {
                            (hf_gpt2(&format!("h.{i}.{name}")), conv1d)
                        }
                    })
                    .collect();
                names
                    .into_iter()
                    .map(|(name, transposed)| Stored {
                        name,
                        transposed,
                        interleaved_heads: None,
                    })
                    .collect()
            }
            (LayerKind::LlamaBlock(b), p) => {
                let i = p - 1;
                let interleaved = gguf && c.family == Family::Llama;
                b.param_tensors(&format!("model.layers.{i}"))
                    .into_iter()
                    .map(|(name, _)| {
                        let heads = if name.contains("q_proj") {
                            Some(b.heads)
                        } else if name.contains("k_proj") {
                            Some(b.kv_heads)
                        } else {
                            None
                        };
                        Stored {
                            name: if gguf { gguf_llama_name(&name) } else { name },
                            transposed: false,
                            interleaved_heads: heads.filter(|_| interleaved),
                        }
                    })
                    .collect()
            }
            _ => {
                return Err(self.model_error(format!(
                    "layer {position} ({}) is not a layer of a pretrained model",
                    layer.kind_name()
                )));
            }
        })
    }

    /// The file's shape of the tensor `stored` names (PyTorch's order), checked against the
    /// `shape` its layer wants and readable (a GGUF type ringtmp dequantises, a safetensors
    /// dtype it widens) — from the tensor table alone, no value read.
    pub(crate) fn checked_shape(
        &self,
        stored: &Stored,
        shape: &[usize],
    ) -> Result<Vec<usize>, PretrainedError> {
        let file_shape = match &self.source {
            Source::Gguf(g) => {
                let t = g.tensor(&stored.name)?;
                if !t.kind.dequantizes() {
                    return Err(GgufError::Unsupported {
                        path: self.path.clone(),
                        tensor: stored.name.clone(),
                        kind: t.kind.name(),
                    }
                    .into());
                }
                t.dims.iter().rev().map(|&d| d as usize).collect::<Vec<_>>()
            }
            Source::Hf(h) => {
                let t = h
                    .tensors
                    .get(&stored.name)
                    .ok_or_else(|| HfError::NoTensor {
                        dir: self.path.clone(),
                        name: stored.name.clone(),
                    })?;
                t.shape.clone()
            }
        };
        let mismatch = || PretrainedError::Shape {
            path: self.path.clone(),
            tensor: stored.name.clone(),
            family: self.config.family,
            want: shape.to_vec(),
            got: file_shape.clone(),
        };
        if stored.transposed {
            let [rows, cols] = shape[..] else {
                return Err(mismatch());
            };
            return if file_shape == [cols, rows] {
                Ok(file_shape)
            } else {
                Err(mismatch())
            };
        }
        // A position table may hold more positions than the window: its first rows.
        let prefix_ok = file_shape.len() == shape.len()
            && file_shape[1..] == shape[1..]
            && (stored.name.ends_with("wpe.weight") || stored.name == "position_embd.weight")
            && file_shape[0] >= shape[0];
        if file_shape != shape && !prefix_ok {
            return Err(mismatch());
        }
        Ok(file_shape)
    }

    /// Checks that the file holds every tensor of `layers` in the shape each wants, in a type
    /// ringtmp reads — the tensor table alone, before any node starts.
    pub fn check(&self, layers: &[Layer]) -> Result<(), PretrainedError> {
        for (position, layer) in layers.iter().enumerate() {
            let stored = self.stored(layers.len(), position, layer)?;
            for ((_, shape), stored) in layer.param_tensors().into_iter().zip(stored) {
                self.checked_shape(&stored, &shape)?;
            }
        }
        Ok(())
    }

    /// Reads one tensor of `shape` (PyTorch's order) into `out`, undoing the file's
    /// conventions. A learned position table longer than `shape` gives its first rows.
    pub(crate) fn read_into(
        &self,
        stored: &Stored,
        shape: &[usize],
        out: &mut [f32],
    ) -> Result<(), PretrainedError> {
        self.checked_shape(stored, shape)?;
        let values = match &self.source {
            Source::Gguf(g) => g.dequantize(&stored.name)?,
            Source::Hf(h) => h.tensor_f32(&stored.name)?,
        };
        if stored.transposed {
            let (rows, cols) = (shape[0], shape[1]);
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                for (k, v) in row.iter_mut().enumerate() {
                    *v = values[k * rows + r];
                }
            }
            return Ok(());
        }
        let len = out.len();
        out.copy_from_slice(&values[..len]);
        if let Some(heads) = stored.interleaved_heads {
            deinterleave(out, heads, shape[0]);
        }
        Ok(())
    }
}

/// GGUF's name of a GPT-2 block's tensor (`attn.c_attn.weight` of block `i` is
/// `blk.i.attn_qkv.weight`).
fn gguf_gpt2_name(i: usize, name: &str) -> String {
    let (base, kind) = name.rsplit_once('.').unwrap_or((name, ""));
    let piece = match base {
        "ln_1" => "attn_norm",
        "attn.c_attn" => "attn_qkv",
        "attn.c_proj" => "attn_output",
        "ln_2" => "ffn_norm",
        "mlp.c_fc" => "ffn_up",
        "mlp.c_proj" => "ffn_down",
        other => other,
    };
    format!("blk.{i}.{piece}.{kind}")
}

/// GGUF's name of a Llama-family block's tensor named as Hugging Face names it.
pub fn gguf_llama_name(name: &str) -> String {
    let rest = name.strip_prefix("model.layers.").unwrap_or(name);
    let (i, piece) = rest.split_once('.').unwrap_or(("0", rest));
    let (base, kind) = piece.rsplit_once('.').unwrap_or((piece, ""));
    let gguf = match base {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => other,
    };
    format!("blk.{i}.{gguf}.{kind}")
}

/// llama.cpp's permutation of a `q` or `k` projection of `rows` rows, as its converter writes
/// it: within each head, Hugging Face's row `s·d/2 + j` becomes row `2j + s` (`deinterleave`
/// undoes it).
pub fn interleave(values: &mut [f32], heads: usize, rows: usize) {
    permute_heads(values, heads, rows, true);
}

/// Undoes [`interleave`]: within each head, row `2j + s` goes back to row `s·d/2 + j`.
pub(crate) fn deinterleave(values: &mut [f32], heads: usize, rows: usize) {
    permute_heads(values, heads, rows, false);
}

fn permute_heads(values: &mut [f32], heads: usize, rows: usize, interleaving: bool) {
    let cols = values.len() / rows.max(1);
    let d = rows / heads.max(1);
    let half = d / 2;
    let mut head = vec![0.0f32; d * cols];
    for block in values.chunks_exact_mut(d * cols) {
        head.copy_from_slice(block);
        for j in 0..half {
            for s in 0..2 {
                let (hf, gguf) = (s * half + j, 2 * j + s);
                let (from, to) = if interleaving { (hf, gguf) } else { (gguf, hf) };
                block[to * cols..(to + 1) * cols]
                    .copy_from_slice(&head[from * cols..(from + 1) * cols]);
            }
        }
    }
}
