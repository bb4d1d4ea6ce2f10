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

use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::dataset::{Dataset, Split, Task};
use crate::description::{DataSource, Loaded, Normalize};
use crate::error::{Error, Result};
use crate::recipe::InputRecipe;
use crate::rows::{Labels, Normalisation, Rows};

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
    // A class the test file holds and the training file never shows could not be learned:
    // refused, naming its row, where the classes are the data's own (class names are checked
    // as they are read; CIFAR's are the format's, whatever a small training file holds).
    if matches!(source.format.as_str(), "csv" | "npy" | "npz")
        && let (Labels::Classes(train), Some(test)) = (&loaded.train.labels, &loaded.test)
        && let Labels::Classes(tested) = &test.labels
    {
        let seen: std::collections::BTreeSet<u32> = train.iter().copied().collect();
        if let Some(row) = tested.iter().position(|c| !seen.contains(c)) {
            let test_file = source.files.get(1).or(source.label_files.get(1));
            return Err(source.error(format!(
                "{}: row {} has class {}, which the training file never shows (it has {} \
                 classes: {:?}…)",
                test_file.map_or_else(|| "the test file".into(), |f| f.display().to_string()),
                row + 1,
                tested[row],
                seen.len(),
                seen.iter().take(8).collect::<Vec<_>>()
            )));
        }
    }
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
