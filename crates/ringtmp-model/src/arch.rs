//! A transformer's shape in the numbers other frameworks write it with — nanoGPT's
//! `model_args`, Hugging Face's `config.json`: blocks, attention heads, width, context, MLP
//! ratio and vocabulary.
//!
//! Most of these show in the shapes of the weights, but not the head count: a 4-head model's
//! tensors fit a 2-head model of the same width exactly, and load into it as a different,
//! worse model. So the head count (and with it the rest) travels beside the weights — in a
//! ringtmp checkpoint's model description, in the metadata of the safetensors file an export
//! writes (nanoGPT's key names), or in a `config.json` beside a file from elsewhere — and
//! `--init-from` compares what the file states with the model it loads into.
//!
//! Invariant: [`Architecture::of`] of a model, written by [`Architecture::to_metadata`] and
//! read back by [`Architecture::from_keys`], is the same architecture.

use std::path::Path;

use crate::error::{Error, Result};
use crate::spec::{LayerSpec, ModelSpec};

/// Largest safetensors header or `config.json` read to learn an architecture (the format's own
/// header limit is 100 MB; a config is a few kB).
const MAX_DESCRIPTION_BYTES: u64 = 100 << 20;

/// A transformer's hyper-parameters; `None` where unknown (a file that does not state it, or
/// blocks that disagree).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Architecture {
    /// Transformer blocks.
    pub blocks: Option<usize>,
    /// Attention heads per block.
    pub heads: Option<usize>,
    /// Values per position (the embedding's width).
    pub width: Option<usize>,
    /// Positions per window (the position embedding's rows).
    pub context: Option<usize>,
    /// The MLP's hidden width over the block's.
    pub mlp_ratio: Option<usize>,
    /// Token ids.
    pub vocab: Option<usize>,
}

/// The one value every item gives, or `None` when they disagree or there are none.
fn common(mut values: impl Iterator<Item = usize>) -> Option<usize> {
    let first = values.next()?;
    values.all(|v| v == first).then_some(first)
}

impl Architecture {
    /// The architecture of `spec` at `context` positions per window; `None` for a model without
    /// attention (its weights' shapes say all there is to say).
    pub fn of(spec: &ModelSpec, context: Option<usize>) -> Option<Self> {
        let heads = spec.layers.iter().filter_map(|l| match l {
            LayerSpec::Block { heads, .. } | LayerSpec::CausalSelfAttention { heads } => {
                Some(*heads)
            }
            _ => None,
        });
        // A model without attention: nothing beyond its weights' shapes to state.
        heads.clone().next()?;
        let blocks = spec
            .layers
            .iter()
            .filter(|l| matches!(l, LayerSpec::Block { .. }))
            .count();
        let ratios = spec.layers.iter().filter_map(|l| match l {
            LayerSpec::Block { mlp_ratio, .. } => Some(*mlp_ratio),
            _ => None,
        });
        let embedding = spec.layers.iter().find_map(|l| match l {
            LayerSpec::Embedding { vocab, width, .. } => Some((*vocab, *width)),
            _ => None,
        });
        Some(Self {
            blocks: (blocks > 0).then_some(blocks),
            heads: common(heads),
            width: embedding.map(|e| e.1),
            context,
            mlp_ratio: common(ratios),
            vocab: embedding.map(|e| e.0),
        })
    }

    /// The known fields under nanoGPT's `model_args` names (and `mlp_ratio`).
    pub fn named(&self) -> Vec<(&'static str, usize)> {
        [
            ("n_layer", self.blocks),
            ("n_head", self.heads),
            ("n_embd", self.width),
            ("block_size", self.context),
            ("mlp_ratio", self.mlp_ratio),
            ("vocab_size", self.vocab),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
    }

    /// [`Self::named`] as strings, for a safetensors file's metadata.
    pub fn to_metadata(&self) -> Vec<(&'static str, String)> {
        self.named()
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect()
    }

    /// The architecture a description states through `get` (a key's whole-number value): under
    /// nanoGPT's names, Hugging Face GPT-2's (`n_positions`, `n_ctx`, `n_inner`) or its Llama
    /// family's (`num_hidden_layers`, `num_attention_heads`, `hidden_size`,
    /// `max_position_embeddings`, `intermediate_size`).
    pub fn from_keys(get: impl Fn(&str) -> Option<usize>) -> Self {
        let first = |keys: &[&str]| keys.iter().find_map(|k| get(k));
        let width = first(&["n_embd", "hidden_size", "d_model"]);
        let hidden = first(&["n_inner", "intermediate_size"]);
        Self {
            blocks: first(&["n_layer", "num_hidden_layers"]),
            heads: first(&["n_head", "num_attention_heads"]),
            width,
            context: first(&[
                "block_size",
                "n_positions",
                "n_ctx",
                "max_position_embeddings",
            ]),
            mlp_ratio: get("mlp_ratio").or_else(|| match (hidden, width) {
                (Some(h), Some(w)) if w > 0 && h % w == 0 => Some(h / w),
                _ => None,
            }),
            vocab: get("vocab_size"),
        }
    }

    /// Whether nothing is known.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Each field both state and disagree on, as `(field, this one's value, model's value)`.
    pub fn differences(&self, model: &Self) -> Vec<(&'static str, usize, usize)> {
        self.fields()
            .into_iter()
            .zip(model.fields())
            .filter_map(|((name, a), (_, b))| match (a, b) {
                (Some(a), Some(b)) if a != b => Some((name, a, b)),
                _ => None,
            })
            .collect()
    }

    fn fields(&self) -> [(&'static str, Option<usize>); 6] {
        [
            ("blocks", self.blocks),
            ("heads", self.heads),
            ("width", self.width),
            ("context", self.context),
            ("MLP ratio", self.mlp_ratio),
            ("vocabulary", self.vocab),
        ]
    }

    /// One line: `2 blocks, 2 heads, width 64, context 32, MLP ratio 4, vocabulary 65` (the
    /// known fields only).
    pub fn describe(&self) -> String {
        self.fields()
            .into_iter()
            .filter_map(|(name, v)| {
                v.map(|v| match name {
                    "blocks" | "heads" => format!("{v} {name}"),
                    _ => format!("{name} {v}"),
                })
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a weights file says of the architecture it was trained as, and where it says it: the
/// file's own safetensors metadata (as `ringtmp export` writes it), else a `config.json` beside
/// it (nanoGPT's `model_args` or a Hugging Face config). `None` when neither states anything.
pub fn stated_by(weights: &Path) -> Result<Option<(Architecture, String)>> {
    let metadata = safetensors_metadata(weights)?;
    let arch = Architecture::from_keys(|k| metadata.get(k).and_then(|v| v.trim().parse().ok()));
    if !arch.is_empty() {
        return Ok(Some((arch, "its metadata".into())));
    }
    let config = weights.with_file_name("config.json");
    if !config.is_file() {
        return Ok(None);
    }
    let text = read_bounded(&config, MAX_DESCRIPTION_BYTES)?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| Error::CheckpointMismatch {
            path: config.clone(),
            reason: format!("not JSON: {e}"),
        })?;
    let arch = Architecture::from_keys(|k| {
        value
            .get(k)
            .and_then(serde_json::Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
    });
    Ok((!arch.is_empty()).then(|| (arch, format!("{} beside it", config.display()))))
}

fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(Error::CheckpointMismatch {
            path: path.to_path_buf(),
            reason: format!("larger than the {limit} bytes a description may take"),
        });
    }
    Ok(bytes)
}

/// The `__metadata__` strings of a safetensors file, reading its header only.
pub fn safetensors_metadata(path: &Path) -> Result<std::collections::HashMap<String, String>> {
    use std::io::Read;
    let bad = |reason: String| Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let len = u64::from_le_bytes(len);
    let size = file.metadata().map_err(io)?.len();
    if len > MAX_DESCRIPTION_BYTES || len > size.saturating_sub(8) {
        return Err(bad(format!(
            "its header claims {len} bytes of a {size}-byte file"
        )));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("its header is not JSON: {e}")))?;
    Ok(header
        .get("__metadata__")
        .and_then(serde_json::Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_architecture_written_as_metadata_reads_back_the_same() {
        let spec = ModelSpec::preset("gpt-cpu", 65).unwrap();
        let arch = Architecture::of(&spec, Some(64)).unwrap();
        assert_eq!(
            arch.describe(),
            "4 blocks, 4 heads, width 128, context 64, MLP ratio 4, vocabulary 65"
        );
        let meta: std::collections::HashMap<_, _> = arch.to_metadata().into_iter().collect();
        let back = Architecture::from_keys(|k| meta.get(k).and_then(|v| v.parse().ok()));
        assert_eq!(back, arch);
    }

    #[test]
    fn models_without_attention_have_no_architecture_to_state() {
        assert_eq!(
            Architecture::of(&ModelSpec::preset("mlp", 10).unwrap(), None),
            None
        );
    }

    #[test]
    fn hugging_face_configs_name_the_same_numbers_otherwise() {
        let gpt2 = serde_json::json!({"n_layer": 12, "n_head": 12, "n_embd": 768,
            "n_positions": 1024, "n_inner": null, "vocab_size": 50257});
        let llama = serde_json::json!({"num_hidden_layers": 30, "num_attention_heads": 9,
            "hidden_size": 576, "max_position_embeddings": 8192, "intermediate_size": 1536});
        let read = |v: &serde_json::Value| {
            Architecture::from_keys(|k| {
                v.get(k)
                    .and_then(serde_json::Value::as_u64)
                    .map(|n| n as usize)
            })
        };
        let g = read(&gpt2);
        assert_eq!(
            (g.blocks, g.heads, g.context, g.mlp_ratio),
            (Some(12), Some(12), Some(1024), None)
        );
        let l = read(&llama);
        // 1536 / 576 is not whole: the ratio stays unknown rather than rounded.
        assert_eq!(
            (l.blocks, l.heads, l.width, l.mlp_ratio),
            (Some(30), Some(9), Some(576), None)
        );
    }

    #[test]
    fn differences_name_only_what_both_state() {
        let model =
            Architecture::of(&ModelSpec::preset("gpt-nano", 65).unwrap(), Some(32)).unwrap();
        let file = Architecture {
            heads: Some(4),
            context: Some(32),
            ..Default::default()
        };
        assert_eq!(file.differences(&model), vec![("heads", 4, 2)]);
    }

    #[test]
    fn a_header_that_claims_more_than_the_file_is_refused_before_reading_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("w.safetensors");
        let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&path, bytes).unwrap();
        let err = safetensors_metadata(&path).unwrap_err().to_string();
        assert!(err.contains("header claims"), "{err}");
    }
}
