//! A model's outputs for a set of inputs read as its training read them (a user's file through
//! the run's input recipe, or the run's own test split), and how well they match the inputs'
//! labels: accuracy for classes; R², RMSE and MAE in the targets' units for a regression.

use std::path::Path;

use anyhow::Result;
use ringtmp_data::{InputRecipe, Labels};
use ringtmp_model::Stage;
use ringtmp_model::loss::Objective;

use crate::error::UsageError;

use super::opened::Opened;

/// A model's outputs for a set of inputs.
pub(super) struct Outputs {
    pub(super) inputs: ringtmp_data::Inputs,
    /// `[rows, width]`: class logits, or regression predictions in the targets' units.
    pub(super) values: Vec<f32>,
    pub(super) width: usize,
    pub(super) regression: bool,
}

/// The opened checkpoint's outputs for `data_file` (read as `recipe` says) or the bundled test
/// split.
pub(super) fn outputs_of(
    opened: &mut Opened,
    recipe: &InputRecipe,
    data_file: Option<&Path>,
    limit: Option<usize>,
) -> Result<Outputs> {
    let inputs = match data_file {
        Some(path) => ringtmp_data::read_inputs(recipe, path, limit)?,
        None => test_split(opened, limit)?,
    };
    let outputs = inputs_outputs(&mut opened.stage, &inputs.x, inputs.rows)?;
    let width = outputs.len() / inputs.rows.max(1);
    let regression = opened.manifest.objective == Objective::MeanSquared;
    // Regression outputs in the targets' units.
    let values: Vec<f32> = if regression && !recipe.target_standardisation.is_empty() {
        outputs
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let (mean, std) = recipe.target_standardisation[i % width];
                o * std + mean
            })
            .collect()
    } else {
        outputs
    };
    Ok(Outputs {
        inputs,
        values,
        width,
        regression,
    })
}

/// The run's own test split (a bundled dataset), read raw and normalised as the recipe says.
pub(super) fn test_split(opened: &Opened, limit: Option<usize>) -> Result<ringtmp_data::Inputs> {
    let name = &opened.manifest.dataset;
    if !ringtmp_data::DATASETS.contains(&name.as_str()) {
        return Err(UsageError(format!(
            "the model was trained on your own {name} data: name the inputs with --data-file"
        ))
        .into());
    }
    let data = ringtmp_data::load(name, None)?;
    let rows = data.test.len().min(limit.unwrap_or(usize::MAX));
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.test.gather_range(0, rows, &mut x, &mut y);
    Ok(ringtmp_data::Inputs {
        x,
        rows,
        labels: Some(Labels::Classes(y)),
        names: (0..rows).map(|r| format!("{name}-test[{r}]")).collect(),
    })
}

/// The model's outputs for `rows` inputs, in passes of at most 256 rows.
pub(super) fn inputs_outputs(stage: &mut Stage, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    const ROWS: usize = 256;
    let features = x.len() / rows.max(1);
    let mut out = Vec::new();
    for start in (0..rows).step_by(ROWS) {
        let end = (start + ROWS).min(rows);
        out.extend_from_slice(stage.infer(&x[start * features..end * features], end - start)?);
    }
    Ok(out)
}

/// How well outputs match their inputs' labels.
pub(super) enum Score {
    /// Classes: the share predicted right.
    Accuracy(f64),
    /// A regression, over every target: R² (1 − residual / total sum of squares), and the
    /// root mean squared and mean absolute errors in the targets' units.
    Regression { r2: f64, rmse: f64, mae: f64 },
}

impl Score {
    pub(super) fn line(&self) -> String {
        match self {
            Self::Accuracy(a) => format!("accuracy {:.2}%", 100.0 * a),
            Self::Regression { r2, rmse, mae } => {
                format!("R² {r2:.4}, RMSE {rmse:.4}, MAE {mae:.4}")
            }
        }
    }

    pub(super) fn json(&self) -> serde_json::Value {
        match self {
            Self::Accuracy(a) => serde_json::json!({"accuracy": a}),
            Self::Regression { r2, rmse, mae } => {
                serde_json::json!({"r2": r2, "rmse": rmse, "mae": mae})
            }
        }
    }
}

/// The score of `run` against its inputs' labels, if they have any of the model's kind.
pub(super) fn score_of(run: &Outputs) -> Option<Score> {
    match (run.inputs.labels.as_ref()?, run.regression) {
        (Labels::Classes(c), false) => {
            let right = run
                .values
                .chunks_exact(run.width)
                .zip(c)
                .filter(|(row, l)| ringtmp_model::loss::argmax(row).0 == **l as usize)
                .count();
            Some(Score::Accuracy(right as f64 / c.len().max(1) as f64))
        }
        (Labels::Targets { values: t, .. }, true) => {
            let n = t.len().max(1) as f64;
            // Each target's own mean: R² over several targets sums their squares.
            let width = run.width.max(1);
            let mut means = vec![0.0f64; width];
            for (i, &y) in t.iter().enumerate() {
                means[i % width] += f64::from(y);
            }
            let per_target = (t.len() / width).max(1) as f64;
            means.iter_mut().for_each(|m| *m /= per_target);
            let (mut sq, mut abs, mut total) = (0.0, 0.0, 0.0);
            for (i, (&p, &y)) in run.values.iter().zip(t).enumerate() {
                let e = f64::from(p - y);
                sq += e * e;
                abs += e.abs();
                total += (f64::from(y) - means[i % width]).powi(2);
            }
            Some(Score::Regression {
                r2: 1.0 - sq / total.max(f64::MIN_POSITIVE),
                rmse: (sq / n).sqrt(),
                mae: abs / n,
            })
        }
        _ => None,
    }
}
