//! A user's inputs read for prediction as a run's [`InputRecipe`] says: the same columns, layout,
//! image size and normalisation as training read, from whichever file kind the user has (the
//! kind follows the file: `.csv`, `.npy`, `.npz`, `.bin`, an image, or a folder of them).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::npy;
use crate::recipe::{InputRecipe, Layout};
use crate::rows::{Labels, RowData};

/// A user's inputs read as a recipe says, for prediction.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// Normalised inputs `[rows, features]`, in the model's order.
    pub x: Vec<f32>,
    /// Rows read.
    pub rows: usize,
    /// The rows' labels, when the files carry them (a table's label column, class folders,
    /// CIFAR records): class indices, or regression targets in their own units.
    pub labels: Option<crate::rows::Labels>,
    /// Where each row came from (`file`, `file:row`), for a prediction file's first column.
    pub names: Vec<String>,
}

/// Reads at most `limit` rows of `path` as `recipe` says training read its rows: a `.csv` table
/// (the recipe's columns, by name, in any order; the label or targets when present), an `.npy`
/// array `[rows, …]` in the recipe's layout, an `.npz` (`x_test`, else `x`), a directory of
/// images or of class folders, or one PNG/JPEG image (resized to the input shape).
pub fn read_inputs(recipe: &InputRecipe, path: &Path, limit: Option<usize>) -> Result<Inputs> {
    let limit = limit.unwrap_or(usize::MAX);
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut inputs = if path.is_dir() || matches!(ext.as_str(), "png" | "jpg" | "jpeg") {
        images(recipe, path, limit)?
    } else {
        match ext.as_str() {
            "csv" => table(recipe, path, limit)?,
            "npy" => array(recipe, path, &std::fs::read(path).map_err(io(path))?, limit)?,
            "npz" => {
                let members = npy::read_npz(path)?;
                let member = ["x_test", "x"]
                    .iter()
                    .find_map(|want| members.iter().find(|(n, _)| n == want))
                    .ok_or_else(|| Error::Description {
                        dataset: "predict".into(),
                        reason: format!("{}: holds no x_test or x array", path.display()),
                    })?;
                array(recipe, &npy::member_path(path, &member.0), &member.1, limit)?
            }
            "bin" if recipe.format.starts_with("cifar") => {
                let data = crate::cifar::read_batch(&recipe.format, path)?;
                rows_of(recipe, &data, path, limit)
            }
            _ => {
                return Err(Error::Description {
                    dataset: "predict".into(),
                    reason: format!(
                        "{}: read .csv tables, .npy/.npz arrays, PNG/JPEG images or a folder \
                         of them",
                        path.display()
                    ),
                });
            }
        }
    };
    normalise(recipe, &mut inputs.x);
    Ok(inputs)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// `x = v · scale / std[c] − mean[c] / std[c]`, channel `c = j mod channels`.
fn normalise(recipe: &InputRecipe, x: &mut [f32]) {
    let affine = recipe.normalisation.affine();
    let channels = affine.len().max(1);
    for (j, v) in x.iter_mut().enumerate() {
        let (a, b) = affine[j % recipe.features() % channels];
        *v = *v * a + b;
    }
}

fn table(recipe: &InputRecipe, path: &Path, limit: usize) -> Result<Inputs> {
    if recipe.columns.is_empty() {
        return Err(Error::Description {
            dataset: "predict".into(),
            reason: format!(
                "{}: this model was trained on {} data, not a table",
                path.display(),
                recipe.format
            ),
        });
    }
    let header = crate::table::headers(path)?;
    let at = |name: &String| header.iter().position(|h| h == name);
    let inputs: Vec<usize> = recipe
        .columns
        .iter()
        .map(|c| {
            at(c).ok_or_else(|| Error::Description {
                dataset: "predict".into(),
                reason: format!(
                    "{}: no column {c:?} (the model reads {})",
                    path.display(),
                    recipe.columns.join(", ")
                ),
            })
        })
        .collect::<Result<_>>()?;
    // The label or targets, when the file has them, to score the predictions.
    let label = recipe.label.as_ref().and_then(at);
    let targets: Vec<usize> = recipe.targets.iter().filter_map(at).collect();
    let targets = if targets.len() == recipe.targets.len() {
        targets
    } else {
        Vec::new()
    };
    let read = crate::table::read(path, &header, &inputs, label, &targets)?;
    let rows = (read.values.len() / inputs.len()).min(limit);
    let labels = if !targets.is_empty() {
        Some(Labels::Targets {
            values: read.targets[..rows * targets.len()].to_vec(),
            width: targets.len(),
        })
    } else if label.is_some() {
        let classes: Option<Vec<u32>> = read.labels[..rows]
            .iter()
            .map(|cell| {
                if recipe.class_names.is_empty() {
                    cell.parse().ok()
                } else {
                    recipe
                        .class_names
                        .iter()
                        .position(|n| n == cell)
                        .map(|i| i as u32)
                }
            })
            .collect();
        classes.map(Labels::Classes)
    } else {
        None
    };
    Ok(Inputs {
        x: read.values[..rows * inputs.len()].to_vec(),
        rows,
        labels,
        names: (1..=rows)
            .map(|r| format!("{}:{r}", path.display()))
            .collect(),
    })
}

fn array(recipe: &InputRecipe, path: &Path, bytes: &[u8], limit: usize) -> Result<Inputs> {
    let header = npy::parse_header(path, bytes)?;
    let features = recipe.features();
    let per_row: usize = header.shape.iter().skip(1).product();
    let numeric = header.kind.is_float() || header.kind == npy::Kind::U8;
    if header.shape.len() < 2 || per_row != features || !numeric {
        return Err(Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!(
                "shape {:?} of {}: the model reads rows of {features} values ({}×{}×{}) of \
                 uint8 or floats",
                header.shape, header.descr, recipe.shape.0, recipe.shape.1, recipe.shape.2
            ),
        });
    }
    let rows = header.shape[0].min(limit);
    let values = npy::values_f64(&header, bytes);
    let (h, w, c) = recipe.shape;
    let mut x = Vec::with_capacity(rows * features);
    for row in values.chunks_exact(features).take(rows) {
        match recipe.layout {
            Layout::Nhwc => x.extend(row.iter().map(|&v| v as f32)),
            Layout::Nchw => {
                for p in 0..h * w {
                    for ch in 0..c {
                        x.push(row[ch * h * w + p] as f32);
                    }
                }
            }
        }
    }
    Ok(Inputs {
        x,
        rows,
        labels: None,
        names: (0..rows)
            .map(|r| format!("{}[{r}]", path.display()))
            .collect(),
    })
}

fn images(recipe: &InputRecipe, path: &Path, limit: usize) -> Result<Inputs> {
    let (h, w, c) = recipe.shape;
    if !matches!(c, 1 | 3) || recipe.format == "csv" {
        return Err(Error::Description {
            dataset: "predict".into(),
            reason: format!(
                "{}: this model reads {h}×{w}×{c} {} inputs, not images",
                path.display(),
                recipe.format
            ),
        });
    }
    // One image, a folder of images, or a folder of class folders (then labelled).
    let mut files: Vec<(PathBuf, Option<u32>)> = Vec::new();
    if path.is_file() {
        files.push((path.to_path_buf(), None));
    } else {
        let classes = crate::folder::class_folders(path)?;
        if classes.is_empty() {
            files.extend(
                crate::folder::images_in(path)?
                    .into_iter()
                    .map(|f| (f, None)),
            );
        } else {
            for class in classes {
                let index = recipe
                    .class_names
                    .iter()
                    .position(|n| *n == class)
                    .or_else(|| class.parse::<usize>().ok())
                    .map(|i| i as u32);
                for f in crate::folder::images_in(&path.join(&class))? {
                    files.push((f, index));
                }
            }
        }
    }
    files.truncate(limit);
    let mut x = Vec::with_capacity(files.len() * h * w * c);
    for (file, _) in &files {
        x.extend(
            crate::folder::pixels_of(file, recipe.shape, true)?
                .into_iter()
                .map(f32::from),
        );
    }
    let labels = files
        .iter()
        .map(|(_, l)| *l)
        .collect::<Option<Vec<u32>>>()
        .map(Labels::Classes);
    Ok(Inputs {
        rows: files.len(),
        x,
        labels,
        names: files.iter().map(|(f, _)| f.display().to_string()).collect(),
    })
}

fn rows_of(recipe: &InputRecipe, data: &RowData, path: &Path, limit: usize) -> Inputs {
    let rows = data.len().min(limit);
    let mut x = Vec::with_capacity(rows * recipe.features());
    for r in 0..rows {
        data.raw_row(r, &mut x);
    }
    let labels = match &data.labels {
        Labels::Classes(c) => Some(Labels::Classes(c[..rows].to_vec())),
        Labels::Targets { .. } => None,
    };
    Inputs {
        x,
        rows,
        labels,
        names: (0..rows)
            .map(|r| format!("{}[{r}]", path.display()))
            .collect(),
    }
}
