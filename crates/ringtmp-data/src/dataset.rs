//! The datasets ringtmp knows, where their files are looked for, and how they are checked,
//! normalised and batched.
//!
//! Images are kept as the original bytes (47 MB for MNIST's training set instead of 188 MB as
//! f32) and converted to normalised f32 only for the rows of a batch. The normalisation constants
//! are the training split's pixel mean and standard deviation, computed at load time.
//!
//! A text dataset ([`load_text_dataset`]) is a [`Split`] of windows over its tokens: training
//! example `i` is the window starting at token `i`, so every strategy's seeded permutation and
//! sharding sample windows as they sample images; the validation windows are fixed. Its labels
//! are one per position ([`Split::positions`]).

use std::path::{Path, PathBuf};

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::idx::{IdxArray, read_idx};
use crate::recipe::InputRecipe;
use crate::rows::{Dtype, Labels, Normalisation, RowData, Rows};
use crate::text::{TextCorpus, Tokens, Vocabulary};

/// Where Debian's `dataset-fashion-mnist` package installs its files.
pub const DEBIAN_FASHION_MNIST: &str = "/usr/share/datasets/fashion-mnist";

/// The datasets ringtmp can load.
pub const DATASETS: [&str; 3] = ["mnist", "fashion-mnist", "digits"];

/// Outcome of checking one file against its published checksum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileCheck {
    /// The content's SHA-256 is the canonical one.
    Verified {
        /// File path.
        path: PathBuf,
    },
    /// The content differs from the canonical dataset.
    Mismatch {
        /// File path.
        path: PathBuf,
        /// Canonical SHA-256.
        expected: String,
        /// SHA-256 of what was read.
        got: String,
    },
}

/// One split (train or test) of a dataset: labelled images, or windows of a token sequence.
#[derive(Clone, Debug)]
pub struct Split {
    examples: Examples,
}

#[derive(Clone, Debug)]
enum Examples {
    /// Fixed-size rows (images, table rows, arrays) with their labels.
    Rows(Rows),
    /// Windows of `seq_len` tokens with the next token of each position as its label. Example
    /// `i` starts at `starts[i]` when the windows are fixed (validation), else at token `i` (every
    /// window of the split is an example, so an epoch's permutation samples windows without
    /// replacement).
    Windows {
        tokens: std::sync::Arc<Tokens>,
        starts: Option<Vec<u32>>,
        seq_len: usize,
    },
}

impl Split {
    /// A split of fixed-size rows.
    pub fn rows(rows: Rows) -> Self {
        Self {
            examples: Examples::Rows(rows),
        }
    }

    /// The rows of a split of fixed-size examples (`None` for text windows).
    pub fn as_rows(&self) -> Option<&Rows> {
        match &self.examples {
            Examples::Rows(rows) => Some(rows),
            Examples::Windows { .. } => None,
        }
    }

    /// Every window of `seq_len` tokens of `tokens` (training).
    pub fn every_window(tokens: std::sync::Arc<Tokens>, seq_len: usize) -> Self {
        Self {
            examples: Examples::Windows {
                tokens,
                starts: None,
                seq_len,
            },
        }
    }

    /// The fixed windows of `tokens` starting at `starts` (validation).
    ///
    /// # Panics
    /// If a window does not fit (a programmer error: starts come from
    /// [`Tokens::validation_starts`]).
    pub fn fixed_windows(tokens: std::sync::Arc<Tokens>, seq_len: usize, starts: Vec<u32>) -> Self {
        assert!(
            starts.iter().all(|&s| s as usize + seq_len < tokens.len()),
            "a window past the split"
        );
        Self {
            examples: Examples::Windows {
                tokens,
                starts: Some(starts),
                seq_len,
            },
        }
    }

    /// Number of examples (images, or windows).
    pub fn len(&self) -> usize {
        match &self.examples {
            Examples::Rows(rows) => rows.len(),
            Examples::Windows {
                starts: Some(starts),
                ..
            } => starts.len(),
            Examples::Windows {
                tokens,
                starts: None,
                seq_len,
            } => tokens.windows(*seq_len),
        }
    }

    /// Whether the split has no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Input values per example (pixels, or token ids).
    pub fn features(&self) -> usize {
        match &self.examples {
            Examples::Rows(rows) => rows.features(),
            Examples::Windows { seq_len, .. } => *seq_len,
        }
    }

    /// Labels per example: 1 for an image, `seq_len` for a window (each position's next token).
    pub fn positions(&self) -> usize {
        match &self.examples {
            Examples::Rows(rows) => rows.positions(),
            Examples::Windows { seq_len, .. } => *seq_len,
        }
    }

    /// Regression: the variance of the split's targets (see [`Rows::target_variance`]).
    pub fn target_variance(&self) -> Option<f64> {
        self.as_rows().and_then(Rows::target_variance)
    }

    /// Regression: what one unit of a trained output is in the target's own units — its
    /// standard deviation when one standardised target is trained, else 1 (several targets are
    /// scored in standard deviations); `None` for class labels.
    pub fn target_units(&self) -> Option<f64> {
        let rows = self.as_rows()?;
        rows.target_variance()?;
        Some(match rows.target_standardisation() {
            Some([(_, std)]) => f64::from(*std),
            _ => 1.0,
        })
    }

    /// Writes the inputs `[indices.len(), features]` into `x` (normalised pixels, or token ids as
    /// `f32`) and the labels `[indices.len(), positions]` into `y`, reusing their allocations.
    ///
    /// # Panics
    /// If an index is out of range (indices come from this crate's samplers).
    pub fn gather(&self, indices: &[u32], x: &mut Vec<f32>, y: &mut Vec<u32>) {
        match &self.examples {
            Examples::Rows(rows) => rows.gather(indices, x, y),
            Examples::Windows {
                tokens,
                starts: None,
                seq_len,
            } => tokens.gather(indices, *seq_len, x, y),
            Examples::Windows {
                tokens,
                starts: Some(starts),
                seq_len,
            } => {
                let at: Vec<u32> = indices.iter().map(|&i| starts[i as usize]).collect();
                tokens.gather(&at, *seq_len, x, y);
            }
        }
    }

    /// The examples `start..end` in order (for evaluation).
    pub fn gather_range(&self, start: usize, end: usize, x: &mut Vec<f32>, y: &mut Vec<u32>) {
        let indices: Vec<u32> = (start as u32..end as u32).collect();
        self.gather(&indices, x, y);
    }
}

/// What a dataset's examples ask of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Task {
    /// One class per example: the model ends in `classes` logits.
    Classify,
    /// Real targets per example (regression, mean squared error): the model ends in `classes`
    /// outputs, one per target.
    Regress,
    /// The next token at each of `seq_len` positions: the model reads `seq_len` token ids and ends
    /// in `[seq_len, vocabulary]` logits.
    NextToken {
        /// Positions per window.
        seq_len: usize,
        /// How ids map to text.
        vocab: Vocabulary,
    },
}

/// A loaded dataset.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Name (`mnist`, `fashion-mnist`, `digits`).
    pub name: String,
    /// Per-example input shape `(height, width, channels)`.
    pub input: (usize, usize, usize),
    /// Number of classes.
    pub classes: usize,
    /// Training split.
    pub train: Split,
    /// Test split.
    pub test: Split,
    /// Directory the files were read from.
    pub source: PathBuf,
    /// Checksum results, one per file.
    pub checks: Vec<FileCheck>,
    /// Classification, regression, or next-token prediction over text.
    pub task: Task,
    /// How a raw example becomes the model's input (stored with checkpoints, so `predict` reads
    /// new data as training read it).
    pub recipe: InputRecipe,
}

impl Dataset {
    /// A language-model dataset from `corpus`: every window of `seq_len` tokens of its training
    /// split trains; at most `eval_tokens` tokens of fixed windows from its validation split's
    /// start validate (at least one window).
    pub fn text(
        name: &str,
        corpus: TextCorpus,
        seq_len: usize,
        eval_tokens: usize,
        checks: Vec<FileCheck>,
    ) -> Result<Self> {
        corpus.check_seq_len(seq_len)?;
        let starts = corpus
            .validation
            .validation_starts(seq_len, (eval_tokens / seq_len).max(1));
        let source = corpus
            .files
            .first()
            .and_then(|f| f.parent())
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let train = Split::every_window(std::sync::Arc::new(corpus.train), seq_len);
        let test = Split::fixed_windows(std::sync::Arc::new(corpus.validation), seq_len, starts);
        Ok(Self {
            name: name.to_string(),
            input: (seq_len, 1, 1),
            classes: corpus.vocab.len(),
            train,
            test,
            source,
            checks,
            task: Task::NextToken {
                seq_len,
                vocab: corpus.vocab,
            },
            recipe: InputRecipe::tokens(name),
        })
    }

    /// Labels per example: 1, or the window's positions.
    pub fn positions(&self) -> usize {
        match &self.task {
            Task::Classify => 1,
            Task::Regress => self.classes,
            Task::NextToken { seq_len, .. } => *seq_len,
        }
    }
}

struct IdxSpec {
    name: &'static str,
    /// Canonical SHA-256 of the decompressed files: train images, train labels, test images,
    /// test labels (from the datasets' publishers; see data/mnist/SHA256SUMS.uncompressed).
    sha256: [&'static str; 4],
}

const MNIST: IdxSpec = IdxSpec {
    name: "mnist",
    sha256: [
        "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    ],
};

const FASHION_MNIST: IdxSpec = IdxSpec {
    name: "fashion-mnist",
    sha256: [
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    ],
};

const IDX_FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// SHA-256 of the bundled `digits.csv.gz` (scikit-learn 1.9.1).
const DIGITS_SHA256: &str = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22";
/// The digits set has no official split: the first 1,500 rows train, the last 297 test.
const DIGITS_TRAIN: usize = 1500;

/// Directories searched for dataset `name`, in order. With `data_dir`: that directory and
/// `data_dir/name` only (a directory the user named is never silently replaced by the bundled
/// copy). Without: `./data/name`, the repository's bundled `data/name`, an installed binary's
/// `<prefix>/share/ringtmp/data/name`, and for Fashion-MNIST the directory Debian's package
/// installs.
pub fn search_dirs(name: &str, data_dir: Option<&Path>) -> Vec<PathBuf> {
    // The digits file keeps the folder name it has in shared/data.
    let folder = if name == "digits" {
        "sklearn-digits"
    } else {
        name
    };
    if let Some(d) = data_dir {
        return vec![d.to_path_buf(), d.join(folder)];
    }
    let mut dirs = Vec::new();
    dirs.push(Path::new("data").join(folder));
    dirs.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../data")
            .join(folder),
    );
    if let Some(installed) = installed_data_dir() {
        dirs.push(installed.join(folder));
    }
    if name == "fashion-mnist" {
        dirs.push(PathBuf::from(DEBIAN_FASHION_MNIST));
    }
    dirs
}

/// Where an installed `ringtmp` (a Python wheel's `bin/ringtmp`, or a package's) finds the
/// datasets it ships: `<prefix>/share/ringtmp/data` beside its `bin/`.
fn installed_data_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let prefix = exe.parent()?.parent()?;
    let dir = prefix.join("share/ringtmp/data");
    dir.is_dir().then_some(dir)
}

/// Loads dataset `name`, looking in [`search_dirs`].
pub fn load(name: &str, data_dir: Option<&Path>) -> Result<Dataset> {
    if let Some(d) = data_dir
        && !d.is_dir()
    {
        return Err(Error::NotFound {
            dataset: name.to_string(),
            file: "--data-dir".into(),
            searched: format!("{} (no such directory)", d.display()),
            hint: String::new(),
        });
    }
    let dirs = search_dirs(name, data_dir);
    match name {
        "mnist" => load_idx(&MNIST, &dirs),
        "fashion-mnist" => load_idx(&FASHION_MNIST, &dirs),
        "digits" => load_digits(&dirs),
        other => Err(Error::UnknownDataset(other.to_string())),
    }
}

/// How a text dataset is read: its files and windows.
#[derive(Clone, Debug, PartialEq)]
pub struct TextOptions {
    /// UTF-8 text files (raw or `.gz`), or pre-tokenised `.bin` files (training, then an
    /// optional validation file). Empty: the bundled Shakespeare corpus.
    pub files: Vec<PathBuf>,
    /// Positions per window (the model's context).
    pub seq_len: usize,
    /// The fraction of the text (the end) that validates.
    pub validation: f64,
    /// Tokens of fixed validation windows each evaluation reads, at most.
    pub eval_tokens: usize,
    /// Vocabulary size of `.bin` files.
    pub bin_vocab: usize,
    /// A `tokenizer.json` that encodes UTF-8 files (`None`: a character vocabulary).
    pub tokenizer: Option<PathBuf>,
}

/// Loads a text dataset: a character vocabulary over UTF-8 files, or the ids of `.bin` files.
/// A named file that is missing but present as `FILE.gz` is read compressed (the repository
/// ships its corpus gzipped). The bundled corpus is checked against its published checksum.
pub fn load_text_dataset(options: &TextOptions) -> Result<Dataset> {
    let files: Vec<PathBuf> = if options.files.is_empty() {
        let dirs = search_dirs("shakespeare", None);
        vec![find("text", &dirs, crate::text::SHAKESPEARE.0)?]
    } else {
        options
            .files
            .iter()
            .map(|f| {
                let gz = PathBuf::from(format!("{}.gz", f.display()));
                if !f.exists() && gz.is_file() {
                    gz
                } else {
                    f.clone()
                }
            })
            .collect()
    };
    let is_bin = |f: &PathBuf| f.extension().is_some_and(|e| e == "bin");
    let name = "text";
    if files.iter().any(is_bin) {
        if options.tokenizer.is_some() {
            return Err(Error::Batching(
                "--tokenizer encodes text files; .bin files hold token ids already".into(),
            ));
        }
        if !files.iter().all(is_bin) || files.len() > 2 {
            return Err(Error::Batching(
                "pre-tokenised .bin files come alone: --data-file TRAIN.bin [--data-file VAL.bin]"
                    .into(),
            ));
        }
        let corpus = crate::text::load_token_bins(
            &files[0],
            files.get(1).map(PathBuf::as_path),
            options.validation,
            options.bin_vocab,
        )?;
        return Dataset::text(
            name,
            corpus,
            options.seq_len,
            options.eval_tokens,
            Vec::new(),
        );
    }
    let (corpus, hashes) = match &options.tokenizer {
        Some(tokenizer) => {
            crate::text::load_text_with_tokenizer(&files, options.validation, tokenizer)?
        }
        None => crate::text::load_text(&files, options.validation)?,
    };
    let checks = files
        .iter()
        .zip(hashes)
        .filter(|(f, _)| {
            f.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(crate::text::SHAKESPEARE.0))
        })
        .map(|(f, got)| {
            if got == crate::text::SHAKESPEARE.1 {
                FileCheck::Verified { path: f.clone() }
            } else {
                FileCheck::Mismatch {
                    path: f.clone(),
                    expected: crate::text::SHAKESPEARE.1.into(),
                    got,
                }
            }
        })
        .collect();
    Dataset::text(name, corpus, options.seq_len, options.eval_tokens, checks)
}

/// The first directory holding `file` (raw or `.gz`), with the path found.
fn find(dataset: &str, dirs: &[PathBuf], file: &str) -> Result<PathBuf> {
    for dir in dirs {
        for candidate in [dir.join(format!("{file}.gz")), dir.join(file)] {
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(Error::NotFound {
        dataset: dataset.to_string(),
        file: format!("{file}[.gz]"),
        searched: dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        hint: String::new(),
    })
}

fn load_idx(spec: &IdxSpec, dirs: &[PathBuf]) -> Result<Dataset> {
    // All four files must come from one directory: find the first file, then read the rest there.
    let first = find(spec.name, dirs, IDX_FILES[0]).map_err(|e| match e {
        // None of the files anywhere: say which ones were looked for, not just the first.
        Error::NotFound {
            dataset, searched, ..
        } => Error::NotFound {
            hint: if spec.name == "fashion-mnist" {
                format!(
                    "; install Debian's dataset-fashion-mnist package (it puts them in \
                     {DEBIAN_FASHION_MNIST}) or pass --data-dir DIR holding the four files"
                )
            } else {
                String::new()
            },
            dataset,
            file: IDX_FILES.map(|f| format!("{f}[.gz]")).join(", "),
            searched,
        },
        other => other,
    })?;
    let dir = first.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut arrays: Vec<(PathBuf, IdxArray)> = Vec::new();
    let mut checks = Vec::new();
    for (file, sha) in IDX_FILES.iter().zip(spec.sha256) {
        let path = find(spec.name, std::slice::from_ref(&dir), file)?;
        let array = read_idx(&path)?;
        checks.push(if array.sha256 == sha {
            FileCheck::Verified { path: path.clone() }
        } else {
            FileCheck::Mismatch {
                path: path.clone(),
                expected: sha.to_string(),
                got: array.sha256.clone(),
            }
        });
        arrays.push((path, array));
    }
    let inconsistent = |reason: String| Error::Inconsistent {
        dataset: spec.name.to_string(),
        reason,
    };
    let mut splits = Vec::new();
    for pair in arrays.chunks(2) {
        let ((ipath, images), (lpath, labels)) = (&pair[0], &pair[1]);
        let [count, h, w] = images.dims[..] else {
            return Err(inconsistent(format!(
                "{}: images must have 3 dimensions, found {:?}",
                ipath.display(),
                images.dims
            )));
        };
        if labels.dims != [count] {
            return Err(inconsistent(format!(
                "{} has {count} images but {} has dimensions {:?}",
                ipath.display(),
                lpath.display(),
                labels.dims
            )));
        }
        if let Some(pos) = labels.data.iter().position(|&l| l > 9) {
            return Err(Error::Format {
                path: lpath.clone(),
                offset: 8 + pos as u64,
                reason: format!("label {} is outside 0..10", labels.data[pos]),
            });
        }
        splits.push((h, w, images.data.clone(), labels.data.clone()));
    }
    let (h, w) = (splits[0].0, splits[0].1);
    if (splits[1].0, splits[1].1) != (h, w) {
        return Err(inconsistent("train and test images differ in size".into()));
    }
    let test = splits.pop().map(|(_, _, p, l)| (p, l)).unwrap_or_default();
    let train = splits.pop().map(|(_, _, p, l)| (p, l)).unwrap_or_default();
    Ok(assemble(
        spec.name,
        (h, w, 1),
        10,
        1.0 / 255.0,
        train,
        test,
        dir,
        checks,
    ))
}

fn load_digits(dirs: &[PathBuf]) -> Result<Dataset> {
    use std::io::Read;
    let path = find("digits", dirs, "digits.csv")?;
    let bytes = std::fs::read(&path).map_err(|e| Error::Io {
        path: path.clone(),
        source: e,
    })?;
    let got = {
        use sha2::{Digest, Sha256};
        hex::encode(Sha256::digest(&bytes))
    };
    let check = if got == DIGITS_SHA256 {
        FileCheck::Verified { path: path.clone() }
    } else {
        FileCheck::Mismatch {
            path: path.clone(),
            expected: DIGITS_SHA256.into(),
            got,
        }
    };
    let mut text = String::new();
    let read = if bytes.starts_with(&[0x1f, 0x8b]) {
        flate2::read::GzDecoder::new(&bytes[..]).read_to_string(&mut text)
    } else {
        (&bytes[..]).read_to_string(&mut text)
    };
    read.map_err(|e| Error::Format {
        path: path.clone(),
        offset: text.len() as u64,
        reason: format!("cannot decompress: {e}"),
    })?;
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    let mut offset = 0u64;
    for (line_no, line) in text.lines().enumerate() {
        let fields: Vec<&str> = line.trim().split(',').collect();
        let bad = |reason: String| Error::Format {
            path: path.clone(),
            offset,
            reason: format!("line {}: {reason}", line_no + 1),
        };
        if fields.len() != 65 {
            return Err(bad(format!(
                "{} fields, expected 64 pixels and a label",
                fields.len()
            )));
        }
        for (i, f) in fields.iter().enumerate() {
            let v: f32 = f
                .trim()
                .parse()
                .map_err(|_| bad(format!("field {} is not a number: {f:?}", i + 1)))?;
            let limit = if i < 64 { 16.0 } else { 9.0 };
            if !(0.0..=limit).contains(&v) || v.fract() != 0.0 {
                return Err(bad(format!("field {} = {v} is outside 0..={limit}", i + 1)));
            }
            if i < 64 {
                pixels.push(v as u8)
            } else {
                labels.push(v as u8)
            }
        }
        offset += line.len() as u64 + 1;
    }
    if labels.len() <= DIGITS_TRAIN {
        return Err(Error::Inconsistent {
            dataset: "digits".into(),
            reason: format!("only {} rows", labels.len()),
        });
    }
    let test = (
        pixels.split_off(DIGITS_TRAIN * 64),
        labels.split_off(DIGITS_TRAIN),
    );
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok(assemble(
        "digits",
        (8, 8, 1),
        10,
        1.0 / 16.0,
        (pixels, labels),
        test,
        dir,
        vec![check],
    ))
}

fn assemble(
    name: &str,
    input: (usize, usize, usize),
    classes: usize,
    scale: f32,
    train: (Vec<u8>, Vec<u8>),
    test: (Vec<u8>, Vec<u8>),
    source: PathBuf,
    checks: Vec<FileCheck>,
) -> Dataset {
    let features = input.0 * input.1 * input.2;
    let rows = |(pixels, labels): (Vec<u8>, Vec<u8>)| {
        let labels = Labels::Classes(labels.into_iter().map(u32::from).collect());
        Arc::new(RowData::owned(pixels, Dtype::U8, features, labels))
    };
    let (train, test) = (rows(train), rows(test));
    // One channel: the training pixels' mean and deviation (in [0, 1] units).
    let identity = Normalisation::identity(scale, 1);
    let norm = Normalisation::measure(&Rows::new(train.clone(), None, identity), scale, 1);
    let recipe = InputRecipe {
        format: "idx".into(),
        shape: input,
        normalisation: norm.clone(),
        ..InputRecipe::tokens(name)
    };
    Dataset {
        name: name.to_string(),
        input,
        classes,
        train: Split::rows(Rows::new(train, None, norm.clone())),
        test: Split::rows(Rows::new(test, None, norm)),
        source,
        checks,
        task: Task::Classify,
        recipe,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_mnist_loads_verified_with_known_statistics() {
        let d = load("mnist", None).unwrap();
        assert_eq!(
            (d.train.len(), d.test.len(), d.input),
            (60_000, 10_000, (28, 28, 1))
        );
        assert!(
            d.checks
                .iter()
                .all(|c| matches!(c, FileCheck::Verified { .. })),
            "{:?}",
            d.checks
        );
        // The familiar MNIST constants.
        let norm = d.train.as_rows().unwrap().normalisation();
        let (mean, std) = (norm.mean[0], norm.std[0]);
        assert!((mean - 0.1307).abs() < 1e-4 && (std - 0.3081).abs() < 1e-4);
        let mut hist = [0usize; 10];
        let (mut x, mut y) = (Vec::new(), Vec::new());
        d.test.gather_range(0, d.test.len(), &mut x, &mut y);
        for label in y {
            hist[label as usize] += 1;
        }
        assert_eq!(
            hist,
            [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
        );
        let (mut x, mut y) = (Vec::new(), Vec::new());
        d.train.gather(&[0, 1], &mut x, &mut y);
        assert_eq!((x.len(), y), (2 * 784, vec![5, 0]));
    }

    // A target column pandas wrote as floats (`68.0`) is a quantity, as is one of many varied
    // whole numbers; a few small whole numbers stay class indices.
    #[test]
    fn whole_numbers_written_as_reals_or_many_and_varied_are_regression_targets() {
        let dir = tempfile::tempdir().unwrap();
        let table = |name: &str, label: &dyn Fn(u32) -> String| {
            let path = dir.path().join(name);
            let mut text = String::from("a,b,target\n");
            for i in 0..400u32 {
                text.push_str(&format!("{},{},{}\n", i % 7, i % 11, label(i)));
            }
            std::fs::write(&path, text).unwrap();
            let mut source = crate::DataSource::new("csv", vec![path]);
            source.validation = 0.2;
            crate::load_source(&source).unwrap()
        };
        let regression = |d: &Dataset| d.train.as_rows().unwrap().measure_targets().is_some();
        let pandas = table("pandas.csv", &|i| format!("{}.0", 25 + (i * 37) % 300));
        assert!(regression(&pandas), "written as reals: a quantity");
        let counts = table("counts.csv", &|i| ((i * 37) % 300 + 25).to_string());
        assert!(
            regression(&counts),
            "300 distinct whole numbers in 400 rows: a quantity"
        );
        let classes = table("classes.csv", &|i| (i % 3).to_string());
        assert!(!regression(&classes), "three small whole numbers: classes");
        assert_eq!(classes.classes, 3);
    }

    // A NaN among the inputs is refused at load, naming the file and the row, before any
    // normalisation or node sees it.
    #[test]
    fn non_finite_inputs_are_refused_naming_the_row() {
        let dir = tempfile::tempdir().unwrap();
        let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
        let mut values = vec![0.5f32; 20 * 4];
        values[13 * 4 + 2] = f32::NAN;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        crate::npy::write(&x, "<f4", &[20, 4], &bytes).unwrap();
        let labels: Vec<u8> = (0..20u8).map(|i| i % 2).collect();
        crate::npy::write(&y, "|u1", &[20], &labels).unwrap();
        let mut source = crate::DataSource::new("npy", vec![x]);
        source.label_files = vec![y];
        source.validation = 0.2;
        let err = crate::load_source(&source).unwrap_err().to_string();
        assert!(
            err.contains("x.npy") && err.contains("row 14") && err.contains("finite"),
            "{err}"
        );
    }

    // Labels a run could not train on honestly are refused, naming where: a missing (`nan`)
    // label, a header naming its label column twice, a class folder with no image.
    #[test]
    fn labels_that_cannot_train_are_refused_naming_where() {
        let dir = tempfile::tempdir().unwrap();
        let csv = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            let mut source = crate::DataSource::new("csv", vec![path]);
            source.validation = 0.2;
            crate::load_source(&source)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let rows = |label: &dyn Fn(u32) -> String| {
            (0..30u32)
                .map(|i| format!("{},{}\n", i % 5, label(i)))
                .collect::<String>()
        };
        let nan = csv(
            "nan.csv",
            &format!(
                "a,label\n{}",
                rows(&|i| if i == 7 {
                    "nan".into()
                } else {
                    (i % 2).to_string()
                })
            ),
        );
        assert!(
            nan.contains("row 8") && nan.contains("not a finite number"),
            "{nan}"
        );
        let twice = csv(
            "twice.csv",
            &format!("label,label\n{}", rows(&|i| (i % 2).to_string())),
        );
        assert!(twice.contains("\"label\" twice"), "{twice}");
        let images = dir.path().join("images");
        for class in ["cat", "dog"] {
            std::fs::create_dir_all(images.join(class)).unwrap();
        }
        for i in 0..4 {
            image::RgbImage::new(4, 4)
                .save(images.join("cat").join(format!("{i}.png")))
                .unwrap();
        }
        let source = crate::DataSource::new("images", vec![images]);
        let empty = crate::load_source(&source)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            empty.contains("\"dog\" holds no PNG or JPEG image"),
            "{empty}"
        );
        // A test file's class that training never shows.
        let train = dir.path().join("train.csv");
        let test = dir.path().join("test.csv");
        std::fs::write(
            &train,
            format!("a,label\n{}", rows(&|i| (i % 2).to_string())),
        )
        .unwrap();
        std::fs::write(&test, "a,label\n1,0\n2,1\n3,2\n").unwrap();
        let source = crate::DataSource::new("csv", vec![train, test]);
        let unseen = crate::load_source(&source)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(unseen.contains("test.csv: row 3 has class 2"), "{unseen}");
    }

    #[test]
    fn digits_loads_with_split() {
        let d = load("digits", None).unwrap();
        assert_eq!(
            (d.train.len(), d.test.len(), d.input),
            (1500, 297, (8, 8, 1))
        );
        assert!(matches!(d.checks[0], FileCheck::Verified { .. }));
    }

    #[test]
    fn missing_dataset_lists_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let e = load_idx(&FASHION_MNIST, &[dir.path().to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train-images-idx3-ubyte") && e.contains(&dir.path().display().to_string()),
            "{e}"
        );
        assert!(
            load("cifar", None)
                .unwrap_err()
                .to_string()
                .contains("unknown dataset")
        );
    }

    // A --data-dir that does not exist, or holds none of the files, is an error that
    // names it and the files looked for, never a silent fall-back to the bundled copy.
    #[test]
    fn r10_a_named_data_dir_is_never_replaced_by_the_bundled_copy() {
        let missing = Path::new("/nonexistent/ringtmp-data");
        let e = load("mnist", Some(missing)).unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/ringtmp-data") && e.contains("no such directory"),
            "{e}"
        );
        let empty = tempfile::tempdir().unwrap();
        let e = load("mnist", Some(empty.path())).unwrap_err().to_string();
        for file in IDX_FILES {
            assert!(e.contains(file), "{file} is named: {e}");
        }
        assert!(e.contains(&empty.path().display().to_string()), "{e}");
        assert!(
            !e.contains("data/mnist,"),
            "no bundled directory searched: {e}"
        );
        assert!(load("digits", Some(empty.path())).is_err());
        let e = load("fashion-mnist", Some(empty.path()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dataset-fashion-mnist"),
            "says how to get it: {e}"
        );
    }

    #[test]
    fn corrupt_and_modified_files_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist");
        for f in IDX_FILES {
            std::fs::copy(
                src.join(format!("{f}.gz")),
                dir.path().join(format!("{f}.gz")),
            )
            .unwrap();
        }
        // Replace the test labels with a valid IDX file that has one label changed.
        let labels = read_idx(&src.join("t10k-labels-idx1-ubyte.gz")).unwrap();
        let mut raw = vec![0, 0, 8, 1];
        raw.extend((labels.dims[0] as u32).to_be_bytes());
        raw.extend(&labels.data);
        raw[8] = (raw[8] + 1) % 10;
        std::fs::remove_file(dir.path().join("t10k-labels-idx1-ubyte.gz")).unwrap();
        std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), &raw).unwrap();
        let d = load_idx(&MNIST, &[dir.path().to_path_buf()]).unwrap();
        assert!(
            matches!(&d.checks[3], FileCheck::Mismatch { expected, .. } if expected.starts_with("ff7bcfd4"))
        );
        // A label out of range is a format error at its offset.
        raw[10] = 42;
        std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), &raw).unwrap();
        let e = load_idx(&MNIST, &[dir.path().to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("at byte 10: label 42"), "{e}");
        // A truncated file is a format error naming it.
        std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), &raw[..100]).unwrap();
        let e = load_idx(&MNIST, &[dir.path().to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t10k-labels-idx1-ubyte: at byte 100: file is truncated"),
            "{e}"
        );
    }
}
