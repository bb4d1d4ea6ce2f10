//! 2-D convolution over channels-last images, as im2col followed by one GEMM per pass.
//!
//! With NHWC activations, a column row `(b, oy, ox)` is `kernel` runs of `kernel × in_channels`
//! contiguous values, and the GEMM output `[b·oh·ow, out_channels]` *is* the NHWC output: no
//! transposes anywhere. The weights are stored `[out_channels, kernel, kernel, in_channels]`.
//! The columns are kept in [`Aux`] so the backward pass reuses them instead of rebuilding them.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::Aux;
use crate::kernels::{Op, broadcast_rows, column_sums, matmul, set_len};

/// Convolution geometry (square kernel, equal stride and zero padding on both axes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Conv2d {
    /// Input height.
    pub in_height: usize,
    /// Input width.
    pub in_width: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels (filters).
    pub out_channels: usize,
    /// Kernel side.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    /// Output height.
    pub out_height: usize,
    /// Output width.
    pub out_width: usize,
}

impl Conv2d {
    /// Values in one column row: `kernel² · in_channels`.
    pub fn fan_in(&self) -> usize {
        self.kernel * self.kernel * self.in_channels
    }

    /// Number of weights.
    pub fn weight_len(&self) -> usize {
        self.out_channels * self.fan_in()
    }

    /// Weights plus biases.
    pub fn param_count(&self) -> usize {
        self.weight_len() + self.out_channels
    }

    fn positions(&self) -> usize {
        self.out_height * self.out_width
    }

    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        aux: &mut Aux,
        threads: usize,
    ) {
        let rows = n * self.positions();
        set_len(&mut aux.values, rows * self.fan_in());
        self.im2col(x, &mut aux.values, threads);
        let (w, b) = p.split_at(self.weight_len());
        broadcast_rows(y, b);
        matmul(
            y,
            rows,
            self.out_channels,
            self.fan_in(),
            &aux.values,
            Op::N,
            w,
            Op::T,
            true,
            threads,
        );
    }

    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        aux: &Aux,
        dy: &[f32],
        n: usize,
        dx: Option<&mut Vec<f32>>,
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let rows = n * self.positions();
        let (fan_in, oc) = (self.fan_in(), self.out_channels);
        let (gw, gb) = g.split_at_mut(self.weight_len());
        // dWᵀ[fan_in, oc] = colsᵀ[fan_in, rows] · dy[rows, oc], then transposed into dW[oc,
        // fan_in]: `gemm` runs this orientation faster than dW = dyᵀ · cols (the cnn's second
        // conv, one thread, AVX-512: 2.16 ms against 2.56 ms; the transpose of 51 k values is
        // noise). `scratch` is free until the input gradient below.
        set_len(scratch, fan_in * oc);
        matmul(
            scratch,
            fan_in,
            oc,
            rows,
            &aux.values,
            Op::T,
            dy,
            Op::N,
            false,
            threads,
        );
        for (o, row) in gw.chunks_exact_mut(fan_in).enumerate() {
            for (f, v) in row.iter_mut().enumerate() {
                let t = scratch[f * oc + o];
                *v = if accumulate { *v + t } else { t };
            }
        }
        column_sums(gb, dy, accumulate);
        if let Some(dx) = dx {
            self.input_gradient(&p[..self.weight_len()], dy, n, dx, scratch, threads);
        }
    }

    /// `dx` from `dy`: per sample, `dcols[positions, fan_in] = dy · W`, scattered back to pixels
    /// right away. Working one sample at a time keeps `dcols` (200 KB for the cnn's second conv)
    /// in cache instead of writing and re-reading the whole batch's 13 MB; samples are split into
    /// one contiguous group per thread, each with its own slice of `scratch`.
    fn input_gradient(
        &self,
        w: &[f32],
        dy: &[f32],
        n: usize,
        dx: &mut [f32],
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let (positions, fan_in, oc) = (self.positions(), self.fan_in(), self.out_channels);
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let groups = threads.clamp(1, n.max(1));
        let per_group = n.div_ceil(groups);
        set_len(scratch, groups * positions * fan_in);
        let group = |((dys, dxs), dcols): ((&[f32], &mut [f32]), &mut [f32])| {
            for (dy1, dx1) in dys
                .chunks_exact(positions * oc)
                .zip(dxs.chunks_exact_mut(sample_in))
            {
                matmul(dcols, positions, fan_in, oc, dy1, Op::N, w, Op::N, false, 1);
                self.col2im_sample(dcols, dx1);
            }
        };
        let parts = dy
            .chunks(per_group * positions * oc)
            .zip(dx.chunks_mut(per_group * sample_in))
            .zip(scratch.chunks_exact_mut(positions * fan_in));
        if groups > 1 {
            parts.collect::<Vec<_>>().into_par_iter().for_each(group);
        } else {
            parts.for_each(group);
        }
    }

    /// Input pixel `(iy, ix)` for output position `(oy, ox)` and kernel offset `(ky, kx)`, or
    /// `None` in the padding.
    #[inline]
    fn source(&self, o: usize, k: usize, size: usize) -> Option<usize> {
        (o * self.stride + k)
            .checked_sub(self.padding)
            .filter(|&i| i < size)
    }

    fn im2col(&self, x: &[f32], cols: &mut [f32], threads: usize) {
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let sample_cols = self.positions() * self.fan_in();
        let one = |(xs, cs): (&[f32], &mut [f32])| self.im2col_sample(xs, cs);
        if threads > 1 {
            x.par_chunks_exact(sample_in)
                .zip(cols.par_chunks_exact_mut(sample_cols))
                .for_each(one);
        } else {
            x.chunks_exact(sample_in)
                .zip(cols.chunks_exact_mut(sample_cols))
                .for_each(one);
        }
    }

    fn im2col_sample(&self, x: &[f32], cols: &mut [f32]) {
        let c = self.in_channels;
        let run = self.kernel * c;
        if self.padding == 0 && run <= 16 {
            // Few channels (the first conv of a grey or colour image): kernel rows of a few
            // values, copied row of kernel by row of kernel with the output column innermost,
            // without the per-copy bookkeeping below (the cnn's first conv: 0.43 ms a step).
            let (k, ow, s) = (self.kernel, self.out_width, self.stride);
            let row_len = self.in_width * c;
            for oy in 0..self.out_height {
                for ky in 0..k {
                    let src = &x[(oy * s + ky) * row_len..][..row_len];
                    for ox in 0..ow {
                        let at = ((oy * ow + ox) * k + ky) * run;
                        let from = ox * s * c;
                        cols[at..at + run].copy_from_slice(&src[from..from + run]);
                    }
                }
            }
            return;
        }
        let mut out = cols.chunks_exact_mut(run);
        for oy in 0..self.out_height {
            for ox in 0..self.out_width {
                for ky in 0..self.kernel {
                    let dst = out.next().expect("cols sized to positions × kernel rows");
                    let Some(iy) = self.source(oy, ky, self.in_height) else {
                        dst.fill(0.0);
                        continue;
                    };
                    let row = iy * self.in_width;
                    let first = ox * self.stride;
                    if first >= self.padding && first + self.kernel - self.padding <= self.in_width
                    {
                        // Whole kernel row inside the image: one contiguous copy. Short runs
                        // (a single-channel image's 5 values) copy element by element: a
                        // `memcpy` call per 20 bytes cost the cnn's first conv 0.6 ms a step.
                        let start = (row + first - self.padding) * c;
                        let src = &x[start..start + run];
                        if run <= 16 {
                            for (d, s) in dst.iter_mut().zip(src) {
                                *d = *s;
                            }
                        } else {
                            dst.copy_from_slice(src);
                        }
                    } else {
                        for (kx, d) in dst.chunks_exact_mut(c).enumerate() {
                            match self.source(ox, kx, self.in_width) {
                                Some(ix) => {
                                    d.copy_from_slice(&x[(row + ix) * c..(row + ix + 1) * c])
                                }
                                None => d.fill(0.0),
                            }
                        }
                    }
                }
            }
        }
    }

    fn col2im_sample(&self, dcols: &[f32], dx: &mut [f32]) {
        dx.fill(0.0);
        let c = self.in_channels;
        let mut src = dcols.chunks_exact(c);
        for oy in 0..self.out_height {
            for ox in 0..self.out_width {
                for ky in 0..self.kernel {
                    let iy = self.source(oy, ky, self.in_height);
                    for kx in 0..self.kernel {
                        let s = src.next().expect("dcols sized to positions × fan_in");
                        let (Some(iy), Some(ix)) = (iy, self.source(ox, kx, self.in_width)) else {
                            continue;
                        };
                        let at = (iy * self.in_width + ix) * c;
                        for (d, v) in dx[at..at + c].iter_mut().zip(s) {
                            *d += v;
                        }
                    }
                }
            }
        }
    }
}
