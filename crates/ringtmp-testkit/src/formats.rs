//! A labelled image dataset written out in the formats users bring (NumPy arrays and an `.npz`,
//! CSV tables, one folder of PNGs per class, CIFAR-style binary batches), so tests and the
//! format benchmark check that each reads back as the original.

use std::io::Write;
use std::path::{Path, PathBuf};

use ringtmp_data::{Dataset, Split, npy};

/// The raw bytes and labels of the first `limit` examples of `split` (a byte-image dataset),
/// recovered from its normalised rows.
pub fn raw_rows(split: &Split, limit: usize) -> (Vec<u8>, Vec<u32>) {
    let rows = split.as_rows().expect("an image dataset");
    let n = limit.min(split.len());
    let (mut x, mut y) = (Vec::new(), Vec::new());
    split.gather_range(0, n, &mut x, &mut y);
    let norm = rows.normalisation();
    let (scale, mean, std) = (norm.scale, norm.mean[0], norm.std[0]);
    let pixels = x
        .iter()
        .map(|v| ((v * std + mean) / scale).round().clamp(0.0, 255.0) as u8)
        .collect();
    (pixels, y)
}

/// Where [`write_all`] put each format.
#[derive(Clone, Debug)]
pub struct Written {
    /// `train_x.npy`, `train_y.npy`, `test_x.npy`, `test_y.npy` (uint8 `[N, H, W]`, int64).
    pub npy: [PathBuf; 4],
    /// `mnist.npz` with `x_train`, `y_train`, `x_test`, `y_test` (Keras's `mnist.npz`).
    pub npz: PathBuf,
    /// `train.csv`, `test.csv`: a `label` column, then `p0`, `p1`, … as numbers.
    pub csv: [PathBuf; 2],
    /// `images/` with `train/<class>/` and `test/<class>/` PNGs.
    pub images: PathBuf,
}

/// Writes the first `train` and `test` examples of `data` (a one-channel byte-image dataset)
/// under `dir` in every format.
pub fn write_all(data: &Dataset, dir: &Path, train: usize, test: usize) -> Written {
    let (h, w, _) = data.input;
    let splits = [raw_rows(&data.train, train), raw_rows(&data.test, test)];
    std::fs::create_dir_all(dir).unwrap();
    let npy_paths =
        ["train_x", "train_y", "test_x", "test_y"].map(|n| dir.join(format!("{n}.npy")));
    let mut members = Vec::new();
    for (k, (pixels, labels)) in splits.iter().enumerate() {
        let n = labels.len();
        let x = npy::encode("|u1", &[n, h, w], pixels);
        let y_bytes: Vec<u8> = labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        let y = npy::encode("<i8", &[n], &y_bytes);
        std::fs::write(&npy_paths[2 * k], &x).unwrap();
        std::fs::write(&npy_paths[2 * k + 1], &y).unwrap();
        let split = if k == 0 { "train" } else { "test" };
        members.push((format!("x_{split}.npy"), x));
        members.push((format!("y_{split}.npy"), y));
    }
    let npz = dir.join("mnist.npz");
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&npz).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in &members {
        zip.start_file(name.as_str(), stored).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
    let csv_paths = ["train", "test"].map(|n| dir.join(format!("{n}.csv")));
    for ((pixels, labels), path) in splits.iter().zip(&csv_paths) {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
        let header: Vec<String> = (0..h * w).map(|i| format!("p{i}")).collect();
        writeln!(out, "label,{}", header.join(",")).unwrap();
        for (row, label) in pixels.chunks_exact(h * w).zip(labels) {
            let cells: Vec<String> = row.iter().map(|p| p.to_string()).collect();
            writeln!(out, "{label},{}", cells.join(",")).unwrap();
        }
    }
    let images = dir.join("images");
    for ((pixels, labels), split) in splits.iter().zip(["train", "test"]) {
        for (i, (row, label)) in pixels.chunks_exact(h * w).zip(labels).enumerate() {
            let folder = images.join(split).join(format!("class{label}"));
            std::fs::create_dir_all(&folder).unwrap();
            image::GrayImage::from_raw(w as u32, h as u32, row.to_vec())
                .unwrap()
                .save(folder.join(format!("{i:06}.png")))
                .unwrap();
        }
    }
    Written {
        npy: npy_paths,
        npz,
        csv: csv_paths,
        images,
    }
}
