//! Max-pooling over channels-last images; records the winning input position of every output so
//! the backward pass is a scatter.

use multiversion::multiversion;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::Aux;

/// Max-pooling geometry (square window, no padding; a partial window at the edge is dropped, as
/// in the common frameworks' default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxPool2d {
    /// Input height.
    pub in_height: usize,
    /// Input width.
    pub in_width: usize,
    /// Channels (unchanged by pooling).
    pub channels: usize,
    /// Window side.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Output height.
    pub out_height: usize,
    /// Output width.
    pub out_width: usize,
}

/// One sample's input, output and argmax indices, with the sample's position in the batch.
type SampleSlices<'a> = (usize, (&'a [f32], (&'a mut [f32], &'a mut [u32])));

impl MaxPool2d {
    pub(crate) fn forward(
        &self,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        aux: &mut Aux,
        threads: usize,
    ) {
        let c = self.channels;
        let sample_in = self.in_height * self.in_width * c;
        let sample_out = self.out_height * self.out_width * c;
        aux.indices.resize(n * sample_out, 0);
        let one = |(b, (xs, (ys, idx))): SampleSlices<'_>| {
            self.forward_sample(xs, ys, idx, (b * sample_in) as u32);
        };
        let parts = x.chunks_exact(sample_in).zip(
            y.chunks_exact_mut(sample_out)
                .zip(aux.indices.chunks_exact_mut(sample_out)),
        );
        if threads > 1 {
            x.par_chunks_exact(sample_in)
                .zip(
                    y.par_chunks_exact_mut(sample_out)
                        .zip(aux.indices.par_chunks_exact_mut(sample_out)),
                )
                .enumerate()
                .for_each(one);
        } else {
            parts.enumerate().for_each(one);
        }
    }

    /// Output values per sample.
    pub(crate) fn sample_out(&self) -> usize {
        self.out_height * self.out_width * self.channels
    }

    /// Pools one sample; `base` is the sample's offset in the batch, so indices address the whole
    /// batch's input.
    pub(crate) fn forward_sample(&self, xs: &[f32], ys: &mut [f32], idx: &mut [u32], base: u32) {
        pool_sample(self, xs, ys, idx, base);
    }
}

/// [`MaxPool2d::forward_sample`], compiled for each SIMD level as a whole so that [`max_into`]
/// inlines: dispatched per call, the kernel cost the cnn's first pool a call per window element
/// (36,864 a step).
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn pool_sample(pool: &MaxPool2d, xs: &[f32], ys: &mut [f32], idx: &mut [u32], base: u32) {
    pool.pool_rows(xs, ys, idx, base);
}

/// [`MaxPool2d::relu_backward_sample`], compiled for each SIMD level.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn relu_backward_sample<'a>(pool: &MaxPool2d, grad: PooledGrad<'a>, base: u32, dx: &mut [f32]) {
    pool.relu_backward_rows(grad, base, dx);
}

/// One sample's pooled output gradient, with the pooled values and their argmax indices.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PooledGrad<'a> {
    /// The pool's output gradient.
    pub dy: &'a [f32],
    /// The pool's output.
    pub pooled: &'a [f32],
    /// The pool's argmax indices.
    pub indices: &'a [u32],
}

impl MaxPool2d {
    /// The gradient of a ReLU's output (the pool's input) for one sample, from `grad`: what the
    /// pool's backward followed by the ReLU's gives, bit for bit — each pooled gradient added to
    /// zero at its winner (in output order, where windows overlap) where the winner, i.e. the
    /// pooled value, is positive; zero elsewhere. `base` is the sample's offset in the batch, as
    /// in the indices.
    ///
    /// Windows that tile the input (stride = kernel) write each input value once, selected
    /// without a branch, instead of zeroing and scattering: the scatter's unpredictable branch
    /// cost the cnn's first pool about 1.5 ns an output.
    pub(crate) fn relu_backward_sample(&self, grad: PooledGrad<'_>, base: u32, dx: &mut [f32]) {
        relu_backward_sample(self, grad, base, dx);
    }

    #[inline(always)]
    fn relu_backward_rows(&self, grad: PooledGrad<'_>, base: u32, dx: &mut [f32]) {
        let c = self.channels;
        let (k, s) = (self.kernel, self.stride);
        let covered =
            (self.out_height * s == self.in_height) && (self.out_width * s == self.in_width);
        if k != s || !covered {
            dx.fill(0.0);
        }
        if k != s {
            for ((g, v), &i) in grad.dy.iter().zip(grad.pooled).zip(grad.indices) {
                let at = (i - base) as usize;
                dx[at] += if *v > 0.0 { *g } else { 0.0 };
            }
            return;
        }
        for oy in 0..self.out_height {
            for ox in 0..self.out_width {
                let o = (oy * self.out_width + ox) * c;
                let (g, v, idx) = (
                    &grad.dy[o..o + c],
                    &grad.pooled[o..o + c],
                    &grad.indices[o..o + c],
                );
                for ky in 0..k {
                    for kx in 0..k {
                        let at = ((oy * s + ky) * self.in_width + ox * s + kx) * c;
                        // A channel's winner is here when its index is this row's, `first + ch`.
                        let first = base + at as u32;
                        for (ch, (d, ((g, v), i))) in dx[at..at + c]
                            .iter_mut()
                            .zip(g.iter().zip(v).zip(idx))
                            .enumerate()
                        {
                            let wins = (*i == first.wrapping_add(ch as u32)) & (*v > 0.0);
                            // `0.0 + g`, as the scatter into zeros computes it (a -0.0
                            // gradient becomes +0.0 there too).
                            *d = if wins { 0.0 + *g } else { 0.0 };
                        }
                    }
                }
            }
        }
    }

    #[inline(always)]
    fn pool_rows(&self, xs: &[f32], ys: &mut [f32], idx: &mut [u32], base: u32) {
        let c = self.channels;
        for oy in 0..self.out_height {
            for ox in 0..self.out_width {
                let o = (oy * self.out_width + ox) * c;
                let (ys, idx) = (&mut ys[o..o + c], &mut idx[o..o + c]);
                for ky in 0..self.kernel {
                    for kx in 0..self.kernel {
                        let at =
                            ((oy * self.stride + ky) * self.in_width + ox * self.stride + kx) * c;
                        let window = &xs[at..at + c];
                        if ky == 0 && kx == 0 {
                            // Start from the window's first element (not -inf) so a NaN input
                            // still leaves a valid index behind.
                            ys.copy_from_slice(window);
                            for (ch, i) in idx.iter_mut().enumerate() {
                                *i = base + (at + ch) as u32;
                            }
                        } else {
                            max_into(ys, idx, window, base + at as u32);
                        }
                    }
                }
            }
        }
    }

    pub(crate) fn backward(aux: &Aux, dy: &[f32], dx: &mut [f32]) {
        dx.fill(0.0);
        for (g, &i) in dy.iter().zip(&aux.indices) {
            dx[i as usize] += g;
        }
    }
}

/// `ys = max(ys, xs)` per channel, recording `first + ch` where `xs` wins. Strict `>` keeps the
/// first maximum, like the common frameworks. Branch-free so it vectorises.
#[inline(always)]
fn max_into(ys: &mut [f32], idx: &mut [u32], xs: &[f32], first: u32) {
    for (ch, ((y, i), x)) in ys.iter_mut().zip(idx.iter_mut()).zip(xs).enumerate() {
        let better = *x > *y;
        *y = if better { *x } else { *y };
        *i = if better { first + ch as u32 } else { *i };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The pooling kernel, at whatever SIMD level runs it (AVX-512, AVX2, NEON),
    // equals the scalar definition at every channel count (every tail length), windows apart and
    // overlapping, ties keeping the first maximum.
    #[test]
    fn the_pool_matches_the_scalar_definition_at_every_channel_count() {
        for channels in 1..40 {
            for (kernel, stride) in [(2, 2), (3, 2), (2, 1)] {
                let pool = MaxPool2d {
                    in_height: 5,
                    in_width: 6,
                    channels,
                    kernel,
                    stride,
                    out_height: (5 - kernel) / stride + 1,
                    out_width: (6 - kernel) / stride + 1,
                };
                let n = 2;
                let sample_in = 5 * 6 * channels;
                // Few distinct values: many ties.
                let x: Vec<f32> = (0..n * sample_in)
                    .map(|i| ((i * 5) % 7) as f32 - 3.0)
                    .collect();
                let len = n * pool.sample_out();
                let (mut y, mut aux) = (vec![f32::NAN; len], Aux::default());
                pool.forward(&x, n, &mut y, &mut aux, 1);
                let mut at = 0;
                for b in 0..n {
                    for oy in 0..pool.out_height {
                        for ox in 0..pool.out_width {
                            for ch in 0..channels {
                                let mut best = None::<(f32, usize)>;
                                for ky in 0..kernel {
                                    for kx in 0..kernel {
                                        let (iy, ix) = (oy * stride + ky, ox * stride + kx);
                                        let i = b * sample_in + (iy * 6 + ix) * channels + ch;
                                        if best.is_none_or(|(v, _)| x[i] > v) {
                                            best = Some((x[i], i));
                                        }
                                    }
                                }
                                let (v, i) = best.expect("a window has values");
                                let what = format!("{channels} channels, {kernel}/{stride}");
                                assert_eq!((y[at], aux.indices[at]), (v, i as u32), "{what}");
                                at += 1;
                            }
                        }
                    }
                }
            }
        }
    }
}
