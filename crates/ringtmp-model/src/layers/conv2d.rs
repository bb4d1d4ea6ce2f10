//! 2-D convolution over channels-last images, as im2col followed by GEMMs, a few samples at a
//! time — or, for short kernel rows (an image's first conv), the direct kernels of
//! `conv_direct`.
//!
//! With NHWC activations, a column row `(b, oy, ox)` is `kernel` runs of `kernel × in_channels`
//! contiguous values, and the GEMM output `[b·oh·ow, out_channels]` *is* the NHWC output: no
//! transposes anywhere. The weights are stored `[out_channels, kernel, kernel, in_channels]`.
//!
//! The columns of a whole batch are 25× the input for a 5×5 kernel (13 MB for the cnn's second
//! conv at batch 64): written once to memory and read back by the GEMM, they cost the forward a
//! third of its time, and kept for the backward they made the conv's stash per micro-batch in
//! flight 11× its input. Instead each pass builds the columns of a group of samples that fits
//! in cache ([`GROUP_COLUMNS`]), runs its GEMMs on them and reuses the buffer; the backward
//! builds them again from the stashed input. Nothing is stashed beyond the layer's input.

use std::cell::RefCell;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::conv_direct;
use crate::kernels::{
    Op, broadcast_rows, column_sums, matmul, relu_backward, relu_in_place, set_len,
};

/// Column values one group of samples may fill (512 KB): within a core's L2, so the GEMM reads
/// the columns from cache right after they are written. For the cnn's second conv that is two
/// samples, 128 rows per GEMM; half that (one sample, 64 rows) ran the cnn 1–6% slower at one
/// thread and 3–4% at two (AMD EPYC, AVX-512, session 11, three alternating runs of
/// `bench-compute --models cnn --threads 1,2`).
const GROUP_COLUMNS: usize = 128 * 1024;

/// One thread's share of a backward pass.
struct Part<'a> {
    /// Its samples' input.
    x: &'a [f32],
    /// Their output gradient.
    dy: &'a [f32],
    /// Their fused ReLU's output (empty without one).
    relu_out: &'a [f32],
    /// Their input gradient (empty when none is wanted).
    dx: &'a mut [f32],
    /// Its scratch space: `dWᵀ` and bias sums, a group's columns, a group's masked `dy`.
    space: &'a mut [f32],
}

thread_local! {
    /// The forward's column buffer, one per thread (kept between calls: no allocation in the
    /// steady state).
    static GROUP_COLS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

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

    /// Samples whose columns one group builds at a time: as many as fit [`GROUP_COLUMNS`], at
    /// least one.
    fn samples_per_group(&self) -> usize {
        (GROUP_COLUMNS / (self.positions() * self.fan_in()).max(1)).max(1)
    }

    /// `y = conv(x)` for `n` samples, or `relu(conv(x))` when `relu` (a ReLU right after the
    /// conv in the same stage: applied to each group's output while it is in cache, instead of
    /// another pass over the whole output).
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        relu: bool,
        threads: usize,
    ) {
        let (positions, fan_in, oc) = (self.positions(), self.fan_in(), self.out_channels);
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let per = self.samples_per_group();
        let (w, b) = p.split_at(self.weight_len());
        if conv_direct::applies(self) {
            let mut wt = Vec::new();
            conv_direct::block_weights(self, w, &mut wt);
            let sample = |(xs, ys): (&[f32], &mut [f32])| {
                conv_direct::forward_sample(self, &wt, b, xs, ys, relu);
            };
            let x = &x[..n * sample_in];
            let sample_out = positions * oc;
            if threads > 1 && n > 1 {
                x.par_chunks_exact(sample_in)
                    .zip(y.par_chunks_exact_mut(sample_out))
                    .for_each(sample);
            } else {
                x.chunks_exact(sample_in)
                    .zip(y.chunks_exact_mut(sample_out))
                    .for_each(sample);
            }
            return;
        }
        broadcast_rows(y, b);
        let group = |(xs, ys): (&[f32], &mut [f32])| {
            let rows = ys.len() / oc;
            GROUP_COLS.with_borrow_mut(|cols| {
                set_len(cols, rows * fan_in);
                self.im2col(xs, cols);
                matmul(ys, rows, oc, fan_in, cols, Op::N, w, Op::T, true, 1);
            });
            if relu {
                relu_in_place(ys);
            }
        };
        let x = &x[..n * sample_in];
        let (parts_in, parts_out) = (per * sample_in, per * positions * oc);
        if threads > 1 && n > per {
            x.par_chunks(parts_in)
                .zip(y.par_chunks_mut(parts_out))
                .for_each(group);
        } else {
            x.chunks(parts_in)
                .zip(y.chunks_mut(parts_out))
                .for_each(group);
        }
    }

    /// Weight, bias and (when `dx` is given) input gradients from `dy`, rebuilding the columns
    /// of `x` group by group as the forward did (or, where the direct kernels apply, summing the
    /// weight gradient from `x` in place). With `relu_out` (the forward ran with `relu`,
    /// and this is its output), `dy` is the ReLU's output gradient and each group masks it in
    /// cache first.
    ///
    /// The samples are split into one contiguous part per thread; each part sums its own
    /// `dWᵀ[fan_in, oc] = colsᵀ · dy` and bias gradient over its groups, and for each sample
    /// turns `dcols[positions, fan_in] = dy · W` back into pixels right away, in the same
    /// cache-resident buffer. The parts' sums are added (and `dWᵀ` transposed into `dW[oc,
    /// fan_in]`) at the end: `gemm` runs `colsᵀ · dy` faster than `dyᵀ · cols` (the cnn's second
    /// conv, one thread, AVX-512: 2.16 ms against 2.56 ms).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        dy: &[f32],
        relu_out: Option<&[f32]>,
        n: usize,
        dx: Option<&mut Vec<f32>>,
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let (positions, fan_in, oc) = (self.positions(), self.fan_in(), self.out_channels);
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let sample_out = positions * oc;
        let per = self.samples_per_group();
        let parts = threads.clamp(1, n.max(1));
        let per_part = n.div_ceil(parts).max(1);
        let direct = conv_direct::applies(self);
        // `dWᵀ` rows: the direct kernels' padded width, or the GEMM's.
        let dwt_width = if direct {
            conv_direct::padded_channels(self)
        } else {
            oc
        };
        let masked_len = if relu_out.is_some() {
            per * sample_out
        } else {
            0
        };
        let part_scratch = fan_in * dwt_width + oc + per * positions * fan_in + masked_len;
        set_len(scratch, parts * part_scratch);
        let w = &p[..self.weight_len()];
        let want_dx = dx.is_some();
        let part = |part: Part<'_>| {
            let (dwt, rest) = part.space.split_at_mut(fan_in * dwt_width);
            if direct {
                dwt.fill(0.0);
            }
            let (db, rest) = rest.split_at_mut(oc);
            let (cols, masked) = rest.split_at_mut(per * positions * fan_in);
            let samples = part.dy.len() / sample_out;
            for (k, first) in (0..samples).step_by(per).enumerate() {
                let count = per.min(samples - first);
                let rows = count * positions;
                let outputs = first * sample_out..(first + count) * sample_out;
                let dy_group = match relu_out {
                    Some(_) => {
                        let masked = &mut masked[..rows * oc];
                        relu_backward(&part.relu_out[outputs.clone()], &part.dy[outputs], masked);
                        &*masked
                    }
                    None => &part.dy[outputs],
                };
                column_sums(db, dy_group, k > 0);
                let cols = &mut cols[..rows * fan_in];
                if direct {
                    for (s, dy1) in (first..).zip(dy_group.chunks_exact(sample_out)) {
                        let x1 = &part.x[s * sample_in..(s + 1) * sample_in];
                        conv_direct::add_weight_grad_sample(self, x1, dy1, dwt);
                    }
                } else {
                    self.im2col(
                        &part.x[first * sample_in..(first + count) * sample_in],
                        cols,
                    );
                    matmul(
                        dwt,
                        fan_in,
                        oc,
                        rows,
                        cols,
                        Op::T,
                        dy_group,
                        Op::N,
                        k > 0,
                        1,
                    );
                }
                if want_dx {
                    // The columns are consumed: the same buffer takes each sample's `dcols`.
                    let dcols = &mut cols[..positions * fan_in];
                    for (s, dy1) in (first..).zip(dy_group.chunks_exact(sample_out)) {
                        matmul(dcols, positions, fan_in, oc, dy1, Op::N, w, Op::N, false, 1);
                        let dx1 = &mut part.dx[s * sample_in..(s + 1) * sample_in];
                        self.col2im_sample(dcols, dx1);
                    }
                }
            }
        };
        let mut dx_parts: Vec<&mut [f32]> = match dx {
            Some(dx) => dx.chunks_mut(per_part * sample_in).collect(),
            None => Vec::new(),
        };
        dx_parts.resize_with(parts, || &mut [][..]);
        let relu_out = relu_out.unwrap_or_default();
        let work: Vec<Part<'_>> = x[..n * sample_in]
            .chunks(per_part * sample_in)
            .zip(dy.chunks(per_part * sample_out))
            .zip(dx_parts)
            .zip(scratch.chunks_exact_mut(part_scratch))
            .enumerate()
            .map(|(q, (((x, dy), dx), space))| Part {
                x,
                dy,
                relu_out: relu_out
                    .get(q * per_part * sample_out..q * per_part * sample_out + dy.len())
                    .unwrap_or_default(),
                dx,
                space,
            })
            .collect();
        let used = work.len();
        if used > 1 {
            work.into_par_iter().for_each(part);
        } else {
            work.into_iter().for_each(part);
        }
        let (gw, gb) = g.split_at_mut(self.weight_len());
        let sum = |at: usize| -> f32 { (0..used).map(|q| scratch[q * part_scratch + at]).sum() };
        for (o, row) in gw.chunks_exact_mut(fan_in).enumerate() {
            for (f, v) in row.iter_mut().enumerate() {
                let t = sum(f * dwt_width + o);
                *v = if accumulate { *v + t } else { t };
            }
        }
        for (o, v) in gb.iter_mut().enumerate() {
            let t = sum(fan_in * dwt_width + o);
            *v = if accumulate { *v + t } else { t };
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

    /// The columns of the samples in `x` (as many as `cols` has room for).
    fn im2col(&self, x: &[f32], cols: &mut [f32]) {
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let sample_cols = self.positions() * self.fan_in();
        for (xs, cs) in x
            .chunks_exact(sample_in)
            .zip(cols.chunks_exact_mut(sample_cols))
        {
            self.im2col_sample(xs, cs);
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
