//! Writing GGUF files (version 3): metadata, and tensors stored as F32, F16, BF16 or Q8_0 —
//! quantised as the `gguf` package quantises (ggml's reference rounding), so a file written here
//! reads back in that package, and in llama.cpp, with the values it would have written itself.
//!
//! Invariant: every tensor's data starts at a multiple of the alignment (32) from the data
//! section, which starts aligned after the table; the file appears whole or not at all
//! (written to a temporary name, then renamed).

use std::io::Write;
use std::path::Path;

use half::f16;
use ringtmp_model::packed::{bf16_bits, quantize_q8_0};

use super::quants::TensorType;
use super::{GgufError, Value};

/// The data section's alignment.
const ALIGNMENT: usize = 32;

/// A GGUF file being put together.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, TensorType, Vec<u8>)>,
}

/// `values` stored as `kind`: F32, F16 and BF16 rounded to nearest even, Q8_0 in blocks of 32
/// as ggml's reference quantises; `None` for another type.
pub fn quantize(kind: TensorType, values: &[f32]) -> Option<Vec<u8>> {
    Some(match kind {
        TensorType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TensorType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        TensorType::Bf16 => values.iter().flat_map(|v| bf16_bits(*v)).collect(),
        TensorType::Q8_0 if values.len().is_multiple_of(32) => {
            values.chunks_exact(32).flat_map(quantize_q8_0).collect()
        }
        _ => return None,
    })
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds metadata `key` (in the order given); an array must hold values of one type, and a
    /// key may be given once.
    pub fn metadata(&mut self, key: &str, value: Value) -> Result<(), GgufError> {
        let mixed = match &value {
            Value::Array(items) => items
                .iter()
                .any(|v| value_type(v) != value_type(&items[0]) || matches!(v, Value::Array(_))),
            _ => false,
        };
        if mixed || self.metadata.iter().any(|(k, _)| k == key) {
            return Err(GgufError::Malformed {
                path: std::path::PathBuf::from("(being written)"),
                offset: 0,
                what: format!(
                    "metadata {key:?}: given twice, or an array of mixed or nested types"
                ),
            });
        }
        self.metadata.push((key.to_string(), value));
        Ok(())
    }

    /// Adds tensor `name` of dimensions `dims` (GGUF's order: innermost first) from `values`,
    /// stored as `kind`.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        kind: TensorType,
        values: &[f32],
    ) -> Result<(), GgufError> {
        let elements: u64 = dims.iter().product();
        let refuse = |what: String| GgufError::Unsupported {
            path: std::path::PathBuf::from("(being written)"),
            tensor: name.to_string(),
            kind: what,
        };
        if elements != values.len() as u64 {
            return Err(refuse(format!(
                "{} for {} values of dimensions {dims:?}",
                kind.name(),
                values.len()
            )));
        }
        let bytes = quantize(kind, values)
            .filter(|_| {
                kind.bytes_for(dims.first().copied().unwrap_or(1), elements)
                    .is_some()
            })
            .ok_or_else(|| refuse(format!("{} (writing F32, F16, BF16 and Q8_0)", kind.name())))?;
        self.tensors
            .push((name.to_string(), dims.to_vec(), kind, bytes));
        Ok(())
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(0x4655_4747u32.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend(value_type(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, kind, bytes) in &self.tensors {
            put_string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(kind.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        }
        out
    }

    /// Writes the file to `path` (whole, or not at all).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("gguf.tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&self.to_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// GGUF's number for the type of `value`.
fn value_type(value: &Value) -> u32 {
    match value {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend(v.to_le_bytes()),
        Value::U16(v) => out.extend(v.to_le_bytes()),
        Value::I16(v) => out.extend(v.to_le_bytes()),
        Value::U32(v) => out.extend(v.to_le_bytes()),
        Value::I32(v) => out.extend(v.to_le_bytes()),
        Value::F32(v) => out.extend(v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            // An empty array's type is written as u8's; GGUF arrays hold one type.
            let inner = items.first().map_or(0, value_type);
            out.extend(inner.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(v) => out.extend(v.to_le_bytes()),
        Value::I64(v) => out.extend(v.to_le_bytes()),
        Value::F64(v) => out.extend(v.to_le_bytes()),
    }
}
