//! Your own data: MNIST written out as NumPy arrays, an `.npz`, CSV tables and PNG folders reads
//! back as the IDX files read (the oracle), and every malformed input is refused with an error
//! naming the file and the row or member.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ringtmp_data::{DataSource, Dataset, Normalize, Task, load_source, npy};
use ringtmp_testkit::formats::{Written, write_all};

const TRAIN: usize = 300;
const TEST: usize = 100;

fn mnist() -> &'static Dataset {
    static DATA: OnceLock<Dataset> = OnceLock::new();
    DATA.get_or_init(|| ringtmp_data::load("mnist", None).unwrap())
}

fn written() -> &'static (tempfile::TempDir, Written) {
    static W: OnceLock<(tempfile::TempDir, Written)> = OnceLock::new();
    W.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let w = write_all(mnist(), dir.path(), TRAIN, TEST);
        (dir, w)
    })
}

/// MNIST's own normalisation, in the units of a source whose values are scaled by `scale`.
fn idx_normalisation(per_value: f32) -> Normalize {
    let norm = mnist().train.as_rows().unwrap().normalisation();
    Normalize::Given {
        mean: vec![norm.mean[0] * per_value],
        std: vec![norm.std[0] * per_value],
    }
}

fn gather_all(split: &ringtmp_data::Split) -> (Vec<f32>, Vec<u32>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    split.gather_range(0, split.len(), &mut x, &mut y);
    (x, y)
}

/// `data`'s splits hold the first examples of MNIST's, value for value.
fn assert_reads_as_mnist(data: &Dataset, tolerance: f32) {
    for (mine, theirs, n) in [
        (&data.train, &mnist().train, TRAIN),
        (&data.test, &mnist().test, TEST),
    ] {
        assert_eq!(mine.len(), n);
        let (x, y) = gather_all(mine);
        let (mut xe, mut ye) = (Vec::new(), Vec::new());
        theirs.gather_range(0, n, &mut xe, &mut ye);
        assert_eq!(y, ye, "labels");
        let worst = x
            .iter()
            .zip(&xe)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= tolerance, "inputs differ by {worst}");
    }
    assert_eq!(data.classes, 10);
    assert_eq!(data.task, Task::Classify);
}

#[test]
fn numpy_arrays_read_as_the_idx_files() {
    let (_, w) = written();
    let mut source = DataSource::new("npy", vec![w.npy[0].clone(), w.npy[2].clone()]);
    source.label_files = vec![w.npy[1].clone(), w.npy[3].clone()];
    source.normalize = idx_normalisation(1.0);
    let data = load_source(&source).unwrap();
    assert_eq!(data.input, (28, 28, 1));
    assert!(data.train.as_rows().unwrap().is_mapped(), "an .npy streams");
    assert_reads_as_mnist(&data, 0.0);
    let mut npz = DataSource::new("npz", vec![w.npz.clone()]);
    npz.normalize = idx_normalisation(1.0);
    assert_reads_as_mnist(&load_source(&npz).unwrap(), 0.0);
}

#[test]
fn csv_tables_read_as_the_idx_files() {
    let (_, w) = written();
    let mut source = DataSource::new("csv", w.csv.to_vec());
    // A table's values are not scaled: MNIST's constants in byte units.
    source.normalize = idx_normalisation(255.0);
    let data = load_source(&source).unwrap();
    assert_eq!(data.input, (1, 1, 784));
    assert_eq!(data.recipe.label.as_deref(), Some("label"));
    assert_eq!(data.recipe.columns.len(), 784);
    assert_reads_as_mnist(&data, 1e-5);
}

#[test]
fn png_folders_read_as_the_idx_files() {
    let (_, w) = written();
    let mut source = DataSource::new("images", vec![w.images.clone()]);
    source.normalize = idx_normalisation(1.0);
    let data = load_source(&source).unwrap();
    assert_eq!(data.input, (28, 28, 1));
    assert_eq!(data.recipe.class_names[3], "class3");
    // Folders list their files by class: compare as multisets of (label, row).
    let sorted = |split: &ringtmp_data::Split| {
        let (x, y) = gather_all(split);
        let mut rows: Vec<(u32, Vec<u32>)> = x
            .chunks_exact(784)
            .zip(y)
            .map(|(r, l)| (l, r.iter().map(|v| v.to_bits()).collect()))
            .collect();
        rows.sort();
        rows
    };
    let reference = written_reference();
    assert_eq!(sorted(&data.train), sorted(&reference.train));
    assert_eq!(sorted(&data.test), sorted(&reference.test));
}

/// The npy copy (checked against IDX above) with MNIST's normalisation.
fn written_reference() -> Dataset {
    let (_, w) = written();
    let mut npz = DataSource::new("npz", vec![w.npz.clone()]);
    npz.normalize = idx_normalisation(1.0);
    load_source(&npz).unwrap()
}

#[test]
fn automatic_normalisation_gives_each_channel_zero_mean_and_unit_deviation() {
    let (_, w) = written();
    let data = load_source(&DataSource::new("npz", vec![w.npz.clone()])).unwrap();
    let (x, _) = gather_all(&data.train);
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    assert!(
        mean.abs() < 1e-4 && (var - 1.0).abs() < 1e-3,
        "{mean} {var}"
    );
    // The recipe records it for predict.
    assert_eq!(data.recipe.normalisation.mean.len(), 1);
}

#[test]
fn one_file_is_split_by_a_seeded_fraction_into_disjoint_rows() {
    let (_, w) = written();
    let mut source = DataSource::new("csv", vec![w.csv[0].clone()]);
    source.validation = 0.2;
    let a = load_source(&source).unwrap();
    assert_eq!((a.train.len(), a.test.len()), (240, 60));
    let b = load_source(&source).unwrap();
    assert_eq!(
        gather_all(&a.test),
        gather_all(&b.test),
        "the same rows each time"
    );
    // No training row is a test row (compare whole rows: MNIST has no duplicates here).
    let (xt, _) = gather_all(&a.train);
    let (xv, _) = gather_all(&a.test);
    let train_rows: std::collections::HashSet<Vec<u32>> = xt
        .chunks_exact(784)
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect();
    assert!(
        xv.chunks_exact(784)
            .all(|r| !train_rows.contains(&r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()))
    );
    // Not the file's last rows: the held-out labels are a mix.
    let (_, yv) = gather_all(&a.test);
    assert!(yv.iter().collect::<std::collections::HashSet<_>>().len() > 5);
}

#[test]
fn channels_first_arrays_are_read_channels_last() {
    let dir = tempfile::tempdir().unwrap();
    // Two images of 3 channels, 2×2 pixels, NCHW; value = 100·row + 10·channel + pixel.
    let mut values = Vec::new();
    for n in 0..2 {
        for c in 0..3 {
            for p in 0..4 {
                values.push((100 * n + 10 * c + p) as f32);
            }
        }
    }
    let x = dir.path().join("x.npy");
    npy::write_f32(&x, &[2, 3, 2, 2], &values).unwrap();
    let y = dir.path().join("y.npy");
    npy::write(&y, "|u1", &[2], &[0, 1]).unwrap();
    let mut source = DataSource::new("npy", vec![x.clone()]);
    source.label_files = vec![y.clone()];
    source.validation = 0.5;
    source.normalize = Normalize::None;
    let data = load_source(&source).unwrap();
    assert_eq!(data.input, (2, 2, 3), "a 3-wide axis 1 is the channels");
    let mut all = Vec::new();
    for split in [&data.train, &data.test] {
        let (x, y) = gather_all(split);
        all.push((y[0], x));
    }
    all.sort_by_key(|(y, _)| *y);
    let expect: Vec<f32> = (0..4)
        .flat_map(|p| (0..3).map(move |c| (10 * c + p) as f32))
        .collect();
    assert_eq!(all[0].1, expect);
    assert_eq!(data.recipe.layout, ringtmp_data::Layout::Nchw);
}

#[test]
fn csv_class_names_and_regression_targets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("houses.csv");
    let mut text = String::from("rooms,area,kind,price\n");
    for i in 0..20 {
        let kind = ["flat", "house", "barn"][i % 3];
        text.push_str(&format!("{},{}.5,{kind},{}\n", i % 5, 30 + i, 100 + 7 * i));
    }
    std::fs::write(&path, &text).unwrap();
    // The kind column is text: classes in sorted order.
    let mut source = DataSource::new("csv", vec![path.clone()]);
    source.label = Some("kind".into());
    source.validation = 0.25;
    let data = load_source(&source).unwrap();
    assert_eq!(data.recipe.class_names, vec!["barn", "flat", "house"]);
    assert_eq!(data.recipe.columns, vec!["rooms", "area", "price"]);
    assert_eq!(data.classes, 3);
    // Regression on price: targets travel as f32 bit patterns.
    let mut source = DataSource::new("csv", vec![path.clone()]);
    source.target_columns = vec!["price".into()];
    source.validation = 0.25;
    let err = load_source(&source).unwrap_err().to_string();
    assert!(
        err.contains("\"kind\"") && err.contains("not a number"),
        "{err}"
    );
    let numeric = dir.path().join("numeric.csv");
    let no_kind: String = text
        .lines()
        .map(|l| {
            let c: Vec<&str> = l.split(',').collect();
            format!("{},{},{}\n", c[0], c[1], c[3])
        })
        .collect();
    std::fs::write(&numeric, no_kind).unwrap();
    source.files = vec![numeric];
    let data = load_source(&source).unwrap();
    assert_eq!(data.task, Task::Regress);
    assert_eq!((data.classes, data.positions()), (1, 1));
    // Targets are trained standardised (the training split's mean 0, deviation 1); the recipe
    // keeps the statistics that give them back in their units.
    let (_, y) = gather_all(&data.train);
    let y: Vec<f64> = y.iter().map(|&b| f64::from(f32::from_bits(b))).collect();
    let mean = y.iter().sum::<f64>() / y.len() as f64;
    let var = y.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / y.len() as f64;
    assert!(
        mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-4,
        "{mean} {var}"
    );
    let [(m, s)] = data.recipe.target_standardisation[..] else {
        panic!("one target's statistics")
    };
    assert!(
        y.iter()
            .all(|&v| (99.999..=233.001).contains(&(v * f64::from(s) + f64::from(m))))
    );
    assert_eq!(data.recipe.targets, vec!["price"]);
}

fn refused(source: &DataSource) -> String {
    load_source(source).unwrap_err().to_string()
}

fn csv_with(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn malformed_tables_are_refused_naming_file_row_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = "a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n";
    let cases = [
        ("ragged.csv", "a,b,label\n1,2,0\n3,4\n", "row 2", "ragged"),
        (
            "word.csv",
            "a,b,label\n1,2,0\n3,x,1\n",
            "row 2, column \"b\"",
            "\"x\" is not a number",
        ),
        (
            "empty.csv",
            "a,b,label\n1,,0\n",
            "row 1, column \"b\"",
            "empty cell",
        ),
        (
            "nan.csv",
            "a,b,label\n1,NaN,0\n",
            "row 1, column \"b\"",
            "finite",
        ),
        ("header.csv", "a,b,label\n", "header", "no data rows"),
    ];
    for (name, body, at, what) in cases {
        let path = csv_with(d, name, body);
        let err = refused(&DataSource::new("csv", vec![path]));
        assert!(
            err.contains(name) && err.contains(at) && err.contains(what),
            "{name}: {err}"
        );
    }
    // A label column that is not there, and none that is guessed.
    let path = csv_with(d, "good.csv", good);
    let mut source = DataSource::new("csv", vec![path.clone()]);
    source.label = Some("price".into());
    let err = refused(&source);
    assert!(
        err.contains("no column \"price\"") && err.contains("a, b, label"),
        "{err}"
    );
    let unnamed = csv_with(d, "unnamed.csv", "a,b,c\n1,2,0\n3,4,1\n");
    assert!(refused(&DataSource::new("csv", vec![unnamed])).contains("--label"));
    // A test class the training file never saw.
    let train = csv_with(d, "train.csv", "a,kind\n1,cat\n2,dog\n");
    let test = csv_with(d, "test.csv", "a,kind\n1,cat\n2,cow\n");
    let mut source = DataSource::new("csv", vec![train, test]);
    source.label = Some("kind".into());
    let err = refused(&source);
    assert!(
        err.contains("test.csv: row 2") && err.contains("\"cow\""),
        "{err}"
    );
}

#[test]
fn malformed_arrays_and_images_are_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let x = d.join("x.npy");
    npy::write_f32(&x, &[4, 3], &[0.0; 12]).unwrap();
    let npy_source = |labels: &Path| {
        let mut s = DataSource::new("npy", vec![x.clone()]);
        s.label_files = vec![labels.to_path_buf()];
        s.validation = 0.5;
        s
    };
    // Labels for another number of rows.
    let short = d.join("short.npy");
    npy::write(&short, "|u1", &[3], &[0, 1, 0]).unwrap();
    let err = refused(&npy_source(&short));
    assert!(
        err.contains("short.npy") && err.contains("labels for 4 input rows"),
        "{err}"
    );
    // A negative class.
    let neg = d.join("neg.npy");
    let bytes: Vec<u8> = [0i32, 1, -1, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    npy::write(&neg, "<i4", &[4], &bytes).unwrap();
    let err = refused(&npy_source(&neg));
    assert!(
        err.contains("neg.npy: row 3") && err.contains("label -1"),
        "{err}"
    );
    // Integer inputs.
    let labels = d.join("labels.npy");
    npy::write(&labels, "|u1", &[4], &[0, 1, 0, 1]).unwrap();
    let ints = d.join("ints.npy");
    npy::write(&ints, "<i4", &[4, 1], &[0; 16]).unwrap();
    let mut s = npy_source(&labels);
    s.files = vec![ints];
    let err = refused(&s);
    assert!(
        err.contains("ints.npy") && err.contains("dtype <i4"),
        "{err}"
    );
    // A declared shape the array does not hold.
    let mut s = npy_source(&labels);
    s.input_shape = Some((2, 2, 1));
    let err = refused(&s);
    assert!(
        err.contains("x.npy") && err.contains("3 values per row"),
        "{err}"
    );
    // An npz without the expected members.
    let (_, w) = written();
    let err = refused(&DataSource::new("npz", vec![w.npy[0].clone()]));
    assert!(err.contains("not an .npz"), "{err}");
    // An image that does not decode, named.
    let images = d.join("images");
    for class in ["a", "b"] {
        std::fs::create_dir_all(images.join(class)).unwrap();
        image::GrayImage::new(4, 4)
            .save(images.join(class).join("ok.png"))
            .unwrap();
    }
    std::fs::write(images.join("b").join("broken.png"), b"\x89PNG not really").unwrap();
    let err = refused(&DataSource::new("images", vec![images.clone()]));
    assert!(
        err.contains("broken.png") && err.contains("does not decode"),
        "{err}"
    );
    // Sizes differ without a declared shape.
    std::fs::remove_file(images.join("b").join("broken.png")).unwrap();
    image::GrayImage::new(5, 4)
        .save(images.join("b").join("wide.png"))
        .unwrap();
    let err = refused(&DataSource::new("images", vec![images.clone()]));
    assert!(
        err.contains("wide.png") && err.contains("--input-shape"),
        "{err}"
    );
    // With one, every image is resized to it.
    let mut s = DataSource::new("images", vec![images]);
    s.input_shape = Some((3, 3, 1));
    s.validation = 0.34;
    let data = load_source(&s).unwrap();
    assert_eq!(
        (data.input, data.train.len() + data.test.len()),
        ((3, 3, 1), 3)
    );
}

#[test]
fn cifar_binaries_read_channels_last_with_their_labels() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("cifar-10-batches-bin");
    std::fs::create_dir_all(&folder).unwrap();
    // Record r of batch b: label (b + r) % 10; pixel value (channel · 50 + r + b) for every pixel.
    let record = |label: u8, fill: [u8; 3]| -> Vec<u8> {
        let mut r = vec![label];
        for c in fill {
            r.extend(std::iter::repeat_n(c, 1024));
        }
        r
    };
    for b in 1..=5u8 {
        let bytes: Vec<u8> = (0..2u8)
            .flat_map(|r| record((b + r) % 10, [r + b, 50 + r + b, 100 + r + b]))
            .collect();
        std::fs::write(folder.join(format!("data_batch_{b}.bin")), bytes).unwrap();
    }
    let test: Vec<u8> = (0..3u8).flat_map(|r| record(r, [r, r, r])).collect();
    std::fs::write(folder.join("test_batch.bin"), test).unwrap();
    let mut source = DataSource::new("cifar10", vec![dir.path().to_path_buf()]);
    source.normalize = Normalize::None;
    let data = load_source(&source).unwrap();
    assert_eq!(
        (data.train.len(), data.test.len(), data.input),
        (10, 3, (32, 32, 3))
    );
    let (x, y) = gather_all(&data.train);
    assert_eq!(&y[..4], &[1, 2, 2, 3]);
    // Channels last: the first pixel's three values, then the second pixel's.
    let v = |k: usize| (x[k] * 255.0).round() as u8;
    assert_eq!((v(0), v(1), v(2), v(3)), (1, 51, 101, 1));
    // A batch cut short is refused at the record it cuts.
    std::fs::write(folder.join("test_batch.bin"), vec![0u8; 3073 + 10]).unwrap();
    let err = refused(&source);
    assert!(
        err.contains("test_batch.bin") && err.contains("3083 bytes"),
        "{err}"
    );
}
