//! Whether a checkpoint may continue this run: the model, data (and its vocabulary), data order
//! and optimizer it was written for, whichever strategy and partition wrote it.

use std::path::Path;

use ringtmp_data::Dataset;
use ringtmp_model::checkpoint::{self, Manifest};

use crate::config::TrainConfig;
use crate::error::{Error, Result};

/// Finds the checkpoint `path` means and checks that it was written for this run's model, data
/// order (dataset, batch size, seed) and optimizer; any strategy and any partition may have
/// written it. Returns its directory and manifest.
pub fn check_resume(
    path: &Path,
    cfg: &TrainConfig,
    data: &Dataset,
) -> Result<(std::path::PathBuf, Manifest)> {
    let dir = checkpoint::resolve(path)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let mismatch = |what: &str, theirs: String, ours: String| {
        Err(Error::Config(format!(
            "cannot resume from {}: it was written with {what} {theirs}, this run uses {ours}",
            dir.display()
        )))
    };
    // The vocabulary first: a preset's shapes follow it, so a model mismatch may be only this.
    let vocabulary = crate::spec::vocabulary_of(data);
    if manifest.vocabulary != vocabulary {
        let parse = |line: &Option<String>| {
            line.as_deref()
                .map(|l| ringtmp_data::Vocabulary::from_line(l, "vocabulary"))
        };
        let why = match (parse(&manifest.vocabulary), parse(&vocabulary)) {
            (Some(Ok(theirs)), Some(Ok(ours))) => theirs
                .check_matches(&ours)
                .err()
                .unwrap_or_else(|| "the vocabularies differ".into()),
            _ => "one of them is a language model's and the other is not".into(),
        };
        return Err(Error::Config(format!(
            "cannot resume from {}: its vocabulary is not this data's: {why}",
            dir.display()
        )));
    }
    if manifest.model.layers != cfg.model.layers {
        let (theirs, ours) = if manifest.model.name == cfg.model.name {
            // One name, other layers (another vocabulary or file): say how they differ.
            (
                format!("{} ({:?})", manifest.model.name, manifest.model.layers),
                format!("{:?}", cfg.model.layers),
            )
        } else {
            (manifest.model.name.clone(), cfg.model.name.clone())
        };
        return mismatch("model", theirs, ours);
    }
    if manifest.dataset != cfg.dataset {
        return mismatch("dataset", manifest.dataset.clone(), cfg.dataset.clone());
    }
    if manifest.batch_size != cfg.batch_size {
        return mismatch(
            "batch size",
            manifest.batch_size.to_string(),
            cfg.batch_size.to_string(),
        );
    }
    if manifest.seed != cfg.seed {
        return mismatch("seed", manifest.seed.to_string(), cfg.seed.to_string());
    }
    if std::mem::discriminant(&manifest.optimizer) != std::mem::discriminant(&cfg.optimizer) {
        return mismatch(
            "optimizer",
            format!("{:?}", manifest.optimizer),
            format!("{:?}", cfg.optimizer),
        );
    }
    Ok((dir, manifest))
}
