//! What turns a user's raw example into the model's input: the columns read, the layout, the
//! per-channel normalisation and the names of the classes. A run stores it with its checkpoints,
//! so `predict` and `export` read new data exactly as training read it.

use serde::{Deserialize, Serialize};

use crate::rows::Normalisation;

/// How the values of a stored image are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Channels last (`[N, H, W, C]`: NumPy images, Keras, the model's own order).
    #[default]
    Nhwc,
    /// Channels first (`[N, C, H, W]`: PyTorch tensors, CIFAR's binaries).
    Nchw,
}

impl std::str::FromStr for Layout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "nhwc" => Ok(Layout::Nhwc),
            "nchw" => Ok(Layout::Nchw),
            other => Err(format!("layout {other:?}: expected nhwc or nchw")),
        }
    }
}

/// The layout as `--layout` writes it.
impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::Nhwc => "nhwc",
            Layout::Nchw => "nchw",
        })
    }
}

/// `--input-shape H,W,C`: a model's per-example input, three positive sizes (a table of F
/// columns is `1,1,F`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputShape(pub usize, pub usize, pub usize);

impl InputShape {
    /// `(height, width, channels)`.
    pub fn dims(self) -> (usize, usize, usize) {
        (self.0, self.1, self.2)
    }
}

impl std::str::FromStr for InputShape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let dims: Vec<usize> = s
            .split(',')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .ok()
            .filter(|d: &Vec<usize>| d.len() == 3 && d.iter().all(|&x| x > 0))
            .ok_or_else(|| {
                format!(
                    "{s:?}: expected H,W,C (three positive sizes; a table of F columns is 1,1,F)"
                )
            })?;
        Ok(Self(dims[0], dims[1], dims[2]))
    }
}

/// The shape as `--input-shape` writes it.
impl std::fmt::Display for InputShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{}", self.0, self.1, self.2)
    }
}

/// A dataset's input recipe (see the module header).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputRecipe {
    /// Dataset name.
    pub dataset: String,
    /// Format its files were read in (`idx`, `csv`, `npy`, `npz`, `images`, `cifar10`,
    /// `cifar100`, `text`).
    pub format: String,
    /// The model's per-example input `(height, width, channels)`.
    pub shape: (usize, usize, usize),
    /// How the stored files order an image's values.
    #[serde(default)]
    pub layout: Layout,
    /// Normalisation of the stored values.
    pub normalisation: Normalisation,
    /// A table's input columns, in the model's order (empty for arrays and images).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<String>,
    /// A table's label column (classification).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Regression targets' names (a table's columns, else `target0`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
    /// Regression: each target's `(mean, std)` over the training split; the model is trained on
    /// `(t − mean) / std`, so an output `o` predicts `o · std + mean` (empty: not standardised).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_standardisation: Vec<(f32, f32)>,
    /// Class `i`'s name (empty: classes are their indices).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub class_names: Vec<String>,
}

impl InputRecipe {
    /// A recipe that passes values through (token ids, and the base of the others).
    pub fn tokens(dataset: &str) -> Self {
        Self {
            dataset: dataset.to_string(),
            format: "text".into(),
            shape: (1, 1, 1),
            layout: Layout::Nhwc,
            normalisation: Normalisation::identity(1.0, 1),
            columns: Vec::new(),
            label: None,
            targets: Vec::new(),
            target_standardisation: Vec::new(),
            class_names: Vec::new(),
        }
    }

    /// Values per example.
    pub fn features(&self) -> usize {
        self.shape.0 * self.shape.1 * self.shape.2
    }
}
