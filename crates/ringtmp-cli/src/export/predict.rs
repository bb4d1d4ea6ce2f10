//! `ringtmp predict`: a checkpoint run on a user's inputs read as training read them, its
//! outputs written as an `.npy` array or one CSV line per row (a class's name and probability,
//! or each target in its units); a language model's next-token logits for windows of ids.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ringtmp_data::InputRecipe;

use crate::error::UsageError;

use super::opened::{Opened, open, threads};
use super::outputs::{inputs_outputs, outputs_of, score_of};

/// `ringtmp predict` options.
#[derive(clap::Args)]
pub struct PredictArgs {
    /// A checkpoint directory, or a run directory (its newest checkpoint).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "pretrained",
        conflicts_with = "pretrained"
    )]
    pub checkpoint: Option<PathBuf>,
    /// A pretrained model (a `.gguf` file or a Hugging Face directory): every position's
    /// logits for --prompt-ids or --text, as `[positions, vocabulary]`.
    #[arg(long, value_name = "PATH")]
    pub pretrained: Option<PathBuf>,
    /// With --pretrained: the token ids (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        requires = "pretrained",
        conflicts_with = "text"
    )]
    pub prompt_ids: Option<Vec<u32>>,
    /// With --pretrained: the text, tokenized by the model's tokenizer (BOS first where the
    /// model frames its sequences with one).
    #[arg(long, requires = "pretrained")]
    pub text: Option<String>,
    /// The inputs: a .csv table with the training columns, an .npy/.npz array, a PNG/JPEG image
    /// or a folder of them [default: the bundled dataset's test split, for a model trained on
    /// one].
    #[arg(long, value_name = "FILE")]
    pub data_file: Option<PathBuf>,
    /// Predict for the first N rows only.
    #[arg(long, value_name = "N", value_parser = crate::args::at_least_one)]
    pub limit: Option<usize>,
    /// Write the outputs as an .npy array `[rows, outputs]`: class logits, or regression
    /// predictions in the targets' units.
    #[arg(long, value_name = "OUT.npy")]
    pub logits: Option<PathBuf>,
    /// Write one line per row: its source, the prediction (a class's name, or each target), and
    /// for classes the predicted class's probability.
    #[arg(long, value_name = "OUT.csv")]
    pub csv: Option<PathBuf>,
    /// Compute threads [default: all cores].
    #[arg(long, value_parser = crate::args::at_least_one)]
    pub threads: Option<usize>,
}

/// `ringtmp predict`.
pub fn predict(a: &PredictArgs) -> Result<()> {
    if a.logits.is_none() && a.csv.is_none() {
        return Err(UsageError(
            "predict writes --logits OUT.npy or --csv OUT.csv (or both); name one".into(),
        )
        .into());
    }
    let threads = threads(a.threads);
    crate::plan::init_threads(threads)?;
    if let Some(path) = &a.pretrained {
        return predict_pretrained(a, path, threads);
    }
    let checkpoint = a
        .checkpoint
        .as_deref()
        .expect("clap: --checkpoint or --pretrained");
    let mut opened = open(checkpoint, threads)?;
    let Some(recipe) = opened.recipe.clone() else {
        return predict_tokens(a, &mut opened);
    };
    let run = outputs_of(&mut opened, &recipe, a.data_file.as_deref(), a.limit)?;
    if let Some(path) = &a.logits {
        ringtmp_data::npy::write_f32(path, &[run.inputs.rows, run.width], &run.values)?;
    }
    if let Some(path) = &a.csv {
        write_csv(
            path,
            &recipe,
            &run.inputs.names,
            &run.values,
            run.width,
            run.regression,
        )?;
    }
    let score = score_of(&run)
        .map(|s| format!("; {} against the inputs' labels", s.line()))
        .unwrap_or_default();
    eprintln!(
        "predict: {} rows with {} from {} step {}{score}",
        run.inputs.rows, opened.manifest.model.name, opened.manifest.strategy, opened.manifest.step
    );
    Ok(())
}

/// A language model's logits for windows of token ids (an `.npy` of integers `[rows, seq]`):
/// `[rows, seq, vocabulary]`. Text is continued by `ringtmp generate`.
fn predict_tokens(a: &PredictArgs, opened: &mut Opened) -> Result<()> {
    let (Some(path), Some(out)) = (&a.data_file, &a.logits) else {
        return Err(UsageError(
            "a language model predicts the next token's logits for an .npy of token ids \
             [rows, seq] (--data-file IDS.npy --logits OUT.npy); `ringtmp generate` continues text"
                .into(),
        )
        .into());
    };
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    let header = ringtmp_data::npy::parse_header(path, &bytes)?;
    let seq = opened.layers[0].input.numel();
    let vocab = opened.layers.last().map_or(0, |l| l.output.numel() / seq);
    let ids = ringtmp_data::npy::values_f64(&header, &bytes);
    let bad = |why: String| UsageError(format!("{}: {why}", path.display()));
    if header.kind.is_float() || header.shape.len() != 2 || header.shape[1] != seq {
        return Err(bad(format!(
            "shape {:?} of {}: token ids are integers [rows, {seq}]",
            header.shape, header.descr
        ))
        .into());
    }
    if let Some(id) = ids.iter().find(|&&v| v < 0.0 || v >= vocab as f64) {
        return Err(bad(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))
        .into());
    }
    let rows = header.shape[0].min(a.limit.unwrap_or(usize::MAX));
    let x: Vec<f32> = ids[..rows * seq].iter().map(|&v| v as f32).collect();
    let logits = inputs_outputs(&mut opened.stage, &x, rows)?;
    ringtmp_data::npy::write_f32(out, &[rows, seq, vocab], &logits)?;
    eprintln!(
        "predict: next-token logits for {rows} windows of {seq} with {} from {} step {}",
        opened.manifest.model.name, opened.manifest.strategy, opened.manifest.step
    );
    Ok(())
}

/// `--pretrained`: every position's logits for the given ids or text.
fn predict_pretrained(a: &PredictArgs, path: &Path, threads: usize) -> Result<()> {
    let (Some(out), None) = (&a.logits, &a.csv) else {
        return Err(UsageError(
            "a pretrained model's predictions are its logits: --logits OUT.npy".into(),
        )
        .into());
    };
    let (model, ids) = match (&a.prompt_ids, &a.text) {
        (Some(ids), _) => {
            let model = crate::pretrained::open_model(path)?;
            let vocab = model.config.vocab;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(UsageError(format!(
                    "--prompt-ids: id {bad} is past the model's vocabulary of {vocab}"
                ))
                .into());
            }
            (model, ids.clone())
        }
        (None, Some(text)) => {
            let opened = crate::pretrained::open(path)?;
            let ids = opened.text_prompt(text)?;
            (opened.model, ids)
        }
        (None, None) => {
            return Err(UsageError(
                "--pretrained predicts for --prompt-ids 1,2,3 or --text \"…\"".into(),
            )
            .into());
        }
    };
    if ids.is_empty() || ids.len() > model.config.context {
        return Err(UsageError(format!(
            "{} tokens: the model takes 1 to its context of {}",
            ids.len(),
            model.config.context
        ))
        .into());
    }
    let layers = model
        .layers(ids.len())
        .map_err(|e| UsageError(e.to_string()))?;
    let mut stage = model
        .stage(&layers, 0..layers.len(), threads)
        .map_err(|e| UsageError(e.to_string()))?;
    let x: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    let logits = stage.infer(&x, 1)?;
    let vocab = model.config.vocab;
    ringtmp_data::npy::write_f32(out, &[ids.len(), vocab], logits)?;
    eprintln!(
        "predict: logits of {} positions over {vocab} tokens from {} into {}",
        ids.len(),
        path.display(),
        out.display()
    );
    Ok(())
}

fn write_csv(
    path: &Path,
    recipe: &InputRecipe,
    names: &[String],
    values: &[f32],
    width: usize,
    regression: bool,
) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| path.display().to_string())?;
    if regression {
        let targets: Vec<String> = if recipe.targets.len() == width {
            recipe.targets.clone()
        } else {
            (0..width).map(|i| format!("target{i}")).collect()
        };
        w.write_record(std::iter::once("source".to_string()).chain(targets))?;
        for (name, row) in names.iter().zip(values.chunks_exact(width)) {
            w.write_record(std::iter::once(name.clone()).chain(row.iter().map(|v| v.to_string())))?;
        }
    } else {
        w.write_record(["source", "predicted", "probability"])?;
        for (name, row) in names.iter().zip(values.chunks_exact(width)) {
            let best = ringtmp_model::loss::argmax(row).0;
            let max = row[best];
            let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
            let class = recipe
                .class_names
                .get(best)
                .cloned()
                .unwrap_or_else(|| best.to_string());
            w.write_record([name.clone(), class, format!("{:.6}", 1.0 / sum)])?;
        }
    }
    w.flush()?;
    Ok(())
}
