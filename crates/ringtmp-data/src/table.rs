//! CSV tables with a header row: every column but the label (or the regression targets) is a
//! numeric input, standardised per column (scikit-learn's `StandardScaler`) unless told
//! otherwise. A label column of small whole numbers gives class indices; of other numbers
//! (fractions, negatives, values of 1,024 and more, numbers written as reals, many varied whole
//! numbers: [`is_quantity`]) regression targets; of text, class names
//! indexed in sorted order (scikit-learn's `LabelEncoder`). Missing values are refused, not
//! imputed: the error names the row and the column.

use std::path::Path;
use std::sync::Arc;

use crate::description::{DataSource, Loaded, dir_of};
use crate::error::{Error, Result};
use crate::recipe::Layout;
use crate::rows::{Dtype, Labels, RowData};

/// A numeric label at or above this is a quantity to regress on, not a class index.
const MAX_CLASS_INDEX: u32 = 1024;

/// Column names taken as the label when none is named, compared case-insensitively.
const LABEL_NAMES: [&str; 4] = ["label", "target", "class", "y"];

/// The rows of one file before labels become indices.
pub(crate) struct Read {
    pub(crate) values: Vec<f32>,
    /// Label cells (classification) or targets (regression), row-major.
    pub(crate) labels: Vec<String>,
    pub(crate) targets: Vec<f32>,
}

/// Whether a numeric label column holds a quantity rather than class indices: a fraction, a
/// negative, a value too large to index a class, a number written as a real one (`68.0`, as
/// pandas writes a column of floats), or whole numbers so many and so varied that they can only
/// be counts or measurements (more than [`MAX_DISTINCT_CLASSES`] distinct values that are also
/// more than a tenth of the rows).
fn is_quantity(reads: &[Read], numbers: &[Vec<f64>]) -> bool {
    let values = || numbers.iter().flatten();
    if values()
        .any(|&v| v.fract() != 0.0 || v < 0.0 || v >= f64::from(MAX_CLASS_INDEX) || !v.is_finite())
    {
        return true;
    }
    let written_as_real = reads
        .iter()
        .flat_map(|r| &r.labels)
        .any(|c| c.contains(['.', 'e', 'E']));
    let distinct: std::collections::BTreeSet<u64> = values().map(|&v| v as u64).collect();
    let rows = values().count();
    written_as_real || (distinct.len() > MAX_DISTINCT_CLASSES && distinct.len() * 10 > rows)
}

/// A cell as an error quotes it: its first 80 characters, and how many more there were (a
/// cell may be megabytes long).
fn quoted(cell: &str) -> String {
    const SHOWN: usize = 80;
    let total = cell.chars().count();
    if total <= SHOWN {
        return cell.to_string();
    }
    let kept: String = cell.chars().take(SHOWN).collect();
    format!("{kept}… ({} more characters)", total - SHOWN)
}

/// More distinct whole-number labels than this, when they are also more than a tenth of the
/// rows, make a quantity (scikit-learn's diabetes target has 214 in 442 rows; its digits, 10).
const MAX_DISTINCT_CLASSES: usize = 100;

#[expect(
    clippy::too_many_lines,
    reason = "a CSV table's reading and its checks, in the order the bytes are met"
)]
pub(crate) fn load(source: &DataSource) -> Result<Loaded> {
    let header = headers(&source.files[0])?;
    let find = |name: &str| -> Result<usize> {
        header.iter().position(|h| h == name).ok_or_else(|| {
            source.error(format!(
                "{}: no column {name:?}; the columns are {}",
                source.files[0].display(),
                header.join(", ")
            ))
        })
    };
    let regression = !source.target_columns.is_empty();
    let (label, targets): (Option<usize>, Vec<usize>) = if regression {
        if source.label.is_some() {
            return Err(source
                .error("--label (a class) and --target-columns (regression) exclude each other"));
        }
        (
            None,
            source
                .target_columns
                .iter()
                .map(|t| find(t))
                .collect::<Result<_>>()?,
        )
    } else {
        let at = match &source.label {
            Some(name) => find(name)?,
            None => header
                .iter()
                .position(|h| LABEL_NAMES.contains(&h.to_ascii_lowercase().as_str()))
                .ok_or_else(|| {
                    source.error(format!(
                        "{}: which column is the label? name it with --label (the columns are {})",
                        source.files[0].display(),
                        header.join(", ")
                    ))
                })?,
        };
        (Some(at), Vec::new())
    };
    let inputs: Vec<usize> = (0..header.len())
        .filter(|i| Some(*i) != label && !targets.contains(i))
        .collect();
    if inputs.is_empty() {
        return Err(source.error("the table has no input columns besides the label"));
    }
    let mut reads = Vec::new();
    for (k, path) in source.files.iter().enumerate() {
        if k > 0 {
            let other = headers(path)?;
            if other != header {
                return Err(source.error(format!(
                    "{} and {} have different columns",
                    source.files[0].display(),
                    path.display()
                )));
            }
        }
        reads.push(read(path, &header, &inputs, label, &targets)?);
    }
    let features = inputs.len();
    // A label column of real numbers (fractions, negatives, or values too large to be class
    // indices) is a quantity: regression on it, as scikit-learn's `type_of_target` decides.
    let mut regression = regression;
    let mut targets = targets;
    if let Some(at) = label {
        let numbers: Option<Vec<Vec<f64>>> = reads
            .iter()
            .map(|r| r.labels.iter().map(|c| c.parse::<f64>().ok()).collect())
            .collect();
        if let Some(numbers) = &numbers {
            for (path, values) in source.files.iter().zip(numbers) {
                if let Some(row) = values.iter().position(|v| !v.is_finite()) {
                    return Err(Error::Table {
                        path: path.clone(),
                        row: row as u64 + 1,
                        column: format!(", column {:?}", header[at]),
                        reason: "the label is not a finite number (a missing value?)".into(),
                    });
                }
            }
        }
        if let Some(numbers) = numbers
            && is_quantity(&reads, &numbers)
        {
            for (r, values) in reads.iter_mut().zip(numbers) {
                r.targets = values.iter().map(|&v| v as f32).collect();
            }
            regression = true;
            targets = vec![at];
        }
    }
    let label = if regression { None } else { label };
    let mut class_names = Vec::new();
    let labels_of = |r: &Read, path: &Path, names: &[String]| -> Result<Labels> {
        if regression {
            return Ok(Labels::Targets {
                values: r.targets.clone(),
                width: targets.len(),
            });
        }
        r.labels
            .iter()
            .enumerate()
            .map(|(row, cell)| {
                if names.is_empty() {
                    return Ok(cell.parse::<u32>().expect("checked whole numbers"));
                }
                names
                    .binary_search(cell)
                    .map(|i| i as u32)
                    .map_err(|_| Error::Table {
                        path: path.to_path_buf(),
                        row: row as u64 + 1,
                        column: format!(", column {:?}", header[label.expect("classifying")]),
                        reason: format!(
                            "class {:?} does not occur in the training file {}",
                            quoted(cell),
                            source.files[0].display()
                        ),
                    })
            })
            .collect::<Result<Vec<u32>>>()
            .map(Labels::Classes)
    };
    if !regression {
        let numeric = reads
            .iter()
            .all(|r| r.labels.iter().all(|c| c.parse::<u32>().is_ok()));
        if !numeric {
            let mut names: Vec<String> = reads[0].labels.clone();
            names.sort_unstable();
            names.dedup();
            class_names = names;
        }
    }
    let mut splits = Vec::new();
    for (r, path) in reads.iter().zip(&source.files) {
        let labels = labels_of(r, path, &class_names)?;
        let bytes = r.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        splits.push(Arc::new(RowData::owned(
            bytes,
            Dtype::F32,
            features,
            labels,
        )));
    }
    let mut splits = splits.into_iter();
    Ok(Loaded {
        train: splits.next().expect("a training file"),
        test: splits.next(),
        shape: (1, 1, features),
        layout: Layout::Nhwc,
        scale: 1.0,
        channels: features,
        columns: inputs.iter().map(|&i| header[i].clone()).collect(),
        label: label.map(|i| header[i].clone()),
        targets: targets.iter().map(|&i| header[i].clone()).collect(),
        class_names,
        dir: dir_of(&source.files[0]),
    })
}

fn reader(path: &Path) -> Result<csv::Reader<std::fs::File>> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_path(path)
        .map_err(|e| csv_error(path, e))
}

/// The header row's names.
pub(crate) fn headers(path: &Path) -> Result<Vec<String>> {
    let mut r = reader(path)?;
    let header: Vec<String> = r
        .headers()
        .map_err(|e| csv_error(path, e))?
        .iter()
        .map(str::to_string)
        .collect();
    if header.iter().all(String::is_empty) {
        return Err(Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: "no header row (the first line names the columns)".into(),
        });
    }
    // A column chosen by name must be one column.
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = header.iter().find(|name| !seen.insert(name.as_str())) {
        return Err(Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!(
                "the header names column {:?} twice: every column needs a name of its own",
                quoted(twice)
            ),
        });
    }
    Ok(header)
}

fn csv_error(path: &Path, e: csv::Error) -> Error {
    match e.kind() {
        csv::ErrorKind::UnequalLengths {
            pos,
            expected_len,
            len,
        } => Error::Table {
            path: path.to_path_buf(),
            // The header is record 0, so a data row's record number is its row.
            row: pos.as_ref().map_or(0, |p| p.record()),
            column: String::new(),
            reason: format!(
                "{len} fields, but the header names {expected_len} (a ragged row, line {})",
                pos.as_ref().map_or(0, |p| p.line())
            ),
        },
        csv::ErrorKind::Io(_) => Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        },
        _ => Error::Format {
            path: path.to_path_buf(),
            offset: e.position().map_or(0, |p| p.byte()),
            reason: e.to_string(),
        },
    }
}

/// Reads every data row of `path`: the `inputs` columns as numbers, the label cell as text, the
/// `targets` as numbers.
pub(crate) fn read(
    path: &Path,
    header: &[String],
    inputs: &[usize],
    label: Option<usize>,
    targets: &[usize],
) -> Result<Read> {
    let mut r = reader(path)?;
    let mut out = Read {
        values: Vec::new(),
        labels: Vec::new(),
        targets: Vec::new(),
    };
    let mut record = csv::StringRecord::new();
    let mut row = 0u64;
    while r.read_record(&mut record).map_err(|e| csv_error(path, e))? {
        row += 1;
        let number = |col: usize| -> Result<f32> {
            let cell = &record[col];
            let bad = |reason: String| Error::Table {
                path: path.to_path_buf(),
                row,
                column: format!(", column {:?}", header[col]),
                reason,
            };
            if cell.is_empty() {
                return Err(bad(
                    "empty cell (missing values are not imputed: fill or drop them first)".into(),
                ));
            }
            match cell.parse::<f32>() {
                Ok(v) if v.is_finite() => Ok(v),
                Ok(_) => Err(bad(format!("{:?} is not a finite number", quoted(cell)))),
                Err(_) => Err(bad(format!("{:?} is not a number", quoted(cell)))),
            }
        };
        for &c in inputs {
            out.values.push(number(c)?);
        }
        for &c in targets {
            out.targets.push(number(c)?);
        }
        if let Some(c) = label {
            if record[c].is_empty() {
                return Err(Error::Table {
                    path: path.to_path_buf(),
                    row,
                    column: format!(", column {:?}", header[c]),
                    reason: "empty label".into(),
                });
            }
            out.labels.push(record[c].to_string());
        }
    }
    if row == 0 {
        return Err(Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: "a header and no data rows".into(),
        });
    }
    Ok(out)
}
