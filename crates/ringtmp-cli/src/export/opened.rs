//! A checkpoint of any strategy, whatever its partition, opened as one whole model: the
//! checkpoint a path means (a run's best evaluation's, else its newest), verified, with its
//! input recipe (how training read its inputs) and every layer's parameters.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ringtmp_data::InputRecipe;
use ringtmp_model::{Layer, Shape, Stage, checkpoint};

use crate::error::UsageError;

/// A checkpoint opened as one whole model.
pub struct Opened {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: checkpoint::Manifest,
    /// How the run read its inputs (`None` for checkpoints of language models).
    pub recipe: Option<InputRecipe>,
    /// Every layer of the model.
    pub layers: Vec<Layer>,
    /// The model with the checkpoint's parameters.
    pub stage: Stage,
}

/// The input recipe of a checkpoint written before runs stored theirs: the bundled datasets'.
fn bundled_recipe(dataset: &str) -> Option<InputRecipe> {
    let data = ringtmp_data::load(dataset, None).ok()?;
    Some(data.recipe)
}

/// The checkpoint whose weights `path` means ([`checkpoint::resolve_weights`]: a run's best
/// evaluation's, when it kept one); says so on stderr when that is not the run's last.
pub fn weights_dir(path: &Path) -> Result<std::path::PathBuf> {
    let dir = checkpoint::resolve_weights(path).map_err(|e| UsageError(e.to_string()))?;
    if let Ok(latest) = checkpoint::resolve(path)
        && latest != dir
    {
        eprintln!(
            "using the best evaluation's checkpoint {} (the run's last is {}; name it to use it)",
            dir.display(),
            latest.display()
        );
    }
    Ok(dir)
}

/// Opens the checkpoint `path` means (verifying every file) as one model on `threads` threads.
pub fn open(path: &Path, threads: usize) -> Result<Opened> {
    let dir = weights_dir(path)?;
    let manifest = checkpoint::verify(&dir)?;
    let recipe: Option<InputRecipe> = match &manifest.recipe {
        _ if manifest.model.reads_tokens() => None,
        Some(value) => Some(
            serde_json::from_value(value.clone())
                .with_context(|| format!("{}: the manifest's input recipe", dir.display()))?,
        ),
        None => Some(bundled_recipe(&manifest.dataset).ok_or_else(|| {
            UsageError(format!(
                "{}: the checkpoint does not record its input shape (dataset {:?})",
                dir.display(),
                manifest.dataset
            ))
        })?),
    };
    let outputs = match manifest.model.layers.last() {
        Some(ringtmp_model::LayerSpec::Linear { out, .. }) => *out,
        _ => {
            return Err(UsageError(format!(
                "{}: model {} does not end in a linear layer",
                dir.display(),
                manifest.model.name
            ))
            .into());
        }
    };
    let (input, output) = match (&recipe, checkpoint::context_of(&dir, &manifest)?) {
        (Some(r), _) if !manifest.model.reads_tokens() => {
            let (h, w, c) = r.shape;
            (Shape::image(h, w, c), Shape::flat(outputs))
        }
        (_, Some(ctx)) => (Shape::flat(ctx), Shape(vec![ctx, outputs])),
        _ => {
            return Err(UsageError(format!(
                "{}: cannot tell the model's input shape",
                dir.display()
            ))
            .into());
        }
    };
    let layers = manifest.model.build_for(&input, &output)?;
    let mut stage = Stage::new(&layers, 0..layers.len(), manifest.seed, threads);
    checkpoint::read_params(&dir, &manifest, &mut stage)?;
    Ok(Opened {
        dir,
        manifest,
        recipe,
        layers,
        stage,
    })
}

/// Compute threads: those asked for, or every core.
pub(super) fn threads(requested: Option<usize>) -> usize {
    requested.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
