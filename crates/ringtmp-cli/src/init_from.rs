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
use ringtmp_model::arch::{self, Architecture};
use ringtmp_model::interop::{self, NameMap};
use ringtmp_model::{ModelSpec, Stage, checkpoint};
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
    /// The whole model holding them.
    pub stage: Stage,
    /// The manifest of the checkpoint of step 0 they are written as.
    pub manifest: checkpoint::Manifest,
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
    let Some(file) = &args.model.init_from else {
        if args.model.weight_map.is_some() {
            return Err(UsageError("--weight-map names the map of --init-from".into()).into());
        }
        return Ok(None);
    };
    if args.output.resume.is_some() {
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
    let map = args
        .model
        .weight_map
        .unwrap_or_else(|| guess_map(tensors.keys()));
    check_architecture(file, cfg, data)?;
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
    let mut manifest = ringtmp_strategy::RunSpec::new(cfg.clone(), data, 1)?.manifest(
        &format!("init-from {} ({map})", file.display()),
        0,
        cfg.batch_size,
        vec![(0, stage.layers().len())],
        Vec::new(),
        Vec::new(),
    );
    manifest.lr = None;
    Ok(Some(Converted { stage, manifest }))
}

/// Compares the architecture the file states (its metadata, or a `config.json` beside it) with
/// the model's: a difference is a usage error naming both; a transformer whose file does not
/// state its head count is loaded with a warning, since nothing in its tensors tells.
fn check_architecture(file: &Path, cfg: &TrainConfig, data: &Dataset) -> Result<()> {
    let usage = |what: String| UsageError(format!("--init-from {}: {what}", file.display()));
    let Some(model) = Architecture::of(&cfg.model, ringtmp_strategy::sequence_of(data)) else {
        return Ok(());
    };
    let stated = arch::stated_by(file).map_err(|e| usage(e.to_string()))?;
    let Some((stated, source)) = stated.filter(|(a, _)| a.heads.is_some()) else {
        eprintln!(
            "WARNING: --init-from {}: the file does not say how many attention heads its              weights were trained with (no n_head in its metadata, no config.json beside it);              they load as model {}'s {} — weights trained with another count load as well,              and start worse",
            file.display(),
            cfg.model.name,
            model.describe()
        );
        return Ok(());
    };
    let differences = stated.differences(&model);
    if differences.is_empty() {
        return Ok(());
    }
    let listed: Vec<String> = differences
        .iter()
        .map(|(field, theirs, ours)| format!("{field} {theirs} where the model has {ours}"))
        .collect();
    let preset = match (stated.blocks, stated.heads, stated.width) {
        (Some(b), Some(h), Some(w)) => ModelSpec::gpt_preset_shaped(b, h, w),
        _ => None,
    };
    let remedy = match (preset, differences.as_slice()) {
        (_, [("context", theirs, _)]) => format!("pass --seq-len {theirs}"),
        (Some(preset), _) => match stated.context {
            Some(c) if ModelSpec::preset_context(preset) != Some(c) => {
                format!("--model {preset} --seq-len {c} has that shape")
            }
            _ => format!("--model {preset} has that shape"),
        },
        (None, _) => format!(
            "describe that model in a file for --model-file ({}; `ringtmp validate-config`              prints a model's layers)",
            stated.describe()
        ),
    };
    Err(usage(format!(
        "its weights were trained as another model than {} ({source} says): {}; {remedy}",
        cfg.model.name,
        listed.join(", ")
    ))
    .into())
}

impl Converted {
    /// Writes the weights as a checkpoint of step 0 in `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
        let entry =
            checkpoint::write_params(dir, "stage-0.safetensors", &self.stage, self.stage.params())?;
        let mut manifest = self.manifest.clone();
        manifest.files = vec![entry];
        checkpoint::write_manifest(dir, &manifest)?;
        Ok(())
    }
}
