//! A user's own dataset, described once ([`DataSource`]: the format, the files, the input shape,
//! the label, the split and the normalisation) and loaded into the same [`Dataset`] the bundled
//! datasets are, so every strategy trains on it unchanged.
//!
//! Formats: NumPy (`npy`, `npz`), CSV tables with a header (`csv`), one folder of images per
//! class (`images`: PNG and JPEG), and CIFAR-10/100's binary batches (`cifar10`, `cifar100`).
//! What `torchvision.datasets` and `numpy.load` users expect holds: class folders sorted by name
//! give class indices, bytes are scaled to [0, 1] before normalisation, a channels-first array is
//! read as such. Without a test file, a seeded `validation` fraction of the rows (not the last
//! rows: files are often sorted by class) is held out.
//!
//! Every reader checks everything before a node starts: a ragged row, a cell that is no number,
//! an image that does not decode, an array of another shape or dtype than declared, a label out
//! of range — each an error naming the file and the row or member.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, Split, Task};
use crate::error::{Error, Result};
use crate::recipe::{InputRecipe, Layout};
use crate::rows::{Labels, Normalisation, RowData, Rows};

/// The formats a [`DataSource`] reads.
pub const FORMATS: [&str; 6] = ["npy", "npz", "csv", "images", "cifar10", "cifar100"];

/// How inputs are normalised.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Normalize {
    /// Each channel's mean and deviation over the training split (a table's: each column's).
    #[default]
    Auto,
    /// Values as stored (bytes still scaled to [0, 1]).
    None,
    /// Given per-channel means and deviations, in [0, 1] units for bytes (torchvision's
    /// `Normalize`); one value applies to every channel.
    Given {
        /// Means.
        mean: Vec<f32>,
        /// Standard deviations.
        std: Vec<f32>,
    },
}

impl std::str::FromStr for Normalize {
    type Err = String;

    /// `auto`, `none`, or `MEAN[,MEAN…]/STD[,STD…]`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => return Ok(Normalize::Auto),
            "none" => return Ok(Normalize::None),
            _ => {}
        }
        let numbers = |part: &str| -> std::result::Result<Vec<f32>, String> {
            part.split(',')
                .map(|v| {
                    v.trim()
                        .parse::<f32>()
                        .map_err(|_| format!("{v:?} is not a number"))
                })
                .collect()
        };
        let (mean, std) = s.split_once('/').ok_or_else(|| {
            format!("normalize {s:?}: expected auto, none or MEAN[,MEAN…]/STD[,STD…]")
        })?;
        let (mean, std) = (numbers(mean)?, numbers(std)?);
        if mean.len() != std.len() || std.iter().any(|&s| s <= 0.0 || !s.is_finite()) {
            return Err(format!(
                "normalize {s:?}: as many means as positive deviations"
            ));
        }
        Ok(Normalize::Given { mean, std })
    }
}

/// A user's dataset as the run reads it (see the module header). The same on every node, so
/// every node that reads data reads the same rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataSource {
    /// One of [`FORMATS`].
    pub format: String,
    /// The training file (a directory for `images` and `cifar*`), then an optional test file.
    pub files: Vec<PathBuf>,
    /// `npy`: the label array of each file, in the same order.
    #[serde(default)]
    pub label_files: Vec<PathBuf>,
    /// `csv`: the label column [default: a column named label, target, class or y].
    #[serde(default)]
    pub label: Option<String>,
    /// `csv`: regression targets (mean squared error) instead of a class label.
    #[serde(default)]
    pub target_columns: Vec<String>,
    /// The model's input `(height, width, channels)` (images are resized to it; an array must
    /// hold as many values per row) [default: what the files say].
    #[serde(default)]
    pub input_shape: Option<(usize, usize, usize)>,
    /// How a 4-D array orders its values [default: inferred from which axis has 1, 3 or 4].
    #[serde(default)]
    pub layout: Option<Layout>,
    /// Fraction of the rows held out to test when there is no test file.
    pub validation: f64,
    /// Normalisation of the inputs.
    #[serde(default)]
    pub normalize: Normalize,
    /// Seed of the held-out rows' choice.
    #[serde(default)]
    pub split_seed: u64,
}

impl DataSource {
    /// A description of `format` over `files` with the defaults.
    pub fn new(format: &str, files: Vec<PathBuf>) -> Self {
        Self {
            format: format.into(),
            files,
            label_files: Vec::new(),
            label: None,
            target_columns: Vec::new(),
            input_shape: None,
            layout: None,
            validation: 0.1,
            normalize: Normalize::Auto,
            split_seed: 0,
        }
    }

    pub(crate) fn error(&self, reason: impl Into<String>) -> Error {
        Error::Description {
            dataset: self.format.clone(),
            reason: reason.into(),
        }
    }
}

/// Loads the dataset `source` describes.
pub fn load_source(source: &DataSource) -> Result<Dataset> {
    if source.files.is_empty() {
        return Err(source.error(match source.format.as_str() {
            "images" | "cifar10" | "cifar100" => "name its directory with --data-file DIR",
            _ => "name its files with --data-file FILE (training, then an optional test file)",
        }));
    }
    if source.files.len() > 2 {
        return Err(source.error(format!(
            "{} files named: a training file and an optional test file",
            source.files.len()
        )));
    }
    if !(0.0..1.0).contains(&source.validation) {
        return Err(source.error(format!(
            "validation fraction {} is outside [0, 1)",
            source.validation
        )));
    }
    for f in &source.files {
        if !f.exists() {
            return Err(Error::Io {
                path: f.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
    }
    if source.format != "csv" && (source.label.is_some() || !source.target_columns.is_empty()) {
        return Err(source.error("--label and --target-columns name a CSV table's columns"));
    }
    if source.format != "npy" && !source.label_files.is_empty() {
        return Err(source.error("--label-file names the label arrays of .npy inputs"));
    }
    let loaded = match source.format.as_str() {
        "npy" | "npz" => crate::arrays::load(source)?,
        "csv" => crate::table::load(source)?,
        "images" => crate::folder::load(source)?,
        "cifar10" | "cifar100" => crate::cifar::load(source)?,
        other => return Err(Error::UnknownDataset(other.to_string())),
    };
    finish(source, loaded)
}

/// What a format's reader hands on: the rows read and how to read them.
pub(crate) struct Loaded {
    pub train: Arc<RowData>,
    pub test: Option<Arc<RowData>>,
    /// The model's input shape.
    pub shape: (usize, usize, usize),
    /// How the files order an image.
    pub layout: Layout,
    /// Factor applied before normalisation (1/255 for bytes).
    pub scale: f32,
    /// Channels normalised separately (value `j` in channel `j % channels`).
    pub channels: usize,
    /// A table's input columns.
    pub columns: Vec<String>,
    /// A table's label column.
    pub label: Option<String>,
    /// Targets' names (regression).
    pub targets: Vec<String>,
    /// Class names (empty: indices).
    pub class_names: Vec<String>,
    /// Where the files were.
    pub dir: PathBuf,
}

fn finish(source: &DataSource, loaded: Loaded) -> Result<Dataset> {
    let (train_index, test_data, test_index) = match &loaded.test {
        Some(test) => (None, test.clone(), None),
        None => {
            let n = loaded.train.len();
            let held = ((n as f64) * source.validation).round() as usize;
            if held == 0 || held >= n {
                return Err(source.error(format!(
                    "{n} rows and no test file: a validation fraction of {} holds out {held}; \
                     name a test file or change --val-fraction",
                    source.validation
                )));
            }
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(
                source.split_seed,
            ));
            let (mut test, mut train) = (order[..held].to_vec(), order[held..].to_vec());
            // Storage order within each split: a memory-mapped file is then read forwards.
            test.sort_unstable();
            train.sort_unstable();
            (Some(train), loaded.train.clone(), Some(test))
        }
    };
    let features = loaded.shape.0 * loaded.shape.1 * loaded.shape.2;
    if loaded.train.features != features || test_data.features != features {
        return Err(source.error(format!(
            "the training and test files differ in values per row ({} and {})",
            loaded.train.features, test_data.features
        )));
    }
    if loaded.train.labels.width() != test_data.labels.width() {
        return Err(source.error("the training and test labels differ in width"));
    }
    let identity = Normalisation::identity(loaded.scale, loaded.channels);
    let train = Rows::new(loaded.train.clone(), train_index, identity.clone());
    let norm = match &source.normalize {
        Normalize::Auto => Normalisation::measure(&train, loaded.scale, loaded.channels),
        Normalize::None => identity,
        Normalize::Given { mean, std } => {
            let channels = loaded.channels;
            let spread = |v: &Vec<f32>| {
                if v.len() == 1 {
                    Ok(vec![v[0]; channels])
                } else if v.len() == channels {
                    Ok(v.clone())
                } else {
                    Err(source.error(format!(
                        "--normalize gives {} values for {channels} channels",
                        v.len()
                    )))
                }
            };
            Normalisation {
                scale: loaded.scale,
                mean: spread(mean)?,
                std: spread(std)?,
            }
        }
    };
    let mut train = train.with_normalisation(norm.clone());
    let mut test = Rows::new(test_data, test_index, norm.clone());
    // Regression targets are standardised as the inputs are (a network trained on raw prices
    // diverges at any usual rate); the errors are reported back in the targets' units.
    let target_standardisation = match (&source.normalize, train.measure_targets()) {
        (Normalize::None, _) | (_, None) => Vec::new(),
        (_, Some(stats)) => {
            train = train.with_target_standardisation(stats.clone());
            test = test.with_target_standardisation(stats.clone());
            stats
        }
    };
    let (task, classes) = match &loaded.train.labels {
        Labels::Targets { width, .. } => (Task::Regress, *width),
        Labels::Classes(_) => {
            let max = [&loaded.train, loaded.test.as_ref().unwrap_or(&loaded.train)]
                .iter()
                .filter_map(|d| match &d.labels {
                    Labels::Classes(c) => c.iter().max().copied(),
                    Labels::Targets { .. } => None,
                })
                .max()
                .unwrap_or(0) as usize;
            (Task::Classify, (max + 1).max(loaded.class_names.len()))
        }
    };
    if matches!(task, Task::Classify) && classes < 2 {
        return Err(source.error("every label is the same class: nothing to classify"));
    }
    let recipe = InputRecipe {
        dataset: source.format.clone(),
        format: source.format.clone(),
        shape: loaded.shape,
        layout: loaded.layout,
        normalisation: norm,
        columns: loaded.columns,
        label: loaded.label,
        targets: loaded.targets,
        target_standardisation,
        class_names: loaded.class_names,
    };
    Ok(Dataset {
        name: source.format.clone(),
        input: loaded.shape,
        classes,
        train: Split::rows(train),
        test: Split::rows(test),
        source: loaded.dir,
        checks: Vec::new(),
        task,
        recipe,
    })
}

/// The directory a file is in (for the load line).
pub(crate) fn dir_of(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}

/// Checks class indices read as `f64` (from an array or a table) and narrows them.
pub(crate) fn class_indices(path: &Path, values: &[f64]) -> Result<Vec<u32>> {
    values
        .iter()
        .enumerate()
        .map(|(row, &v)| {
            if v < 0.0 || v.fract() != 0.0 || v > f64::from(i32::MAX) {
                Err(Error::Table {
                    path: path.to_path_buf(),
                    row: row as u64 + 1,
                    column: String::new(),
                    reason: format!("label {v} is not a class index (0, 1, 2, …)"),
                })
            } else {
                Ok(v as u32)
            }
        })
        .collect()
}
