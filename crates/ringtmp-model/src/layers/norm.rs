//! Normalisation over the last dimension, and the GELU activation: the element-wise parts of a
//! transformer block, usable in any model (a LayerNorm between an MLP's layers works as well).
//!
//! - [`Norm::Layer`]: `y = (x − mean) / sqrt(var + ε) · γ + β` per row of `features` values
//!   (biased variance, as PyTorch's `LayerNorm`), `γ` starting at 1 and `β` at 0.
//! - [`Norm::Rms`]: `y = x / sqrt(mean(x²) + ε) · γ` (no centring, no bias).
//! - [`gelu_forward`]: GELU in its tanh form, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, as
//!   GPT-2 and PyTorch's `approximate="tanh"`.
//!
//! The forward records each row's mean (LayerNorm) and reciprocal standard deviation for the
//! backward, so the backward reads no statistics it would have to recompute. Rows are independent: the work splits over threads by rows.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// ε added to the variance (PyTorch's default).
pub const NORM_EPS: f32 = 1e-5;

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// LayerNorm: centred, with a bias.
    Layer,
    /// RMSNorm: not centred, no bias.
    Rms,
}

/// A normalisation over the last `features` values of each sample's rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Norm {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Values per row (the last dimension).
    pub features: usize,
}

/// Rows per parallel task: enough work to be worth a task.
fn chunk_rows(features: usize) -> usize {
    (16_384 / features.max(1)).max(1)
}

impl Norm {
    /// `γ` (and `β` for LayerNorm).
    pub fn param_count(&self) -> usize {
        match self.kind {
            NormKind::Layer => 2 * self.features,
            NormKind::Rms => self.features,
        }
    }

    /// `γ = 1`, `β = 0`.
    pub fn init(&self, params: &mut [f32]) {
        let (gamma, beta) = params.split_at_mut(self.features);
        gamma.fill(1.0);
        beta.fill(0.0);
    }

    /// `y` from `x`, both `[rows, features]`; the rows' statistics into `stats` (`[mean, rstd]`
    /// per row, `2 · rows` values).
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
        threads: usize,
    ) {
        let f = self.features;
        let rows = x.len() / f;
        let (gamma, beta) = p.split_at(f);
        let kind = self.kind;
        let work = |(x, (y, stats)): (&[f32], (&mut [f32], &mut [f32]))| {
            for ((x, y), s) in x
                .chunks_exact(f)
                .zip(y.chunks_exact_mut(f))
                .zip(stats.chunks_exact_mut(2))
            {
                let mean = match kind {
                    NormKind::Layer => x.iter().map(|&v| f64::from(v)).sum::<f64>() / f as f64,
                    NormKind::Rms => 0.0,
                };
                let var = x
                    .iter()
                    .map(|&v| {
                        let d = f64::from(v) - mean;
                        d * d
                    })
                    .sum::<f64>()
                    / f as f64;
                let rstd = (1.0 / (var + f64::from(NORM_EPS)).sqrt()) as f32;
                let mean = mean as f32;
                match kind {
                    NormKind::Layer => {
                        for i in 0..f {
                            y[i] = (x[i] - mean) * rstd * gamma[i] + beta[i];
                        }
                    }
                    NormKind::Rms => {
                        for i in 0..f {
                            y[i] = x[i] * rstd * gamma[i];
                        }
                    }
                }
                s[0] = mean;
                s[1] = rstd;
            }
        };
        let c = chunk_rows(f);
        let parts = x
            .chunks(c * f)
            .zip(y.chunks_mut(c * f).zip(stats[..2 * rows].chunks_mut(2 * c)));
        if threads > 1 && rows > c {
            parts.par_bridge().for_each(work);
        } else {
            parts.for_each(work);
        }
    }

    /// Parameter gradients (added, or overwritten when `!accumulate`) and, when asked, `dx`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        stats: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let f = self.features;
        let gamma = &p[..f];
        if !accumulate {
            g.fill(0.0);
        }
        let (dgamma, dbeta) = g.split_at_mut(f);
        let mut dx = dx;
        for (r, ((x, dy), s)) in x
            .chunks_exact(f)
            .zip(dy.chunks_exact(f))
            .zip(stats.chunks_exact(2))
            .enumerate()
        {
            let (mean, rstd) = (s[0], s[1]);
            // x̂ = (x − mean)·rstd; with g = dy·γ:
            // LayerNorm: dx = rstd · (g − mean(g) − x̂ · mean(g · x̂));
            // RMSNorm:   dx = rstd · (g − x̂ · mean(g · x̂)).
            let (mut sum_g, mut sum_gx) = (0.0f64, 0.0f64);
            for i in 0..f {
                let xhat = (x[i] - mean) * rstd;
                dgamma[i] += dy[i] * xhat;
                if self.kind == NormKind::Layer {
                    dbeta[i] += dy[i];
                }
                let gi = dy[i] * gamma[i];
                sum_g += f64::from(gi);
                sum_gx += f64::from(gi * xhat);
            }
            if let Some(dx) = dx.as_deref_mut() {
                let mean_g = match self.kind {
                    NormKind::Layer => (sum_g / f as f64) as f32,
                    NormKind::Rms => 0.0,
                };
                let mean_gx = (sum_gx / f as f64) as f32;
                let out = &mut dx[r * f..(r + 1) * f];
                for i in 0..f {
                    let xhat = (x[i] - mean) * rstd;
                    out[i] = rstd * (dy[i] * gamma[i] - mean_g - xhat * mean_gx);
                }
            }
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// GELU (tanh form) of every value of `x` into `y`.
pub fn gelu_forward(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
        *y = 0.5 * x * (1.0 + inner.tanh());
    }
}

/// GELU's derivative at `x`.
fn gelu_slope(x: f32) -> f32 {
    let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    let t = inner.tanh();
    let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
}

/// `dx = dy · GELU'(x)`.
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
        *dx = dy * gelu_slope(x);
    }
}

/// `d ← d · GELU'(x)`.
pub(crate) fn gelu_backward_in_place(x: &[f32], d: &mut [f32]) {
    for (d, &x) in d.iter_mut().zip(x) {
        *d *= gelu_slope(x);
    }
}

/// Values per parallel task of the element-wise passes: enough work to be worth a task.
const ELEMENTWISE_CHUNK: usize = 1 << 15;

/// [`gelu_forward`] split over threads by chunks (the same values on any thread count).
pub(crate) fn gelu_forward_threaded(x: &[f32], y: &mut [f32], threads: usize) {
    if threads > 1 && x.len() > ELEMENTWISE_CHUNK {
        x.par_chunks(ELEMENTWISE_CHUNK)
            .zip(y.par_chunks_mut(ELEMENTWISE_CHUNK))
            .for_each(|(x, y)| gelu_forward(x, y));
    } else {
        gelu_forward(x, y);
    }
}

/// [`gelu_backward_in_place`] split over threads by chunks.
pub(crate) fn gelu_backward_in_place_threaded(x: &[f32], d: &mut [f32], threads: usize) {
    if threads > 1 && x.len() > ELEMENTWISE_CHUNK {
        x.par_chunks(ELEMENTWISE_CHUNK)
            .zip(d.par_chunks_mut(ELEMENTWISE_CHUNK))
            .for_each(|(x, d)| gelu_backward_in_place(x, d));
    } else {
        gelu_backward_in_place(x, d);
    }
}
