//! The header, metadata and tensor table of a GGUF file, read from its bytes with every
//! length checked before it is used.

use std::collections::BTreeMap;
use std::path::Path;

use super::format::{GgufError, TensorInfo, Value};
use super::quants::TensorType;

/// `GGUF` as a little-endian `u32`.
const MAGIC: u32 = 0x4655_4747;
/// The data section's alignment unless `general.alignment` says otherwise.
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML's limit on a tensor's dimensions.
const MAX_DIMS: u32 = 4;
/// Nesting of arrays in arrays the reader follows (GGUF writers produce one level).
const MAX_ARRAY_DEPTH: usize = 2;

/// Which metadata [`parse`] keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keep {
    /// Every value.
    All,
    /// All but the tokenizer's arrays (`tokenizer.*`), whose lengths alone are kept: what a
    /// node that computes layers needs (SmolLM2's take 8 MB parsed, most of a node's heap).
    Weights,
}

/// What [`parse`] read.
pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) metadata: BTreeMap<String, Value>,
    /// The arrays skipped ([`Keep::Weights`]) and their lengths.
    pub(super) skipped: BTreeMap<String, usize>,
    pub(super) tensors: Vec<TensorInfo>,
}

/// A cursor over the file's bytes that never reads past them.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn error(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            offset: self.at as u64,
            what: what.into(),
        }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(self.error(format!(
                "{what} needs {n} bytes, {} are left (a truncated file?)",
                self.left()
            )));
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N, what)?;
        Ok(bytes.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items each at least `min_size` bytes: refused if the file cannot hold them.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, GgufError> {
        let start = self.at;
        let n = self.u64(what)?;
        let fits = usize::try_from(n).ok().filter(|n| {
            n.checked_mul(min_size.max(1))
                .is_some_and(|b| b <= self.left())
        });
        fits.ok_or_else(|| {
            self.at = start;
            self.error(format!(
                "{what} is {n}, more than the {} bytes left can hold",
                self.left()
            ))
        })
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(1, what)?;
        let start = self.at;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            self.at = start;
            self.error(format!("{what} is not UTF-8"))
        })
    }

    /// Steps over an array (its type already read) without keeping it; returns its length.
    fn skip_array(&mut self, key: &str) -> Result<usize, GgufError> {
        let inner = self.u32(key)?;
        let n = self.count(min_size(inner), key)?;
        match inner {
            8 => {
                for _ in 0..n {
                    let len = self.count(1, key)?;
                    self.take(len, key)?;
                }
            }
            9 => {
                for _ in 0..n {
                    self.value(inner, key, 1)?;
                }
            }
            fixed => {
                self.take(n * min_size(fixed), key)?;
            }
        }
        Ok(n)
    }

    /// A value of GGUF type `kind`.
    fn value(&mut self, kind: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::U8(u8::from_le_bytes(self.array(key)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(key)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(self.error(format!("{key}: bool of value {other}"))),
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.error(format!("{key}: arrays nested too deep")));
                }
                let inner = self.u32(key)?;
                let n = self.count(min_size(inner), key)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(inner, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.error(format!("{key}: unknown value type {other}"))),
        })
    }
}

/// The fewest bytes a value of GGUF type `kind` takes (a string or an array: its length).
fn min_size(kind: u32) -> usize {
    match kind {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        _ => 8,
    }
}

/// Reads a GGUF file's header, metadata and tensor table from `bytes` (the file at `path`).
pub(super) fn parse(bytes: &[u8], path: &Path, keep: Keep) -> Result<Parsed, GgufError> {
    let mut c = Cursor { bytes, at: 0, path };
    if c.u32("the magic")? != MAGIC {
        c.at = 0;
        return Err(c.error("not a GGUF file (the magic is not `GGUF`)"));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        c.at = 4;
        return Err(c.error(format!(
            "GGUF version {version}; ringtmp reads versions 2 and 3"
        )));
    }
    // A tensor's entry takes at least 8 (name) + 4 + 4 + 8 bytes; a key–value pair 8 + 4 + 1.
    let tensor_count = c.count(24, "the tensor count")?;
    let kv_count = c.count(13, "the metadata count")?;
    let (mut metadata, mut skipped) = (BTreeMap::new(), BTreeMap::new());
    for _ in 0..kv_count {
        let key = c.string("a metadata key")?;
        let kind = c.u32(&key)?;
        let twice = if keep == Keep::Weights && kind == 9 && key.starts_with("tokenizer.") {
            let len = c.skip_array(&key)?;
            metadata.contains_key(&key) || skipped.insert(key.clone(), len).is_some()
        } else {
            let value = c.value(kind, &key, 0)?;
            skipped.contains_key(&key) || metadata.insert(key.clone(), value).is_some()
        };
        if twice {
            return Err(c.error(format!("metadata key {key:?} given twice")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| c.error(format!("general.alignment {v:?} is not a power of two")))?,
    };
    let mut entries = Vec::with_capacity(tensor_count);
    for _ in 0..tensor_count {
        entries.push(tensor_entry(&mut c)?);
    }
    let data_start = (c.at as u64).next_multiple_of(alignment);
    let tensors = place_tensors(&c, entries, data_start, alignment)?;
    Ok(Parsed {
        version,
        metadata,
        skipped,
        tensors,
    })
}

/// One entry of the table: name, dimensions, type and offset (relative to the data section).
fn tensor_entry(c: &mut Cursor<'_>) -> Result<(String, Vec<u64>, u32, u64, u64), GgufError> {
    let at = c.at as u64;
    let name = c.string("a tensor name")?;
    let n_dims = c.u32(&name)?;
    if n_dims > MAX_DIMS {
        return Err(c.error(format!(
            "tensor {name:?} has {n_dims} dimensions (at most 4)"
        )));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(&name)?);
    }
    let kind = c.u32(&name)?;
    let offset = c.u64(&name)?;
    Ok((name, dims, kind, offset, at))
}

/// The table's entries with their data placed in the file: each inside it, aligned, of whole
/// blocks, names unique.
fn place_tensors(
    c: &Cursor<'_>,
    entries: Vec<(String, Vec<u64>, u32, u64, u64)>,
    data_start: u64,
    alignment: u64,
) -> Result<Vec<TensorInfo>, GgufError> {
    let file_len = c.bytes.len() as u64;
    let mut names = std::collections::BTreeSet::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, dims, kind_id, offset, at) in entries {
        let bad = |what: String| GgufError::Malformed {
            path: c.path.to_path_buf(),
            offset: at,
            what: format!("tensor {name:?}: {what}"),
        };
        if !names.insert(name.clone()) {
            return Err(bad("named twice".into()));
        }
        let kind = TensorType::from_id(kind_id);
        if let TensorType::Unknown(id) = kind {
            return Err(bad(format!("unknown tensor type {id}")));
        }
        let elements = dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d))
            .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
        let bytes = kind
            .bytes_for(dims.first().copied().unwrap_or(1), elements)
            .ok_or_else(|| {
                bad(format!(
                    "{elements} elements of {} in rows of {} are not whole blocks of {} (or \
                     more bytes than a file holds)",
                    kind.name(),
                    dims.first().copied().unwrap_or(1),
                    kind.block_elements()
                ))
            })?;
        let start = data_start
            .checked_add(offset)
            .filter(|s| offset % alignment == 0 && s.checked_add(bytes).is_some_and(|e| e <= file_len))
            .ok_or_else(|| {
                bad(format!(
                    "its {bytes} bytes at data offset {offset} are not inside the {file_len}-byte file, aligned to {alignment}"
                ))
            })?;
        tensors.push(TensorInfo {
            name,
            dims,
            kind,
            offset: start,
            bytes,
        });
    }
    Ok(tensors)
}
