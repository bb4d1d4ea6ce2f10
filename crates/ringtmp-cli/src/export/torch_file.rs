//! Writing what `torch.save` writes, without PyTorch: a zip archive (entries stored, 64-byte
//! aligned as torch aligns them) holding `archive/data.pkl` — the object, pickled at protocol 2
//! — and each tensor's bytes as `archive/data/<key>`, plus `archive/version` and
//! `archive/byteorder`. Tensors are pickled as torch pickles them
//! (`torch._utils._rebuild_tensor_v2` over a persistent `('storage', torch.FloatStorage, key,
//! 'cpu', numel)`), so `torch.load` reads the file with `weights_only=True` (its default): only
//! the globals its safe unpickler allows appear.
//!
//! Also plain pickles of the same values (nanoGPT's `meta.pkl`).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// A Python value as pickled here.
#[derive(Clone, Debug, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// `collections.OrderedDict` (a state dict).
    OrderedDict(Vec<(Py, Py)>),
    /// A contiguous f32 CPU tensor of `shape`: `values` are written as its storage.
    Tensor {
        shape: Vec<usize>,
        values: Vec<f32>,
    },
    List(Vec<Py>),
}

impl Py {
    /// A string.
    pub fn str(s: impl Into<String>) -> Self {
        Self::Str(s.into())
    }
}

/// Pickle protocol 2 opcodes used here.
mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const BINUNICODE: u8 = b'X';
    pub const MARK: u8 = b'(';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_LIST: u8 = b']';
    pub const SETITEMS: u8 = b'u';
    pub const APPENDS: u8 = b'e';
    pub const GLOBAL: u8 = b'c';
    pub const REDUCE: u8 = b'R';
    pub const BINPERSID: u8 = b'Q';
}

/// A pickler; tensors' storages are collected, in order, as they are met (borrowed from the
/// value, so a model is not copied to be saved).
#[derive(Default)]
struct Pickler<'a> {
    out: Vec<u8>,
    storages: Vec<&'a [f32]>,
}

impl<'a> Pickler<'a> {
    fn global(&mut self, module: &str, name: &str) {
        self.out.push(op::GLOBAL);
        self.out
            .extend_from_slice(format!("{module}\n{name}\n").as_bytes());
    }

    fn tuple(&mut self, items: &'a [Py]) {
        if items.is_empty() {
            self.out.push(op::EMPTY_TUPLE);
            return;
        }
        self.out.push(op::MARK);
        for item in items {
            self.value(item);
        }
        self.out.push(op::TUPLE);
    }

    fn items(&mut self, pairs: &'a [(Py, Py)]) {
        if pairs.is_empty() {
            return;
        }
        self.out.push(op::MARK);
        for (k, v) in pairs {
            self.value(k);
            self.value(v);
        }
        self.out.push(op::SETITEMS);
    }

    fn value(&mut self, v: &'a Py) {
        match v {
            Py::None => self.out.push(op::NONE),
            Py::Bool(b) => self.out.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
            Py::Int(i) => self.int(*i),
            Py::Float(f) => {
                self.out.push(op::BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Py::Str(s) => self.string(s),
            Py::Tuple(items) => self.tuple(items),
            Py::List(items) => {
                self.out.push(op::EMPTY_LIST);
                if !items.is_empty() {
                    self.out.push(op::MARK);
                    for item in items {
                        self.value(item);
                    }
                    self.out.push(op::APPENDS);
                }
            }
            Py::Dict(pairs) => {
                self.out.push(op::EMPTY_DICT);
                self.items(pairs);
            }
            Py::OrderedDict(pairs) => {
                self.global("collections", "OrderedDict");
                self.out.push(op::EMPTY_TUPLE);
                self.out.push(op::REDUCE);
                self.items(pairs);
            }
            Py::Tensor { shape, values } => self.tensor(shape, values),
        }
    }

    fn int(&mut self, i: i64) {
        match i32::try_from(i) {
            Ok(small) => {
                self.out.push(op::BININT);
                self.out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                self.out.extend_from_slice(&[op::LONG1, 8]);
                self.out.extend_from_slice(&i.to_le_bytes());
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push(op::BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn int_tuple(&mut self, values: &[usize]) {
        if values.is_empty() {
            self.out.push(op::EMPTY_TUPLE);
            return;
        }
        self.out.push(op::MARK);
        for &v in values {
            self.int(v as i64);
        }
        self.out.push(op::TUPLE);
    }

    fn tensor(&mut self, shape: &[usize], values: &'a [f32]) {
        let key = self.storages.len().to_string();
        self.storages.push(values);
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.out.push(op::MARK);
        // The storage, as a persistent id the loader resolves to `data/<key>`.
        self.out.push(op::MARK);
        self.string("storage");
        self.global("torch", "FloatStorage");
        self.string(&key);
        self.string("cpu");
        self.int(values.len() as i64);
        self.out.push(op::TUPLE);
        self.out.push(op::BINPERSID);
        self.int(0);
        self.int_tuple(shape);
        let mut strides = vec![1usize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        self.int_tuple(&strides);
        self.out.push(op::NEWFALSE);
        // The backward hooks: an empty OrderedDict.
        self.global("collections", "OrderedDict");
        self.out.push(op::EMPTY_TUPLE);
        self.out.push(op::REDUCE);
        self.out.push(op::TUPLE);
        self.out.push(op::REDUCE);
    }

    fn finish(mut self, v: &'a Py) -> (Vec<u8>, Vec<&'a [f32]>) {
        self.out.extend_from_slice(&[op::PROTO, 2]);
        self.value(v);
        self.out.push(op::STOP);
        (self.out, self.storages)
    }
}

/// `value` pickled at protocol 2 (no tensors: a plain pickle file).
pub fn pickle(value: &Py) -> Vec<u8> {
    let (bytes, storages) = Pickler::default().finish(value);
    assert!(storages.is_empty(), "a plain pickle holds no tensors");
    bytes
}

/// Writes `value` to `path` as `torch.save(value, path)` would.
pub fn save(path: &Path, value: &Py) -> Result<()> {
    let (pickled, storages) = Pickler::default().finish(value);
    let bytes: u64 = storages.iter().map(|s| 4 * s.len() as u64).sum();
    let tmp = path.with_extension("pt.partial");
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut zip = zip::ZipWriter::new(std::io::BufWriter::new(file));
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64)
        .large_file(bytes + pickled.len() as u64 >= u32::MAX as u64);
    let mut entry = |name: &str, data: &[u8]| -> Result<()> {
        zip.start_file(format!("archive/{name}"), options)?;
        zip.write_all(data)?;
        Ok(())
    };
    entry("data.pkl", &pickled)?;
    entry("byteorder", b"little")?;
    for (key, values) in storages.iter().enumerate() {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        entry(&format!("data/{key}"), &data)?;
    }
    entry("version", b"3\n")?;
    let mut inner = zip.finish()?;
    inner.flush()?;
    drop(inner);
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_pickle_as_protocol_2_opcodes() {
        let bytes = pickle(&Py::Dict(vec![
            (Py::str("n"), Py::Int(3)),
            (Py::str("big"), Py::Int(1 << 40)),
            (Py::str("x"), Py::Float(1.5)),
            (Py::Int(0), Py::List(vec![Py::None, Py::Bool(true)])),
        ]));
        let mut want = vec![0x80, 2, b'}', b'('];
        want.extend_from_slice(b"X\x01\x00\x00\x00nJ\x03\x00\x00\x00");
        want.extend_from_slice(b"X\x03\x00\x00\x00big\x8a\x08");
        want.extend_from_slice(&(1i64 << 40).to_le_bytes());
        want.extend_from_slice(b"X\x01\x00\x00\x00xG");
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.extend_from_slice(b"J\x00\x00\x00\x00](N\x88eu.");
        assert_eq!(bytes, want);
    }

    #[test]
    fn a_saved_tensor_is_a_storage_entry_beside_its_pickle() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.pt");
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        save(
            &path,
            &Py::OrderedDict(vec![(
                Py::str("w"),
                Py::Tensor {
                    shape: vec![2, 3],
                    values: values.clone(),
                },
            )]),
        )
        .unwrap();
        let mut archive = zip::ZipArchive::new(std::fs::File::open(&path).unwrap()).unwrap();
        let names: Vec<String> = archive.file_names().map(str::to_string).collect();
        assert_eq!(
            names,
            [
                "archive/data.pkl",
                "archive/byteorder",
                "archive/data/0",
                "archive/version"
            ]
        );
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut archive.by_name("archive/data/0").unwrap(), &mut data)
            .unwrap();
        let back: Vec<f32> = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(back, values);
        let storage = archive.by_name("archive/data/0").unwrap();
        assert_eq!(
            storage.data_start().map(|s| s % 64),
            Some(0),
            "torch aligns storages to 64 bytes"
        );
    }
}
