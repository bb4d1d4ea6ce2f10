//! NumPy inputs: `--data-file X.npy --label-file Y.npy` (then an optional test pair), or one
//! `.npz` holding `x_train`, `y_train`, `x_test`, `y_test` (Keras's layout) or `x`, `y`.
//!
//! `.npy` inputs of uint8, float16 or float32 are memory-mapped: a batch reads its rows from the
//! page cache, so an array larger than memory streams. float64 inputs (NumPy's default) are
//! converted to float32 in memory. Integer labels classify; float labels are regression targets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::description::{DataSource, Loaded, class_indices, dir_of};
use crate::error::{Error, Result};
use crate::npy::{self, Header, Kind};
use crate::recipe::Layout;
use crate::rows::{Dtype, Labels, RowData};

/// An array's bytes: mapped from an `.npy` file, or an `.npz` member read into memory.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

struct Array {
    path: PathBuf,
    header: Header,
    bytes: Bytes,
}

fn open(path: &Path) -> Result<Array> {
    let (header, map) = npy::map(path)?;
    Ok(Array {
        path: path.to_path_buf(),
        header,
        bytes: Bytes::Mapped(map),
    })
}

fn member(path: &Path, name: &str, bytes: Vec<u8>) -> Result<Array> {
    let member = npy::member_path(path, name);
    let header = npy::parse_header(&member, &bytes)?;
    Ok(Array {
        path: member,
        header,
        bytes: Bytes::Owned(bytes),
    })
}

pub(crate) fn load(source: &DataSource) -> Result<Loaded> {
    let pairs: Vec<(Array, Array)> = if source.format == "npz" {
        if source.files.len() != 1 {
            return Err(source.error("one .npz file holds both splits"));
        }
        npz_pairs(source, &source.files[0])?
    } else {
        if source.label_files.len() != source.files.len() {
            return Err(source.error(format!(
                "{} input arrays but {} label arrays: name one --label-file per --data-file",
                source.files.len(),
                source.label_files.len()
            )));
        }
        source
            .files
            .iter()
            .zip(&source.label_files)
            .map(|(x, y)| Ok((open(x)?, open(y)?)))
            .collect::<Result<_>>()?
    };
    let (shape, layout, channels) = input_shape(source, &pairs[0].0)?;
    let mut splits = Vec::new();
    for (x, y) in pairs {
        splits.push(Arc::new(rows(source, x, y, shape, layout)?));
    }
    let scale = if splits[0].dtype == Dtype::U8 {
        1.0 / 255.0
    } else {
        1.0
    };
    let targets = match &splits[0].labels {
        Labels::Targets { width, .. } => (0..*width).map(|i| format!("target{i}")).collect(),
        Labels::Classes(_) => Vec::new(),
    };
    let mut splits = splits.into_iter();
    Ok(Loaded {
        train: splits.next().expect("a training split"),
        test: splits.next(),
        shape,
        layout,
        scale,
        channels,
        columns: Vec::new(),
        label: None,
        targets,
        class_names: Vec::new(),
        dir: dir_of(&source.files[0]),
    })
}

fn npz_pairs(source: &DataSource, path: &Path) -> Result<Vec<(Array, Array)>> {
    npz_pairs_within(source, path, crate::text::available_memory())
}

/// [`npz_pairs`] with `memory` bytes available: the members' headers say what they hold, so
/// a label count that does not match its inputs', or arrays larger than the memory there is,
/// are refused before anything is decompressed.
fn npz_pairs_within(
    source: &DataSource,
    path: &Path,
    memory: Option<u64>,
) -> Result<Vec<(Array, Array)>> {
    let mut npz = npy::Npz::open(path)?;
    let has = |name: &str| npz.header(name).is_some();
    let names: Vec<(&str, &str)> = if has("x_train") && has("y_train") {
        let mut names = vec![("x_train", "y_train")];
        if has("x_test") && has("y_test") {
            names.push(("x_test", "y_test"));
        }
        names
    } else if has("x") && has("y") {
        vec![("x", "y")]
    } else {
        let held: Vec<&String> = npz.members.iter().map(|(n, ..)| n).collect();
        return Err(source.error(format!(
            "{}: holds {held:?}; ringtmp reads x_train, y_train (and x_test, y_test), or x and y",
            path.display()
        )));
    };
    let mut total = 0u64;
    for (x, y) in &names {
        let (xh, yh) = (npz.header(x).expect("held"), npz.header(y).expect("held"));
        let rows = xh.shape.first().copied().unwrap_or(0);
        if yh.shape.first() != Some(&rows) {
            return Err(Error::Format {
                path: npy::member_path(path, y),
                offset: 0,
                reason: format!(
                    "shape {:?}: labels for {rows} input rows (its header and {x}'s say so; \
                     nothing was decompressed)",
                    yh.shape
                ),
            });
        }
        for name in [x, y] {
            total += npz
                .members
                .iter()
                .find(|(n, ..)| n == name)
                .map_or(0, |m| m.3 as u64);
        }
    }
    if let Some(memory) = memory
        && total > memory
    {
        return Err(source.error(format!(
            "{}: its arrays decompress to {} MiB, more than the {} MiB of memory this machine \
             has available (their headers say so; nothing was decompressed): save them as \
             .npy files, which are memory-mapped",
            path.display(),
            total >> 20,
            memory >> 20
        )));
    }
    let mut pairs = Vec::new();
    for (x, y) in names {
        let (xb, yb) = (npz.read(x)?, npz.read(y)?);
        pairs.push((member(path, x, xb)?, member(path, y, yb)?));
    }
    Ok(pairs)
}

/// The model's input shape, the stored layout and the normalisation channels, from the first
/// input array and the description.
fn input_shape(source: &DataSource, x: &Array) -> Result<((usize, usize, usize), Layout, usize)> {
    let dims = &x.header.shape;
    let bad = |reason: String| Error::Format {
        path: x.path.clone(),
        offset: 0,
        reason,
    };
    if dims.len() < 2 {
        return Err(bad(format!(
            "shape {dims:?}: inputs are [rows, features…] (reshape a vector with a[:, None])"
        )));
    }
    let per_row: usize = dims[1..].iter().product();
    let float = x.header.kind.is_float();
    let (shape, layout) = match (dims.len(), source.input_shape) {
        (_, Some(declared)) => {
            let (h, w, c) = declared;
            if h * w * c != per_row {
                return Err(bad(format!(
                    "shape {dims:?} holds {per_row} values per row; the declared input \
                     {h}×{w}×{c} needs {}",
                    h * w * c
                )));
            }
            let layout = source.layout.unwrap_or(if dims.len() == 4 && dims[1] == c {
                Layout::Nchw
            } else {
                Layout::Nhwc
            });
            (declared, layout)
        }
        (2, None) => ((1, 1, dims[1]), Layout::Nhwc),
        (3, None) => ((dims[1], dims[2], 1), Layout::Nhwc),
        (4, None) => {
            let channel_like = |d: usize| matches!(d, 1 | 3 | 4);
            let layout = match source.layout {
                Some(l) => l,
                None if channel_like(dims[3]) => Layout::Nhwc,
                None if channel_like(dims[1]) => Layout::Nchw,
                None => {
                    return Err(bad(format!(
                        "shape {dims:?}: which axis holds the channels? say --layout nchw or nhwc"
                    )));
                }
            };
            match layout {
                Layout::Nhwc => ((dims[1], dims[2], dims[3]), layout),
                Layout::Nchw => ((dims[2], dims[3], dims[1]), layout),
            }
        }
        (_, None) => {
            return Err(bad(format!(
                "shape {dims:?}: ringtmp reads [rows, features], [rows, H, W] or 4-D images"
            )));
        }
    };
    // A float table standardises each column; an image (or bytes) each channel.
    let channels = if shape.0 * shape.1 == 1 && !float {
        1
    } else {
        shape.2
    };
    Ok((shape, layout, channels))
}

/// The rows of input array `x` labelled by `y`.
fn rows(
    source: &DataSource,
    x: Array,
    y: Array,
    shape: (usize, usize, usize),
    layout: Layout,
) -> Result<RowData> {
    let n = x.header.shape[0];
    let features = shape.0 * shape.1 * shape.2;
    if x.header.shape[1..].iter().product::<usize>() != features {
        return Err(Error::Format {
            path: x.path.clone(),
            offset: 0,
            reason: format!(
                "shape {:?}: the first input array has {features} values per row",
                x.header.shape
            ),
        });
    }
    let labels = labels(source, &y, n)?;
    let order = (layout == Layout::Nchw).then(|| {
        let (h, w, c) = shape;
        let mut order = Vec::with_capacity(features);
        for i in 0..h * w {
            for ch in 0..c {
                order.push((ch * h * w + i) as u32);
            }
        }
        order
    });
    let data_range = x.header.data_offset..x.header.data_offset + x.header.data_bytes();
    if let Some(at) = first_non_finite(&x.bytes.as_slice()[data_range.clone()], &x.header.kind) {
        // A NaN would make the normalisation's mean NaN and the run learn nothing.
        return Err(Error::Table {
            path: x.path.clone(),
            row: (at / features.max(1)) as u64 + 1,
            column: format!(", value {}", at % features.max(1)),
            reason: "input is not a finite number (NaN or infinity): clean the array first".into(),
        });
    }
    let dtype = match x.header.kind {
        Kind::U8 => Dtype::U8,
        Kind::F16 => Dtype::F16,
        Kind::F32 => Dtype::F32,
        Kind::F64 => {
            // Converted once, in the model's order.
            let values = npy::values_f64(&x.header, x.bytes.as_slice());
            let mut bytes = Vec::with_capacity(values.len() * 4);
            for row in values.chunks_exact(features.max(1)) {
                match &order {
                    None => row
                        .iter()
                        .for_each(|&v| bytes.extend((v as f32).to_le_bytes())),
                    Some(order) => order
                        .iter()
                        .for_each(|&k| bytes.extend((row[k as usize] as f32).to_le_bytes())),
                }
            }
            return Ok(RowData::owned(bytes, Dtype::F32, features, labels));
        }
        Kind::Int { .. } => {
            return Err(Error::Format {
                path: x.path.clone(),
                offset: 0,
                reason: format!(
                    "dtype {}: inputs are uint8, float16, float32 or float64 (a.astype('<f4'))",
                    x.header.descr
                ),
            });
        }
    };
    Ok(match x.bytes {
        Bytes::Mapped(map) => RowData::mapped(map, data_range, dtype, features, order, labels),
        Bytes::Owned(bytes) => {
            let mut data = RowData::owned(bytes[data_range].to_vec(), dtype, features, labels);
            data.order = order;
            data
        }
    })
}

/// The index of the first value of a float array's little-endian `bytes` that is NaN or
/// infinite (its exponent bits all set); `None` for integer arrays.
fn first_non_finite(bytes: &[u8], kind: &Kind) -> Option<usize> {
    match kind {
        Kind::F16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        Kind::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        Kind::F64 => bytes.chunks_exact(8).position(|b| {
            let bits = u64::from_le_bytes(b.try_into().expect("8 bytes"));
            bits & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        Kind::U8 | Kind::Int { .. } => None,
    }
}

fn labels(source: &DataSource, y: &Array, rows: usize) -> Result<Labels> {
    let dims = &y.header.shape;
    if dims.first() != Some(&rows) {
        return Err(Error::Format {
            path: y.path.clone(),
            offset: 0,
            reason: format!("shape {dims:?}: labels for {rows} input rows"),
        });
    }
    let width: usize = dims[1..].iter().product();
    let values = npy::values_f64(&y.header, y.bytes.as_slice());
    if y.header.kind.is_float() {
        if let Some(row) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::Table {
                path: y.path.clone(),
                row: (row / width.max(1)) as u64 + 1,
                column: String::new(),
                reason: "target is not a finite number".into(),
            });
        }
        return Ok(Labels::Targets {
            values: values.iter().map(|&v| v as f32).collect(),
            width,
        });
    }
    if width != 1 {
        return Err(source.error(format!(
            "{}: integer labels of shape {dims:?}: one class per row (float arrays are regression \
             targets)",
            y.path.display()
        )));
    }
    Ok(Labels::Classes(class_indices(&y.path, &values)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// An `.npz` of `members` (name, bytes), deflated as `np.savez_compressed` writes them.
    fn npz(dir: &Path, members: &[(&str, Vec<u8>)]) -> std::path::PathBuf {
        let path = dir.join("data.npz");
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, bytes) in members {
            zip.start_file(format!("{name}.npy"), options).unwrap();
            zip.write_all(bytes).unwrap();
        }
        zip.finish().unwrap();
        path
    }

    /// What the headers of an `.npz` say is checked before any member is decompressed: a
    /// member whose header declares 4 GB (the data need not even be there) is refused against
    /// the memory available, labels for another number of rows by their header, and a member
    /// that inflates past its header's size is cut there.
    #[test]
    fn an_npz_is_judged_by_its_headers_before_it_is_decompressed() {
        let tmp = tempfile::tempdir().unwrap();
        let source = |path: &Path| DataSource::new("npz", vec![path.to_path_buf()]);
        // A header whose data is not there: nothing may read past it.
        let header_only = |descr: &str, shape: &[usize]| npy::encode(descr, shape, &[]);
        let refusal = |path: &Path, memory| match npz_pairs_within(&source(path), path, memory) {
            Ok(_) => panic!("{} was read", path.display()),
            Err(e) => e.to_string(),
        };
        let huge = npz(
            tmp.path(),
            &[
                ("x", header_only("<f4", &[1_000_000, 1000])),
                ("y", header_only("|u1", &[1_000_000])),
            ],
        );
        let err = refusal(&huge, Some(1 << 30));
        assert!(
            err.contains("decompress to 3815 MiB") && err.contains("1024 MiB"),
            "{err}"
        );
        let mismatched = npz(
            tmp.path(),
            &[
                ("x", header_only("<f4", &[1_000_000, 1000])),
                ("y", header_only("|u1", &[5])),
            ],
        );
        let err = refusal(&mismatched, Some(1 << 30));
        assert!(err.contains("labels for 1000000 input rows"), "{err}");
        let mut long = npy::encode("|u1", &[2], &[1, 2]);
        long.extend_from_slice(&[0; 1000]);
        let inflating = npz(
            tmp.path(),
            &[("x", npy::encode("<f4", &[2, 1], &[0; 8])), ("y", long)],
        );
        let err = refusal(&inflating, None);
        assert!(err.contains("decompresses past"), "{err}");
        let good = npz(
            tmp.path(),
            &[
                ("x", npy::encode("<f4", &[2, 1], &[0; 8])),
                ("y", npy::encode("|u1", &[2], &[0, 1])),
            ],
        );
        assert_eq!(
            npz_pairs_within(&source(&good), &good, None).unwrap().len(),
            1
        );
    }
}
