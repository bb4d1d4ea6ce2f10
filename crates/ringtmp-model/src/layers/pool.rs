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

    /// Pools one sample; `base` is the sample's offset in the batch, so indices address the whole
    /// batch's input.
    fn forward_sample(&self, xs: &[f32], ys: &mut [f32], idx: &mut [u32], base: u32) {
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
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
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

    // Issue 17.1: the pooling kernel, at whatever SIMD level runs it (AVX-512, AVX2, NEON),
    // equals the scalar loop at every tail length, ties keeping the first maximum.
    #[test]
    fn max_into_matches_the_scalar_loop_at_every_tail_length() {
        for len in 0..70 {
            let ys0: Vec<f32> = (0..len).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
            let xs: Vec<f32> = (0..len).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
            let idx0: Vec<u32> = (0..len as u32).map(|i| 1000 + i).collect();
            let (mut ys, mut idx) = (ys0.clone(), idx0.clone());
            max_into(&mut ys, &mut idx, &xs, 7);
            for ch in 0..len {
                let better = xs[ch] > ys0[ch];
                assert_eq!(ys[ch], if better { xs[ch] } else { ys0[ch] }, "{len}/{ch}");
                assert_eq!(
                    idx[ch],
                    if better { 7 + ch as u32 } else { idx0[ch] },
                    "{len}/{ch}"
                );
            }
        }
    }
}
