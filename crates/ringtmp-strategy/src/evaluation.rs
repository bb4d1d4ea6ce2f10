//! Scoring a model on a split: the test accuracy and mean loss every strategy reports, in passes
//! sized so that their activations and logits stay a few tens of MB (250 images, or windows of
//! about 2,000 positions and at most 4 M logits).

use ringtmp_data::Split;
use ringtmp_model::{Stage, loss};

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

/// Test accuracy and mean loss of `model` on `split`.
pub fn evaluate(model: &mut Stage, split: &Split, classes: usize) -> Result<(f64, f64)> {
    // Not charged to the training compute a simulated node accounts next.
    ringtmp_meter::unmetered(|| evaluate_metered(model, split, classes))
}

fn evaluate_metered(model: &mut Stage, split: &Split, classes: usize) -> Result<(f64, f64)> {
    let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
    let (mut correct, mut loss_sum) = (0usize, 0.0f64);
    let mut start = 0;
    while start < split.len() {
        let end = (start + eval_chunk(split, classes)).min(split.len());
        split.gather_range(start, end, &mut x, &mut y);
        let logits = model.infer(&x, end - start)?;
        d.resize(logits.len(), 0.0);
        let out = loss::softmax_cross_entropy(logits, &y, classes, 0.0, &mut d)?;
        correct += out.correct;
        loss_sum += out.loss_sum;
        start = end;
    }
    let n = (split.len() * split.positions()).max(1) as f64;
    Ok((correct as f64 / n, loss_sum / n))
}
