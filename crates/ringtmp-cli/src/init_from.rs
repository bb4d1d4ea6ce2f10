//! `--init-from FILE.safetensors [--weight-map MAP]`: weights trained elsewhere start a run.
//!
//! The file's tensors are matched by name through the map (PyTorch's `nn.Sequential`, nanoGPT's
//! `GPT`, or ringtmp's own; told apart by their names when no map is given), converted to
//! ringtmp's layouts and checked against the model before any node starts: every missing,
//! unmatched or misshapen tensor is listed in one usage error (exit 2). What matched is written
//! as a checkpoint of step 0 in the run's directory (`init/`), which every strategy's stages load
//! by name whatever their partition.

use std::path::{Path, PathBuf};

use anyhow::Result;
use ringtmp_data::Dataset;
use ringtmp_model::interop::{self, NameMap};
use ringtmp_model::{Stage, checkpoint};
use ringtmp_strategy::TrainConfig;

use crate::args::TrainArgs;
use crate::error::UsageError;

/// Where, inside a run's directory, the converted initial weights are: a checkpoint directory of
/// its own folder (whose `latest` is not the run's).
pub fn init_dir(out: &Path) -> PathBuf {
    out.join("init").join(checkpoint::checkpoint_dir_name(0))
}

/// The initial weights, converted and checked, ready to be written.
pub struct Converted {
    stage: Stage,
    map: NameMap,
    file: PathBuf,
}

/// The map whose names `names` use: ringtmp's (`layers.`), nanoGPT's (`transformer.`), or else
/// an `nn.Sequential`'s.
fn guess_map<'a>(mut names: impl Iterator<Item = &'a String>) -> NameMap {
    let first = names.next().map(String::as_str).unwrap_or("");
    if first.starts_with("layers.") {
        NameMap::Ringtmp
    } else if first.starts_with("transformer.") || first.starts_with("lm_head.") {
        NameMap::NanoGpt
    } else {
        NameMap::Pytorch
    }
}

/// Reads and checks `--init-from` for the run `cfg` on `data`; `None` without the flag.
pub fn convert(args: &TrainArgs, cfg: &TrainConfig, data: &Dataset) -> Result<Option<Converted>> {
    let Some(file) = &args.init_from else {
        if args.weight_map.is_some() {
            return Err(UsageError("--weight-map names the map of --init-from".into()).into());
        }
        return Ok(None);
    };
    if args.resume.is_some() {
        return Err(UsageError(
            "--init-from starts a run from other weights; --resume continues a run: keep one"
                .into(),
        )
        .into());
    }
    let usage = |what: String| UsageError(format!("--init-from {}: {what}", file.display()));
    let tensors = interop::read_safetensors(file).map_err(|e| usage(e.to_string()))?;
    // One NaN weight would start every node and end the run as a divergence.
    for (name, (shape, values)) in &tensors {
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            return Err(usage(format!(
                "tensor {name:?} (shape {shape:?}) holds {} at element {at}: the weights are \
                 not finite",
                values[at]
            ))
            .into());
        }
    }
    let map = match &args.weight_map {
        Some(m) => m.parse().map_err(|e: String| usage(e))?,
        None => guess_map(tensors.keys()),
    };
    let layers = ringtmp_strategy::layers_for(&cfg.model, data)?;
    let mut stage = Stage::new(&layers, 0..layers.len(), cfg.seed, 1);
    let mut params = stage.params().to_vec();
    let report = interop::from_foreign(&layers, &tensors, map, &mut params)
        .map_err(|e| usage(e.to_string()))?;
    if report.loaded == 0 {
        return Err(usage(format!(
            "no tensor of the file is one of the model's under {map} names; the file holds {}",
            tensors
                .keys()
                .take(6)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .into());
    }
    if !report.is_complete() {
        return Err(usage(format!(
            "does not fit model {} under {map} names: {}",
            cfg.model.name,
            report.describe()
        ))
        .into());
    }
    stage.params_mut().copy_from_slice(&params);
    eprintln!(
        "init-from {}: {} tensors ({} parameters) under {map} names{}",
        file.display(),
        report.loaded,
        params.len(),
        if report.zeroed.is_empty() {
            String::new()
        } else {
            format!(
                "; {} start at zero (the map has none)",
                report.zeroed.join(", ")
            )
        }
    );
    Ok(Some(Converted {
        stage,
        map,
        file: file.clone(),
    }))
}

impl Converted {
    /// Writes the weights as a checkpoint of step 0 in `dir` for the run `cfg`.
    pub fn write(&self, dir: &Path, cfg: &TrainConfig) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
        let entry =
            checkpoint::write_params(dir, "stage-0.safetensors", &self.stage, self.stage.params())?;
        let manifest = checkpoint::Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            strategy: format!("init-from {} ({})", self.file.display(), self.map),
            step: 0,
            epoch: 0,
            batch_in_epoch: 0,
            dataset: cfg.dataset.clone(),
            batch_size: cfg.batch_size,
            seed: cfg.seed,
            model: cfg.model.clone(),
            partition: vec![(0, self.stage.layers().len())],
            optimizer: cfg.optimizer.clone(),
            lr: None,
            files: vec![entry],
            replicas: Vec::new(),
            vocabulary: None,
            context: None,
            objective: Default::default(),
            recipe: None,
        };
        checkpoint::write_manifest(dir, &manifest)?;
        Ok(())
    }
}
