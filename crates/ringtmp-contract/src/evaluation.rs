//! Scoring a model on a split: the test accuracy and mean loss every strategy reports, in passes
//! sized so that their activations and logits stay a few tens of MB (250 images, or windows of
//! about 2,000 positions and at most 4 M logits).

use ringtmp_data::Split;
use ringtmp_model::Stage;
use ringtmp_model::loss::Objective;

use crate::error::Result;

/// Labels per evaluation forward pass: large enough for efficient GEMMs, small enough that the
/// activations of one pass stay a few tens of MB.
const EVAL_ROWS: usize = 250;

/// Logits an evaluation pass of a language model holds at most (16 MB), so that a vocabulary of
/// GPT-2's size evaluates in passes of a window or two rather than of 400 MB.
const EVAL_LOGITS: usize = 1 << 22;

/// Examples per evaluation forward pass of `split` for a model of `classes` outputs per
/// position: 250 images, or windows of about 2,000 positions in all and at most
/// 4 M logits (16 MB; at least one window).
pub fn eval_chunk(split: &Split, classes: usize) -> usize {
    match split.positions() {
        1 => EVAL_ROWS,
        positions => (8 * EVAL_ROWS / positions)
            .min(EVAL_LOGITS / (positions * classes.max(1)))
            .max(1),
    }
}

/// An evaluation's figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    /// Classification: the fraction of labels predicted. Regression: the coefficient of
    /// determination R² (scikit-learn's `score` for regressors: 1 is perfect, 0 is the mean).
    pub accuracy: f64,
    /// Mean loss per label: cross-entropy, or the squared error of an output.
    pub loss: f64,
    /// Regression: the root mean squared error of an output, in the target's units (see
    /// [`ringtmp_data::Split::target_units`]).
    pub rmse: Option<f64>,
    /// Regression: the mean absolute error of an output, in the same units.
    pub mae: Option<f64>,
}

impl Score {
    /// The figures of `scored` (summed over `labels` labels of `split`) under `objective`.
    pub fn of(
        objective: Objective,
        split: &Split,
        labels: usize,
        (correct, loss_sum, abs_err_sum): (usize, f64, f64),
    ) -> Self {
        let n = labels.max(1) as f64;
        match objective {
            Objective::CrossEntropy => Self {
                accuracy: correct as f64 / n,
                loss: loss_sum / n,
                rmse: None,
                mae: None,
            },
            Objective::MeanSquared => {
                let variance = split.target_variance().unwrap_or(0.0);
                let units = split.target_units().unwrap_or(1.0);
                let mse = loss_sum / n;
                Self {
                    accuracy: if variance > 0.0 {
                        1.0 - mse / variance
                    } else {
                        0.0
                    },
                    loss: mse,
                    rmse: Some(mse.max(0.0).sqrt() * units),
                    mae: Some(abs_err_sum / n * units),
                }
            }
        }
    }
}

/// How `split`'s labels are scored: mean squared error for regression targets, else
/// cross-entropy.
pub fn objective_of(split: &Split) -> Objective {
    match split.as_rows().map(|r| r.labels()) {
        Some(ringtmp_data::Labels::Targets { .. }) => Objective::MeanSquared,
        _ => Objective::CrossEntropy,
    }
}

/// How `model` does on `split`.
pub fn evaluate(model: &mut Stage, split: &Split, classes: usize) -> Result<Score> {
    let objective = objective_of(split);
    // Not charged to the training compute a simulated node accounts next.
    ringtmp_meter::unmetered(|| evaluate_metered(model, split, classes, objective))
}

fn evaluate_metered(
    model: &mut Stage,
    split: &Split,
    classes: usize,
    objective: Objective,
) -> Result<Score> {
    let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
    let (mut correct, mut loss_sum, mut abs_err_sum) = (0usize, 0.0f64, 0.0f64);
    let mut start = 0;
    while start < split.len() {
        let end = (start + eval_chunk(split, classes)).min(split.len());
        split.gather_range(start, end, &mut x, &mut y);
        let logits = model.infer(&x, end - start)?;
        d.resize(logits.len(), 0.0);
        let out = objective.score(logits, &y, classes, 0.0, &mut d)?;
        correct += out.correct;
        loss_sum += out.loss_sum;
        abs_err_sum += out.abs_err_sum;
        start = end;
    }
    let labels = split.len() * split.positions();
    Ok(Score::of(
        objective,
        split,
        labels,
        (correct, loss_sum, abs_err_sum),
    ))
}
