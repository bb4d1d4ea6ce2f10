//! A Hugging Face model directory as `transformers` saves one: `config.json` (the architecture
//! and its hyper-parameters) and the weights, in `model.safetensors` or in shards that
//! `model.safetensors.index.json` names tensor by tensor. Each shard is memory-mapped and only
//! its header is read on opening; a tensor's bytes are read when asked for
//! ([`HfModel::tensor_f32`]), so a node reading a few layers touches only their pages.
//!
//! Invariants: a shard the index names is a file of the directory (no path outside it); every
//! tensor the index names is in the shard it says, and no name is in two shards; the
//! safetensors headers are validated by the `safetensors` crate (lengths and offsets inside
//! the file) before any tensor is used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// What went wrong reading a model directory.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or mapped.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not what a model directory holds.
    #[error("{}: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// No tensor of that name.
    #[error("{}: no tensor {name:?}", dir.display())]
    NoTensor {
        /// The directory.
        dir: PathBuf,
        /// The name asked for.
        name: String,
    },
}

/// One tensor of the directory's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct HfTensor {
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape, outermost first (PyTorch's order).
    pub shape: Vec<usize>,
    /// The shard holding it (an index into [`HfModel::shards`]).
    pub shard: usize,
    /// Its bytes' range in the shard.
    range: std::ops::Range<usize>,
}

/// A Hugging Face model directory, its shards mapped.
pub struct HfModel {
    dir: PathBuf,
    /// `config.json`.
    pub config: serde_json::Value,
    /// The shards' paths, in the order tensors refer to them.
    pub shards: Vec<PathBuf>,
    maps: Vec<std::sync::Arc<memmap2::Mmap>>,
    /// Every tensor, by name.
    pub tensors: BTreeMap<String, HfTensor>,
}

fn read_json(path: &Path) -> Result<serde_json::Value, HfError> {
    let text = std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Malformed {
        path: path.to_path_buf(),
        what: format!("not JSON: {e}"),
    })
}

fn map(path: &Path) -> Result<memmap2::Mmap, HfError> {
    let io = |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: read only; a model directory is not written while a run reads it, and every
    // offset used is one the safetensors header gave and the crate checked against the length.
    unsafe { memmap2::Mmap::map(&file) }.map_err(io)
}

impl HfModel {
    /// Opens the model directory `dir`: its config and its weights' headers.
    pub fn open(dir: &Path) -> Result<Self, HfError> {
        let config = read_json(&dir.join("config.json"))?;
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (shards, named) = if index_path.is_file() {
            shards_of_index(dir, &index_path)?
        } else if single.is_file() {
            (vec![single], None)
        } else {
            return Err(HfError::Malformed {
                path: dir.to_path_buf(),
                what: "no model.safetensors or model.safetensors.index.json (a directory \
                       saved by transformers holds one)"
                    .into(),
            });
        };
        let mut maps = Vec::with_capacity(shards.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in shards.iter().enumerate() {
            let bytes = map(path)?;
            for (name, tensor) in shard_tensors(path, &bytes, i)? {
                if tensors.contains_key(&name) {
                    return Err(HfError::Malformed {
                        path: path.clone(),
                        what: format!("tensor {name:?} is in two shards"),
                    });
                }
                tensors.insert(name, tensor);
            }
            maps.push(std::sync::Arc::new(bytes));
        }
        if let Some(named) = named {
            check_index(&index_path, &named, &tensors, &shards)?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            shards,
            maps,
            tensors,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tensor named `name` as the file stores it: its element type and bytes.
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[u8]), HfError> {
        let tensor = self.tensors.get(name).ok_or_else(|| HfError::NoTensor {
            dir: self.dir.clone(),
            name: name.to_string(),
        })?;
        Ok((tensor.dtype, &self.maps[tensor.shard][tensor.range.clone()]))
    }

    /// The mapped shard holding the tensor named `name` and where its bytes start in it: for a
    /// tensor that reads its bytes where they lie.
    pub fn shared(
        &self,
        name: &str,
    ) -> Result<(ringtmp_model::packed::SharedBytes, usize), HfError> {
        let tensor = self.tensors.get(name).ok_or_else(|| HfError::NoTensor {
            dir: self.dir.clone(),
            name: name.to_string(),
        })?;
        Ok((self.maps[tensor.shard].clone(), tensor.range.start))
    }

    /// The tensor named `name`, in f32 (f16 and bf16 widened exactly).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, HfError> {
        let tensor = self.tensors.get(name).ok_or_else(|| HfError::NoTensor {
            dir: self.dir.clone(),
            name: name.to_string(),
        })?;
        let bytes = &self.maps[tensor.shard][tensor.range.clone()];
        Ok(match tensor.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(HfError::Malformed {
                    path: self.shards[tensor.shard].clone(),
                    what: format!("tensor {name:?} is {other:?}; weights are f32, f16 or bf16"),
                });
            }
        })
    }
}

/// An index's tensor name → shard file.
type WeightMap = BTreeMap<String, String>;

/// The shards an index names (each a file of `dir`), and its name → shard map.
fn shards_of_index(dir: &Path, index: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>), HfError> {
    let bad = |what: String| HfError::Malformed {
        path: index.to_path_buf(),
        what,
    };
    let json = read_json(index)?;
    let map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no weight_map".into()))?;
    let mut named = BTreeMap::new();
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("tensor {name:?}: its shard is not a file name")))?;
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|f| f == std::ffi::OsStr::new(file));
        if !plain || file.starts_with('.') {
            return Err(bad(format!(
                "tensor {name:?}: shard {file:?} is not a file of this directory"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
        named.insert(name.clone(), file.to_string());
    }
    files.sort();
    Ok((files.iter().map(|f| dir.join(f)).collect(), Some(named)))
}

/// The tensors of shard `i` (at `path`), its header checked by the safetensors crate.
fn shard_tensors(path: &Path, bytes: &[u8], i: usize) -> Result<Vec<(String, HfTensor)>, HfError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| HfError::Malformed {
        path: path.to_path_buf(),
        what: format!("not a safetensors file: {e}"),
    })?;
    let base = bytes.as_ptr() as usize;
    Ok(file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let start = view.data().as_ptr() as usize - base;
            let tensor = HfTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                shard: i,
                range: start..start + view.data().len(),
            };
            (name, tensor)
        })
        .collect())
}

/// Every tensor the index names is in the shard it names.
fn check_index(
    index: &Path,
    named: &WeightMap,
    tensors: &BTreeMap<String, HfTensor>,
    shards: &[PathBuf],
) -> Result<(), HfError> {
    for (name, file) in named {
        let found = tensors
            .get(name)
            .map(|t| shards[t.shard].file_name() == Some(std::ffi::OsStr::new(file)));
        if found != Some(true) {
            return Err(HfError::Malformed {
                path: index.to_path_buf(),
                what: format!("tensor {name:?} is not in {file}, where the index says it is"),
            });
        }
    }
    Ok(())
}

impl HfModel {
    /// The directory's vocabulary: `tokenizer.json`, the special tokens and chat template of
    /// `tokenizer_config.json` (or `chat_template.jinja`, where `transformers` now writes it),
    /// and the stop tokens of `generation_config.json` (else the EOS token).
    pub fn vocabulary(&self) -> Result<crate::vocabulary::Vocabulary, HfError> {
        let path = self.dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| HfError::Malformed {
                path: path.clone(),
                what: format!("not a tokenizer: {e}"),
            })?;
        let config_path = self.dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            serde_json::Value::Null
        };
        // A special token is written as its text or as an AddedToken object.
        let token = |key: &str| {
            let v = &config[key];
            v.as_str()
                .or_else(|| v["content"].as_str())
                .and_then(|t| tokenizer.token_to_id(t))
        };
        let template_file = self.dir.join("chat_template.jinja");
        let chat_template = if template_file.is_file() {
            Some(
                std::fs::read_to_string(&template_file).map_err(|source| HfError::Io {
                    path: template_file.clone(),
                    source,
                })?,
            )
        } else {
            match &config["chat_template"] {
                serde_json::Value::String(t) => Some(t.clone()),
                // Several named templates: the default one.
                serde_json::Value::Array(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_string),
                _ => None,
            }
        };
        let generation = self.dir.join("generation_config.json");
        let mut stop: Vec<u32> = if generation.is_file() {
            match &read_json(&generation)?["eos_token_id"] {
                serde_json::Value::Array(ids) => ids
                    .iter()
                    .filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                    .collect(),
                v => v
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .into_iter()
                    .collect(),
            }
        } else {
            Vec::new()
        };
        if stop.is_empty() {
            stop.extend(token("eos_token"));
        }
        Ok(crate::vocabulary::Vocabulary {
            bos: token("bos_token"),
            stop,
            // A tokenizer.json frames its sequences itself (its post-processor).
            add_bos: false,
            chat_template,
            tokenizer,
        })
    }
}
