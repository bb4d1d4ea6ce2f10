//! A user's own dataset as the user describes it ([`DataSource`]: the format, the files, the
//! input shape, the label, the split and the normalisation), and what each format's reader hands
//! on (`Loaded`). The readers (`arrays`, `table`, `folder`, `cifar`) and the loader
//! (`source`) both depend on this file; it depends on none of them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::recipe::Layout;
use crate::rows::RowData;

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

/// The normalisation as `--normalize` writes it, which its `FromStr` reads back.
impl std::fmt::Display for Normalize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |values: &[f32]| {
            values
                .iter()
                .map(f32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            Normalize::Auto => f.write_str("auto"),
            Normalize::None => f.write_str("none"),
            Normalize::Given { mean, std } => write!(f, "{}/{}", list(mean), list(std)),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Layout;

    #[test]
    fn a_normalisation_and_a_layout_read_back_from_their_text() {
        for text in [
            "auto",
            "none",
            "0.5/0.25",
            "0.4914,0.4822,0.4465/0.247,0.2435,0.2616",
        ] {
            let how: Normalize = text.parse().unwrap();
            assert_eq!(how.to_string(), text);
            assert_eq!(how.to_string().parse::<Normalize>().unwrap(), how);
        }
        assert!("1/0".parse::<Normalize>().is_err());
        for layout in [Layout::Nhwc, Layout::Nchw] {
            assert_eq!(layout.to_string().parse::<Layout>().unwrap(), layout);
        }
    }

    #[test]
    fn an_input_shape_reads_back_from_its_text_and_refuses_what_is_not_three_sizes() {
        let shape: crate::InputShape = " 28, 28,1".parse().unwrap();
        assert_eq!(shape.dims(), (28, 28, 1));
        assert_eq!(
            shape.to_string().parse::<crate::InputShape>().unwrap(),
            shape
        );
        for bad in ["28,28", "28,0,1", "a,b,c", "1,2,3,4", ""] {
            let e = bad.parse::<crate::InputShape>().unwrap_err();
            assert!(e.contains("expected H,W,C"), "{bad}: {e}");
        }
    }
}
