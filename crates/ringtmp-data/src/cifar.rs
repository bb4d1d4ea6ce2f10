//! CIFAR-10 and CIFAR-100 in their binary versions (the `-binary.tar.gz` archives, unpacked):
//! records of a label byte (CIFAR-100: a coarse then a fine label byte; the fine one is read)
//! and 3,072 bytes of a 32×32 image, channels first. Read into memory channels last.
//!
//! `--data-file DIR` names the unpacked folder (`cifar-10-batches-bin`, `cifar-100-binary`) or
//! the folder above it. Class names come from `batches.meta.txt` / `fine_label_names.txt` when
//! present.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::description::{DataSource, Loaded};
use crate::error::{Error, Result};
use crate::recipe::Layout;
use crate::rows::{Dtype, Labels, RowData};

const SIDE: usize = 32;
const PIXELS: usize = SIDE * SIDE * 3;

struct Variant {
    folder: &'static str,
    train: &'static [&'static str],
    test: &'static str,
    label_bytes: usize,
    classes: u8,
    names: &'static str,
}

const CIFAR10: Variant = Variant {
    folder: "cifar-10-batches-bin",
    train: &[
        "data_batch_1.bin",
        "data_batch_2.bin",
        "data_batch_3.bin",
        "data_batch_4.bin",
        "data_batch_5.bin",
    ],
    test: "test_batch.bin",
    label_bytes: 1,
    classes: 10,
    names: "batches.meta.txt",
};

const CIFAR100: Variant = Variant {
    folder: "cifar-100-binary",
    train: &["train.bin"],
    test: "test.bin",
    label_bytes: 2,
    classes: 100,
    names: "fine_label_names.txt",
};

pub(crate) fn load(source: &DataSource) -> Result<Loaded> {
    let v = if source.format == "cifar10" {
        &CIFAR10
    } else {
        &CIFAR100
    };
    if source.files.len() != 1 {
        return Err(source.error("name the one folder that holds the binary batches"));
    }
    if source.input_shape.is_some_and(|s| s != (SIDE, SIDE, 3)) {
        return Err(source.error("CIFAR's images are 32×32×3"));
    }
    let given = &source.files[0];
    let dir = [given.join(v.folder), given.clone()]
        .into_iter()
        .find(|d| d.join(v.test).is_file())
        .ok_or_else(|| {
            source.error(format!(
                "{} holds no {} (looked in it and in {}/)",
                given.display(),
                v.test,
                v.folder
            ))
        })?;
    let train_files: Vec<PathBuf> = v.train.iter().map(|f| dir.join(f)).collect();
    let train = read(v, &train_files)?;
    let test = read(v, &[dir.join(v.test)])?;
    let class_names = std::fs::read_to_string(dir.join(v.names))
        .map(|t| {
            t.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .ok()
        .filter(|n| n.len() == usize::from(v.classes))
        .unwrap_or_default();
    Ok(Loaded {
        train: Arc::new(train),
        test: Some(Arc::new(test)),
        shape: (SIDE, SIDE, 3),
        layout: Layout::Nchw,
        scale: 1.0 / 255.0,
        channels: 3,
        columns: Vec::new(),
        label: None,
        targets: Vec::new(),
        class_names,
        dir,
    })
}

/// The records of one batch file of `format` (`cifar10`, `cifar100`), channels last.
pub(crate) fn read_batch(format: &str, path: &Path) -> Result<RowData> {
    let v = if format == "cifar10" {
        &CIFAR10
    } else {
        &CIFAR100
    };
    read(v, &[path.to_path_buf()])
}

/// The records of `files`, in order, as channels-last rows.
fn read(v: &Variant, files: &[PathBuf]) -> Result<RowData> {
    let record = v.label_bytes + PIXELS;
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for path in files {
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })?;
        if bytes.is_empty() || bytes.len() % record != 0 {
            return Err(Error::Format {
                path: path.clone(),
                offset: (bytes.len() / record * record) as u64,
                reason: format!(
                    "{} bytes is not a whole number of {record}-byte records",
                    bytes.len()
                ),
            });
        }
        for (i, rec) in bytes.chunks_exact(record).enumerate() {
            let label = rec[v.label_bytes - 1];
            if label >= v.classes {
                return Err(bad_label(path, i, record, label, v.classes));
            }
            labels.push(u32::from(label));
            let chw = &rec[v.label_bytes..];
            for p in 0..SIDE * SIDE {
                for c in 0..3 {
                    pixels.push(chw[c * SIDE * SIDE + p]);
                }
            }
        }
    }
    Ok(RowData::owned(
        pixels,
        Dtype::U8,
        PIXELS,
        Labels::Classes(labels),
    ))
}

fn bad_label(path: &Path, i: usize, record: usize, label: u8, classes: u8) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        offset: (i * record) as u64,
        reason: format!("record {i}: label {label} is outside 0..{classes}"),
    }
}
