//! `ringtmp eval`: scores weights without training — a checkpoint's, or a file's from elsewhere
//! (`--init-from`, converted and checked as training would start from it).
//!
//! A classifier or regression checkpoint is scored on labelled inputs read through its run's
//! input recipe (its test split by default). A language model is scored on the validation part
//! of its text, read as its run read it (the run's `train.toml`, or `--data-file`): the same
//! figures as the run's own evaluations. Weights from `--init-from` are scored on the test or
//! validation split of the data the options name, as training would have scored them at step 0.

use std::path::{Path, PathBuf};

use anyhow::Result;
use ringtmp_data::Dataset;
use ringtmp_model::Stage;
use ringtmp_model::loss::Objective;
use ringtmp_strategy::evaluation;

use super::opened::{Opened, open, threads};
use super::outputs::{outputs_of, score_of};
use crate::args::TrainArgs;
use crate::error::UsageError;

/// `ringtmp eval` options.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// A checkpoint directory, or a run directory (its best evaluation's checkpoint, else its
    /// newest).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "init_from",
        conflicts_with = "init_from"
    )]
    pub checkpoint: Option<PathBuf>,
    /// Score the first N rows only (a checkpoint of classes or targets).
    #[arg(long, value_name = "N", value_parser = crate::args::at_least_one)]
    pub limit: Option<usize>,
    /// Print the score as one JSON object on stdout as well.
    #[arg(long)]
    pub json: bool,
    /// The data and, for --init-from, the model: `ringtmp train`'s options of those. With
    /// --checkpoint, --data-file names labelled inputs read as training read its data (a .csv
    /// with the training columns and the label, an .npz with `x` and `y`, a folder of class
    /// folders, a language model's text) [default: the test split of the run's data].
    #[command(flatten)]
    pub run: TrainArgs,
}

/// The `train` options besides the data's ([`crate::args::DATASET_TABLE_KEYS`]) that `eval`
/// reads: which model and weights, which dataset, and how to compute.
const MODEL_AND_RUN: [&str; 10] = [
    "config",
    "model",
    "model-file",
    "tie-embeddings",
    "init-from",
    "weight-map",
    "dataset",
    "eval-tokens",
    "threads",
    "seed",
];

/// Refuses a training option given to `eval`, which trains nothing.
fn refuse_training_options(args: &TrainArgs) -> Result<()> {
    let table = toml::Value::try_from(args)?;
    let given: Vec<String> = table
        .as_table()
        .map(|t| {
            t.keys()
                .filter(|k| {
                    !(MODEL_AND_RUN.contains(&k.as_str())
                        || crate::args::DATASET_TABLE_KEYS.contains(&k.as_str()))
                })
                .map(|k| format!("--{k}"))
                .collect()
        })
        .unwrap_or_default();
    if given.is_empty() {
        return Ok(());
    }
    let verb = if given.len() == 1 { "trains" } else { "train" };
    Err(UsageError(format!(
        "{} {verb}; eval scores weights without training and takes the model and data \
         options only",
        given.join(", "),
    ))
    .into())
}

/// A score and what it was computed on, printed on stderr (and as JSON on stdout with `json`).
struct Scored {
    line: String,
    json: serde_json::Value,
}

impl Scored {
    fn print(self, what: &str, json: bool) {
        eprintln!("eval: {} {what}", self.line);
        if json {
            println!("{}", self.json);
        }
    }
}

/// The figures of an evaluation of the run's kind: accuracy and loss; R², RMSE and MAE; or a
/// language model's validation loss, perplexity and next-token accuracy.
fn scored(score: &evaluation::Score, objective: Objective, language: bool) -> Scored {
    match (objective, score.rmse, score.mae) {
        (Objective::MeanSquared, Some(rmse), Some(mae)) => Scored {
            line: format!("R² {:.4}, RMSE {rmse:.4}, MAE {mae:.4}", score.accuracy),
            json: serde_json::json!({"r2": score.accuracy, "rmse": rmse, "mae": mae}),
        },
        _ if language => Scored {
            line: format!(
                "validation loss {:.4} (perplexity {:.2}), next-token accuracy {:.2}%",
                score.loss,
                score.loss.exp(),
                100.0 * score.accuracy
            ),
            json: serde_json::json!({"loss": score.loss, "perplexity": score.loss.exp(),
                "accuracy": score.accuracy}),
        },
        _ => Scored {
            line: format!(
                "accuracy {:.2}%, loss {:.4}",
                100.0 * score.accuracy,
                score.loss
            ),
            json: serde_json::json!({"accuracy": score.accuracy, "loss": score.loss}),
        },
    }
}

/// `ringtmp eval`.
pub fn eval(a: &EvalArgs) -> Result<()> {
    refuse_training_options(&a.run)?;
    let threads = threads(a.run.training.threads);
    crate::plan::init_threads(threads)?;
    match &a.checkpoint {
        Some(path) => eval_checkpoint(a, path, threads),
        None => eval_init_from(a, threads),
    }
}

/// Scores `stage` on `data`'s test (or validation) split.
fn score_split(stage: &mut Stage, data: &Dataset) -> Result<(Scored, usize)> {
    let split = &data.test;
    let score = evaluation::evaluate(stage, split, data.classes)?;
    let language = matches!(data.task, ringtmp_data::Task::NextToken { .. });
    let labels = split.len() * split.positions();
    let mut s = scored(&score, evaluation::objective_of(split), language);
    s.json["labels"] = labels.into();
    Ok((s, labels))
}

/// `eval --init-from FILE`: the file's weights, converted as `train --init-from` converts them,
/// scored on the options' data.
fn eval_init_from(a: &EvalArgs, threads: usize) -> Result<()> {
    let args = a.run.merged()?;
    let data = crate::plan::load_dataset(&args, true)?;
    let cfg = args.resolve_for(&data)?;
    let Some(mut converted) = crate::init_from::convert(&args, &cfg, &data)? else {
        unreachable!("clap requires --init-from without --checkpoint")
    };
    converted.stage.set_threads(threads);
    let (mut scored, labels) = score_split(&mut converted.stage, &data)?;
    scored.json["init_from"] = args
        .model
        .init_from
        .as_ref()
        .map(|p| p.display().to_string())
        .into();
    let what = format!(
        "on {labels} labels of the {} split of {} with {} from {}",
        split_name(&data),
        data.name,
        cfg.model.name,
        args.model
            .init_from
            .as_deref()
            .unwrap_or(Path::new(""))
            .display()
    );
    scored.print(&what, a.json);
    Ok(())
}

fn split_name(data: &Dataset) -> &'static str {
    match data.task {
        ringtmp_data::Task::NextToken { .. } => "validation",
        _ => "test",
    }
}

/// `eval --checkpoint DIR`.
fn eval_checkpoint(a: &EvalArgs, path: &Path, threads: usize) -> Result<()> {
    let mut opened = open(path, threads)?;
    let Some(recipe) = opened.recipe.clone() else {
        return eval_language_model(a, opened);
    };
    let data_file = match a.run.data.data_file.as_deref() {
        None => None,
        Some([one]) => Some(one.as_path()),
        Some(many) => {
            return Err(UsageError(format!(
                "--data-file: {} files; a checkpoint of {} is scored on one",
                many.len(),
                opened.manifest.model.name
            ))
            .into());
        }
    };
    let run = outputs_of(&mut opened, &recipe, data_file, a.limit)?;
    let Some(score) = score_of(&run) else {
        return Err(UsageError(format!(
            "{}: these inputs carry no labels to score against",
            data_file.map_or_else(|| "the test split".into(), |p| p.display().to_string())
        ))
        .into());
    };
    let mut json = score.json();
    json["rows"] = run.inputs.rows.into();
    json["step"] = opened.manifest.step.into();
    json["checkpoint"] = opened.dir.display().to_string().into();
    let what = format!(
        "on {} rows with {} from {} step {} ({})",
        run.inputs.rows,
        opened.manifest.model.name,
        opened.manifest.strategy,
        opened.manifest.step,
        opened.dir.display()
    );
    Scored {
        line: score.line(),
        json,
    }
    .print(&what, a.json);
    Ok(())
}

/// The options a run was started with (its `train.toml`), for the checkpoint directory `dir`
/// of that run (`RUN/checkpoints/step-…`).
fn run_options(dir: &Path) -> Result<Option<TrainArgs>> {
    let Some(run) = dir
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "checkpoints"))
        .and_then(Path::parent)
    else {
        return Ok(None);
    };
    let file = run.join("train.toml");
    if !file.is_file() {
        return Ok(None);
    }
    let args = TrainArgs {
        config: Some(file),
        ..Default::default()
    };
    Ok(Some(args.merged()?))
}

/// A language model's checkpoint, scored on the validation part of its text: the run's, read
/// with its options, or `--data-file` (which must give the same vocabulary).
fn eval_language_model(a: &EvalArgs, mut opened: Opened) -> Result<()> {
    if a.limit.is_some() {
        return Err(UsageError(
            "--limit counts rows of classes or targets; a language model is scored on its \
             validation text (--eval-tokens bounds it)"
                .into(),
        )
        .into());
    }
    let mut args = match (run_options(&opened.dir)?, &a.run.data.data_file) {
        (Some(run), None) => run,
        (run, Some(_)) => {
            let mut args = a.run.clone();
            if let Some(run) = run {
                // The run's way of reading text, unless the options say another.
                args.data.tokenizer = args.data.tokenizer.or(run.data.tokenizer);
                args.data.val_fraction = args.data.val_fraction.or(run.data.val_fraction);
                args.data.dataset = args.data.dataset.or(run.data.dataset);
            }
            args.data.dataset = args.data.dataset.or(Some("text".into()));
            args
        }
        (None, None) => {
            return Err(UsageError(format!(
                "{}: a language model's checkpoint whose run's options (train.toml) are not \
                 beside it: name its text with --data-file",
                opened.dir.display()
            ))
            .into());
        }
    };
    args.data.seq_len = ringtmp_model::checkpoint::context_of(&opened.dir, &opened.manifest)?;
    args.data.eval_tokens = a.run.data.eval_tokens.or(args.data.eval_tokens);
    let data = crate::plan::load_dataset(&args, true)?;
    let vocabulary = ringtmp_strategy::vocabulary_of(&data);
    if vocabulary != opened.manifest.vocabulary {
        let describe = |line: Option<&str>| {
            line.and_then(|l| ringtmp_data::Vocabulary::from_line(l, "").ok())
                .map_or_else(|| "none".to_string(), |v| v.describe())
        };
        return Err(UsageError(format!(
            "{}: the text's vocabulary ({}) is not the model's ({}): score it on text of the \
             same characters or tokenizer",
            data.name,
            describe(vocabulary.as_deref()),
            describe(opened.manifest.vocabulary.as_deref())
        ))
        .into());
    }
    let (mut scored, labels) = score_split(&mut opened.stage, &data)?;
    scored.json["step"] = opened.manifest.step.into();
    scored.json["checkpoint"] = opened.dir.display().to_string().into();
    let what = format!(
        "on {labels} positions of the validation part of {} with {} from {} step {} ({})",
        data.name,
        opened.manifest.model.name,
        opened.manifest.strategy,
        opened.manifest.step,
        opened.dir.display()
    );
    scored.print(&what, a.json);
    Ok(())
}
