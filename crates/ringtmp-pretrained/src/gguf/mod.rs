//! GGUF, llama.cpp's file of a model: a header, metadata (typed key–value pairs: the
//! architecture, its hyper-parameters, the tokenizer), a table of tensors (name, shape, type,
//! offset), and the tensors' data, aligned. [`Gguf::open`] maps the file and reads the header,
//! metadata and table; a tensor's bytes are read only when asked for ([`Gguf::dequantize`]),
//! so a node that needs a few layers of a large model touches only their pages.
//!
//! Invariants: every count and length is checked against the bytes left before anything is
//! allocated (a file cannot make the reader allocate more than the file's size); a tensor's
//! data lies inside the file; names are unique; dimensions are at most four and non-zero
//! products fit in `u64`.

mod format;
mod quants;
mod reader;
mod tokenizer;
mod tokenizer_out;
mod writer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use format::{GgufError, TensorInfo, Value};
pub use quants::TensorType;
pub use tokenizer_out::tokenizer_metadata;
pub use writer::{GgufWriter, quantize};

/// A GGUF file, mapped.
pub struct Gguf {
    path: PathBuf,
    map: std::sync::Arc<memmap2::Mmap>,
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// The tokenizer's arrays not read ([`Gguf::open_weights`]), and their lengths.
    skipped: BTreeMap<String, usize>,
    /// The tensors, in the file's order.
    pub tensors: Vec<TensorInfo>,
}

impl Gguf {
    /// Maps `path` and reads its header, metadata and tensor table.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        Self::open_keeping(path, reader::Keep::All)
    }

    /// [`Gguf::open`] without the tokenizer's arrays (their lengths kept): for a process that
    /// computes layers and never tokenizes (a node of a split model), whose heap they would
    /// otherwise be most of. [`Gguf::vocabulary`] refuses such a file.
    pub fn open_weights(path: &Path) -> Result<Self, GgufError> {
        Self::open_keeping(path, reader::Keep::Weights)
    }

    fn open_keeping(path: &Path, keep: reader::Keep) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read only; a model file is not written while a run reads it (a
        // file changed underneath would give wrong values, never memory unsafety beyond what
        // the kernel's mapping allows, and every offset is checked against the mapped length).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let parsed = reader::parse(&map, path, keep)?;
        Ok(Self {
            path: path.to_path_buf(),
            map: std::sync::Arc::new(map),
            version: parsed.version,
            metadata: parsed.metadata,
            skipped: parsed.skipped,
            tensors: parsed.tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The length of the array `key`, read or skipped.
    pub fn array_len(&self, key: &str) -> Option<usize> {
        match self.metadata.get(key) {
            Some(Value::Array(items)) => Some(items.len()),
            Some(_) => None,
            None => self.skipped.get(key).copied(),
        }
    }

    /// Whether the tokenizer's arrays were skipped ([`Gguf::open_weights`]).
    pub fn weights_only(&self) -> bool {
        !self.skipped.is_empty()
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::NoTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// The raw bytes of `tensor` (inside the file: checked when the table was read).
    pub fn raw(&self, tensor: &TensorInfo) -> &[u8] {
        let start = tensor.offset as usize;
        &self.map[start..start + tensor.bytes as usize]
    }

    /// The mapped file and where `tensor`'s bytes start in it: for a tensor that reads its
    /// bytes where they lie (the pages the kernel maps, never a copy).
    pub fn shared(&self, tensor: &TensorInfo) -> (ringtmp_model::packed::SharedBytes, usize) {
        (self.map.clone(), tensor.offset as usize)
    }

    /// The tensor named `name`, dequantised to f32 in the file's element order.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let tensor = self.tensor(name)?;
        if !tensor.kind.dequantizes() {
            return Err(GgufError::Unsupported {
                path: self.path.clone(),
                tensor: name.to_string(),
                kind: tensor.kind.name(),
            });
        }
        let mut out = vec![0.0; tensor.elements() as usize];
        quants::dequantize(tensor.kind, self.raw(tensor), &mut out);
        Ok(out)
    }
}
