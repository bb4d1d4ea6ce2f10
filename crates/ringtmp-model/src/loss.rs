//! The training objectives, each returning the loss and its gradient in one pass: softmax
//! cross-entropy on logits, computed stably (log-sum-exp with the row maximum subtracted), and
//! mean squared error on regression outputs ([`Objective`] chooses between them).
//!
//! Regression targets arrive as the bit patterns of their `f32` values (`f32::to_bits`) in the
//! same `u32` label slices class indices use, so every strategy carries one label type.

use crate::error::{Error, Result};

/// Loss, gradient and accuracy count of one batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossOutput {
    /// Sum over rows of `-log softmax(logits)[label]` (not averaged).
    pub loss_sum: f64,
    /// Rows whose arg-max logit equals the label (0 for regression).
    pub correct: usize,
    /// Regression: sum of absolute errors over every output (0 for classification).
    pub abs_err_sum: f64,
}

/// What a model's outputs are trained to be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    /// Class logits: softmax cross-entropy ([`softmax_cross_entropy`]).
    #[default]
    CrossEntropy,
    /// Real targets: mean squared error over every output ([`mean_squared_error`]).
    MeanSquared,
}

impl Objective {
    /// The loss of `outputs` against `labels` and its gradient scaled by `scale` (see
    /// [`softmax_cross_entropy`] and [`mean_squared_error`]); `classes` is the logits per label
    /// (cross-entropy only: a regression output has one target each).
    pub fn score(
        self,
        outputs: &[f32],
        labels: &[u32],
        classes: usize,
        scale: f32,
        doutputs: &mut [f32],
    ) -> Result<LossOutput> {
        match self {
            Objective::CrossEntropy => {
                softmax_cross_entropy(outputs, labels, classes, scale, doutputs)
            }
            Objective::MeanSquared => mean_squared_error(outputs, labels, scale, doutputs),
        }
    }
}

/// Squared error of each output against its target (`targets[i]` the bit pattern of an `f32`):
/// `loss_sum = Σ (o − t)²`, `doutputs = scale · 2 (o − t)`. With `scale = 1 / outputs` the
/// gradient is that of the mean over every output, PyTorch's `MSELoss()`.
pub fn mean_squared_error(
    outputs: &[f32],
    targets: &[u32],
    scale: f32,
    doutputs: &mut [f32],
) -> Result<LossOutput> {
    check(outputs.len(), targets.len(), "regression outputs")?;
    check(doutputs.len(), outputs.len(), "output gradient")?;
    let mut out = LossOutput {
        loss_sum: 0.0,
        correct: 0,
        abs_err_sum: 0.0,
    };
    for ((d, &o), &t) in doutputs.iter_mut().zip(outputs).zip(targets) {
        let err = o - f32::from_bits(t);
        *d = scale * 2.0 * err;
        out.loss_sum += f64::from(err) * f64::from(err);
        out.abs_err_sum += f64::from(err.abs());
    }
    Ok(out)
}

/// Softmax cross-entropy over `labels.len()` rows of `classes` logits. Writes
/// `dlogits = scale · (softmax − onehot)`; use `scale = 1 / minibatch_size` so the gradient is that
/// of the mean loss over the whole mini-batch, however it is split into micro-batches.
pub fn softmax_cross_entropy(
    logits: &[f32],
    labels: &[u32],
    classes: usize,
    scale: f32,
    dlogits: &mut [f32],
) -> Result<LossOutput> {
    check(logits.len(), labels.len() * classes, "logits")?;
    check(dlogits.len(), logits.len(), "logit gradient")?;
    let mut out = LossOutput {
        loss_sum: 0.0,
        correct: 0,
        abs_err_sum: 0.0,
    };
    for (row, ((z, d), &label)) in logits
        .chunks_exact(classes)
        .zip(dlogits.chunks_exact_mut(classes))
        .zip(labels)
        .enumerate()
    {
        let label_idx = label as usize;
        if label_idx >= classes {
            return Err(Error::Label {
                row,
                label,
                classes,
            });
        }
        let (argmax, max) = argmax(z);
        let mut sum = 0.0f32;
        for (dv, &zv) in d.iter_mut().zip(z) {
            let e = (zv - max).exp();
            *dv = e;
            sum += e;
        }
        let inv = 1.0 / sum;
        for dv in d.iter_mut() {
            *dv *= inv * scale;
        }
        d[label_idx] -= scale;
        out.loss_sum += f64::from(sum.ln() - (z[label_idx] - max));
        out.correct += usize::from(argmax == label_idx);
    }
    Ok(out)
}

/// Number of rows whose arg-max logit equals the label (for evaluation, no gradient).
pub fn count_correct(logits: &[f32], labels: &[u32], classes: usize) -> usize {
    logits
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(z, l)| argmax(z).0 == **l as usize)
        .count()
}

/// The index of the largest value of `z` (the first on ties) and the value.
pub fn argmax(z: &[f32]) -> (usize, f32) {
    z.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
}

fn check(got: usize, expected: usize, what: &'static str) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Length {
            what,
            expected,
            got,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_log_classes_and_known_gradient() {
        let logits = [0.0f32; 8];
        let mut d = [0.0f32; 8];
        let out = softmax_cross_entropy(&logits, &[1, 3], 4, 0.5, &mut d).unwrap();
        assert!((out.loss_sum - 2.0 * 4f64.ln()).abs() < 1e-6);
        let want = [0.125, -0.375, 0.125, 0.125, 0.125, 0.125, 0.125, -0.375];
        for (a, b) in d.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{d:?}");
        }
    }

    #[test]
    fn large_logits_are_stable_and_argmax_counts() {
        let logits = [1000.0f32, 0.0, -1000.0, 0.0, 1000.0, 0.0];
        let mut d = [0.0f32; 6];
        let out = softmax_cross_entropy(&logits, &[0, 0], 3, 1.0, &mut d).unwrap();
        assert!(out.loss_sum.is_finite());
        assert!((out.loss_sum - 1000.0).abs() < 1e-3, "{}", out.loss_sum);
        assert_eq!(out.correct, 1);
        assert_eq!(count_correct(&logits, &[0, 1], 3), 2);
    }

    #[test]
    fn squared_error_matches_its_definition_and_finite_differences() {
        let outputs = [1.0f32, -2.0, 0.5];
        let targets = [0.0f32, 1.0, 0.5].map(f32::to_bits);
        let mut d = [0.0f32; 3];
        let out = Objective::MeanSquared
            .score(&outputs, &targets, 1, 1.0 / 3.0, &mut d)
            .unwrap();
        assert!((out.loss_sum - 10.0).abs() < 1e-9);
        assert!((out.abs_err_sum - 4.0).abs() < 1e-9);
        // d(mean)/do = 2 (o − t) / 3, checked against a central difference.
        for i in 0..3 {
            let mean = |o: &[f32]| {
                let mut scratch = [0.0f32; 3];
                mean_squared_error(o, &targets, 0.0, &mut scratch)
                    .unwrap()
                    .loss_sum
                    / 3.0
            };
            let (mut up, mut down) = (outputs, outputs);
            up[i] += 1e-3;
            down[i] -= 1e-3;
            let numeric = (mean(&up) - mean(&down)) / 2e-3;
            assert!(
                (f64::from(d[i]) - numeric).abs() < 1e-3,
                "{i}: {} {numeric}",
                d[i]
            );
        }
        let err = mean_squared_error(&outputs, &targets[..2], 1.0, &mut d).unwrap_err();
        assert!(err.to_string().contains("regression outputs"), "{err}");
    }

    #[test]
    fn out_of_range_label_is_an_error() {
        let mut d = [0.0f32; 3];
        let err = softmax_cross_entropy(&[0.0; 3], &[7], 3, 1.0, &mut d).unwrap_err();
        assert!(err.to_string().contains("label 7"), "{err}");
    }
}
