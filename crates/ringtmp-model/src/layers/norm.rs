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

use multiversion::multiversion;
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
    /// ε added to the variance or mean square.
    #[serde(default = "default_eps")]
    pub eps: f32,
}

fn default_eps() -> f32 {
    NORM_EPS
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
        let (kind, eps) = (self.kind, f64::from(self.eps));
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
                let rstd = (1.0 / (var + eps).sqrt()) as f32;
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

/// `tanh(x)` as a rational function (Eigen's `generic_fast_tanh_float`: a 13/6 minimax
/// approximation on [−7.9053, 7.9053], where tanh reaches ±1 in f32, and `x` itself below
/// 0.0004), within 5e-7 of the true value everywhere (`fast_tanh_is_within_5e_7`; 4.1e-7 at worst, near ±6). Only
/// multiplications, additions, a division and selects, so the loops that call it vectorise:
/// libm's scalar `tanhf` (through `expm1f`) was half of a `gpt-cpu` training step.
#[inline(always)]
pub(crate) fn fast_tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    let small = x.abs() < 0.0004;
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = -2.760_768_5e-16f32;
    p = p * x2 + 2.000_188e-13;
    p = p * x2 - 8.604_672e-11;
    p = p * x2 + 5.122_297e-8;
    p = p * x2 + 1.485_722_4e-5;
    p = p * x2 + 6.372_619_3e-4;
    p = p * x2 + 4.893_524_6e-3;
    let p = p * x;
    let mut q = 1.198_258_4e-6f32;
    q = q * x2 + 1.185_347_1e-4;
    q = q * x2 + 2.268_434_6e-3;
    q = q * x2 + 4.893_525e-3;
    if small { x } else { p / q }
}

/// GELU (tanh form) of every value of `x` into `y`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn gelu_forward(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
        *y = 0.5 * x * (1.0 + fast_tanh(inner));
    }
}

/// GELU's derivative at `x`.
#[inline(always)]
fn gelu_slope(x: f32) -> f32 {
    let inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
    let t = fast_tanh(inner);
    let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
}

/// `dx = dy · GELU'(x)`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
        *dx = dy * gelu_slope(x);
    }
}

/// `d ← d · GELU'(x)`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_tanh_is_within_5e_7() {
        let mut worst = (0.0f64, 0.0f32);
        for i in -2_000_000..=2_000_000 {
            let x = i as f32 * 1e-5;
            for x in [x, x * 10.0] {
                let err = (f64::from(fast_tanh(x)) - f64::from(x).tanh()).abs();
                if err > worst.0 {
                    worst = (err, x);
                }
            }
        }
        assert!(worst.0 < 5e-7, "|error| {} at {}", worst.0, worst.1);
        assert_eq!(fast_tanh(1e9), 1.0);
        assert_eq!(fast_tanh(-1e9), -1.0);
        assert_eq!(fast_tanh(f32::INFINITY), 1.0);
    }
}
