//! A pretrained model's architecture, as its files state it: a Hugging Face `config.json` or a
//! GGUF file's metadata, read into one typed description — the family (Llama, Qwen 2 with its
//! q/k/v biases, Qwen 3 with its per-head q/k norms, GPT-2), the widths, heads (grouped-query
//! attention's key/value heads), the MLP, the vocabulary, the context, RoPE's base and scaling,
//! the norms' epsilon, and whether the head is tied to the embedding.
//!
//! Invariant: every field is stated by the file or is the default its family's reference
//! implementation (`transformers`) uses; a value the description cannot hold (zero heads, a
//! width the heads do not divide, an unknown family or RoPE scaling) is an error naming the
//! file and the key.

use std::path::{Path, PathBuf};

use crate::gguf::{Gguf, Value};

/// A description that is not a model ringtmp runs.
#[derive(Debug, thiserror::Error)]
#[error("{}: {what}", path.display())]
pub struct ConfigError {
    /// The file.
    pub path: PathBuf,
    /// What was wrong.
    pub what: String,
}

/// The architecture families ringtmp runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama (SmolLM2, Llama 3.2, TinyLlama, Mistral's layout): RMSNorm, RoPE, SwiGLU, GQA.
    Llama,
    /// Qwen 2 and 2.5: Llama's with biases on q, k and v.
    Qwen2,
    /// Qwen 3: Llama's with an RMSNorm of each head's q and k.
    Qwen3,
    /// GPT-2: LayerNorm, learned positions, tanh GELU, Conv1D projections.
    Gpt2,
}

/// RoPE's frequency scaling, as `rope_scaling` states it (the model crate's, which applies it).
pub use ringtmp_model::layers::rope::RopeScaling;

/// Where a tensor belongs in the chain of layers a model runs as (a ring cuts between them):
/// the embedding, a decoder block, or the head (the final norm and the projection to the
/// vocabulary); `Shared` for a table every block reads (Llama 3's `rope_freqs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChainLayer {
    /// The token (and GPT-2's position) embedding.
    Embedding,
    /// Decoder block `i`.
    Block(usize),
    /// The final norm and the head.
    Head,
    /// Read by every block.
    Shared,
}

/// The chain layer of a tensor named as Hugging Face (`model.layers.3.mlp.up_proj.weight`,
/// `transformer.h.3.attn.c_attn.weight`) or GGUF (`blk.3.ffn_up.weight`) names it; `None` for a
/// name of neither.
pub fn chain_layer(name: &str) -> Option<ChainLayer> {
    let name = name.strip_prefix("transformer.").unwrap_or(name);
    for prefix in ["model.layers.", "h.", "blk."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            let (index, _) = rest.split_once('.')?;
            return index.parse().ok().map(ChainLayer::Block);
        }
    }
    Some(match name {
        "model.embed_tokens.weight"
        | "wte.weight"
        | "wpe.weight"
        | "token_embd.weight"
        | "position_embd.weight" => ChainLayer::Embedding,
        "model.norm.weight" | "ln_f.weight" | "ln_f.bias" | "lm_head.weight"
        | "output_norm.weight" | "output_norm.bias" | "output.weight" => ChainLayer::Head,
        "rope_freqs.weight" => ChainLayer::Shared,
        _ => return None,
    })
}

/// A pretrained model's architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Its family.
    pub family: Family,
    /// Decoder blocks.
    pub layers: usize,
    /// The residual width.
    pub width: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads (`heads` without grouped-query attention).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// The MLP's hidden width.
    pub intermediate: usize,
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The longest context (positions).
    pub context: usize,
    /// RoPE's base (`rope_theta`; unused by GPT-2).
    pub rope_theta: f64,
    /// RoPE's scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// The norms' epsilon.
    pub norm_eps: f64,
    /// Whether the head is the embedding's transpose.
    pub tie_embeddings: bool,
}

impl ModelConfig {
    /// Parameters of one decoder block.
    pub fn block_parameters(&self) -> u64 {
        let (w, i) = (self.width as u64, self.intermediate as u64);
        let (q, kv) = (
            (self.heads * self.head_dim) as u64,
            (self.kv_heads * self.head_dim) as u64,
        );
        match self.family {
            // Two LayerNorms (weight, bias), c_attn and c_proj with biases, the MLP's two.
            Family::Gpt2 => 4 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * i + i) + (i * w + w),
            family => {
                let biases = if family == Family::Qwen2 {
                    q + 2 * kv
                } else {
                    0
                };
                let qk_norms = if family == Family::Qwen3 {
                    2 * self.head_dim as u64
                } else {
                    0
                };
                2 * w + w * q + 2 * w * kv + q * w + 3 * w * i + biases + qk_norms
            }
        }
    }

    /// Parameters in all (the head's counted once when tied).
    pub fn parameters(&self) -> u64 {
        let (w, v) = (self.width as u64, self.vocab as u64);
        let head = if self.tie_embeddings { 0 } else { v * w };
        let per_block = self.block_parameters();
        let extras = match self.family {
            // Learned positions and the final LayerNorm (weight, bias).
            Family::Gpt2 => self.context as u64 * w + 2 * w,
            _ => w,
        };
        v * w + self.layers as u64 * per_block + extras + head
    }

    /// Checks what every family needs of the numbers.
    fn checked(self, path: &Path) -> Result<Self, ConfigError> {
        let bad = |what: String| ConfigError {
            path: path.to_path_buf(),
            what,
        };
        for (name, v) in [
            ("layers", self.layers),
            ("width", self.width),
            ("heads", self.heads),
            ("key/value heads", self.kv_heads),
            ("head size", self.head_dim),
            ("MLP width", self.intermediate),
            ("vocabulary", self.vocab),
            ("context", self.context),
        ] {
            if v == 0 {
                return Err(bad(format!("{name} is 0")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} heads do not share {} key/value heads evenly",
                self.heads, self.kv_heads
            )));
        }
        if self.family == Family::Gpt2 && self.heads * self.head_dim != self.width {
            return Err(bad(format!(
                "{} heads do not divide the width {}",
                self.heads, self.width
            )));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps < 1.0) {
            return Err(bad(format!("norm epsilon {}", self.norm_eps)));
        }
        Ok(self)
    }

    /// The architecture `config.json` at `path` states.
    pub fn from_hf(path: &Path, config: &serde_json::Value) -> Result<Self, ConfigError> {
        let bad = |what: String| ConfigError {
            path: path.to_path_buf(),
            what,
        };
        let uint = |key: &str| -> Result<Option<usize>, ConfigError> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .map(Some)
                    .ok_or_else(|| bad(format!("{key} is {v}, not a count"))),
            }
        };
        let need = |key: &str| uint(key)?.ok_or_else(|| bad(format!("no {key}")));
        let float =
            |key: &str, default: f64| config.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad("no model_type".into()))?;
        let tie = config.get("tie_word_embeddings").and_then(|v| v.as_bool());
        let out = if model_type == "gpt2" {
            let width = need("n_embd")?;
            let heads = need("n_head")?;
            Self {
                family: Family::Gpt2,
                layers: need("n_layer")?,
                width,
                heads,
                kv_heads: heads,
                head_dim: width / heads.max(1),
                intermediate: uint("n_inner")?.unwrap_or(4 * width),
                vocab: need("vocab_size")?,
                context: need("n_positions")?,
                rope_theta: 0.0,
                rope_scaling: None,
                norm_eps: float("layer_norm_epsilon", 1e-5),
                tie_embeddings: tie.unwrap_or(true),
            }
        } else {
            let family = match model_type {
                "llama" | "mistral" => Family::Llama,
                "qwen2" => Family::Qwen2,
                "qwen3" => Family::Qwen3,
                other => {
                    return Err(bad(format!(
                        "model_type {other:?}: ringtmp runs llama, mistral, qwen2, qwen3 and gpt2"
                    )));
                }
            };
            let width = need("hidden_size")?;
            let heads = need("num_attention_heads")?;
            // transformers 5 writes RoPE's base and scaling as one `rope_parameters` object.
            let rope = config.get("rope_parameters").filter(|v| !v.is_null());
            Self {
                family,
                layers: need("num_hidden_layers")?,
                width,
                heads,
                kv_heads: uint("num_key_value_heads")?.unwrap_or(heads),
                head_dim: uint("head_dim")?.unwrap_or(width / heads.max(1)),
                intermediate: need("intermediate_size")?,
                vocab: need("vocab_size")?,
                context: uint("max_position_embeddings")?.unwrap_or(2048),
                rope_theta: rope
                    .and_then(|r| r.get("rope_theta"))
                    .and_then(serde_json::Value::as_f64)
                    .unwrap_or_else(|| float("rope_theta", 10_000.0)),
                rope_scaling: rope_scaling(
                    config.get("rope_scaling").filter(|v| !v.is_null()).or(rope),
                    path,
                )?,
                norm_eps: float("rms_norm_eps", 1e-6),
                tie_embeddings: tie.unwrap_or(false),
            }
        };
        out.checked(path)
    }

    /// The architecture a GGUF file's metadata states (the head is tied when the file has no
    /// `output.weight`).
    pub fn from_gguf(file: &Gguf) -> Result<Self, ConfigError> {
        let path = file.path();
        let bad = |what: String| ConfigError {
            path: path.to_path_buf(),
            what,
        };
        let arch = file
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no general.architecture".into()))?;
        let family = match arch {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gpt2" => Family::Gpt2,
            other => {
                return Err(bad(format!(
                    "architecture {other:?}: ringtmp runs llama, qwen2, qwen3 and gpt2"
                )));
            }
        };
        let uint = |key: &str| {
            file.get(&format!("{arch}.{key}"))
                .and_then(Value::as_u64)
                .and_then(|v| usize::try_from(v).ok())
        };
        let need = |key: &str| uint(key).ok_or_else(|| bad(format!("no {arch}.{key}")));
        let float = |key: &str| file.get(&format!("{arch}.{key}")).and_then(Value::as_f64);
        let width = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let vocab = match uint("vocab_size") {
            Some(v) => v,
            None => file
                .array_len("tokenizer.ggml.tokens")
                .ok_or_else(|| bad(format!("no {arch}.vocab_size or tokenizer.ggml.tokens")))?,
        };
        let scaling = match file
            .get(&format!("{arch}.rope.scaling.type"))
            .and_then(Value::as_str)
        {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: float("rope.scaling.factor").unwrap_or(1.0),
            }),
            Some(other) => {
                return Err(bad(format!("RoPE scaling {other:?}: ringtmp reads linear")));
            }
        };
        // Llama 3's scaling, as llama.cpp's converter keeps it: a table of factors.
        let scaling = match (scaling, file.tensor("rope_freqs.weight")) {
            (None, Ok(_)) => Some(RopeScaling::Factors {
                factors: file
                    .dequantize("rope_freqs.weight")
                    .map_err(|e| bad(e.to_string()))?
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            }),
            (scaling, _) => scaling,
        };
        let norm_key = if family == Family::Gpt2 {
            "attention.layer_norm_epsilon"
        } else {
            "attention.layer_norm_rms_epsilon"
        };
        Self {
            family,
            layers: need("block_count")?,
            width,
            heads,
            kv_heads: uint("attention.head_count_kv").unwrap_or(heads),
            head_dim: uint("attention.key_length").unwrap_or(width / heads.max(1)),
            intermediate: need("feed_forward_length")?,
            vocab,
            context: need("context_length")?,
            rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling: scaling,
            norm_eps: float(norm_key).unwrap_or(1e-5),
            tie_embeddings: file.tensor("output.weight").is_err(),
        }
        .checked(path)
    }
}

/// `rope_scaling` of a `config.json`: `linear` or `llama3` (or none).
fn rope_scaling(
    value: Option<&serde_json::Value>,
    path: &Path,
) -> Result<Option<RopeScaling>, ConfigError> {
    let Some(v) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |what: String| ConfigError {
        path: path.to_path_buf(),
        what,
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|k| k.as_str())
        .ok_or_else(|| bad("rope_scaling without rope_type".into()))?;
    let number = |key: &str| {
        v.get(key)
            .and_then(serde_json::Value::as_f64)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| bad(format!("rope_scaling {kind}: no positive {key}")))
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: number("factor")?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")?,
        })),
        other => Err(bad(format!(
            "rope_scaling {other:?}: ringtmp reads linear and llama3"
        ))),
    }
}
