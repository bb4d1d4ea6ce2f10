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
//!
//! What follows a conv in the same stage may run inside it ([`Fused`]): a ReLU is applied to
//! each group's output while it is in cache, and a ReLU then a max-pool also pools it there, so
//! the conv's full-size output is never written at all; the backward rebuilds each group's
//! output gradient from the pool's (scattered to the recorded winners where the pooled value is
//! positive). The results are bit for bit those of the layers run one after the other.

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use super::conv_shape::Conv2d;
use super::pool::PooledGrad;
use super::{MaxPool2d, conv_direct};
use crate::kernels::{
    Op, broadcast_rows, column_sums, matmul, relu_backward, relu_in_place, set_len,
};

/// Column values one group of samples may fill (512 KB): within a core's L2, so the GEMM reads
/// the columns from cache right after they are written. For the cnn's second conv that is two
/// samples, 128 rows per GEMM; half that (one sample, 64 rows) ran the cnn 1–6% slower at one
/// thread and 3–4% at two (AMD EPYC, AVX-512, three alternating runs of
/// `bench-compute --models cnn --threads 1,2`).
const GROUP_COLUMNS: usize = 128 * 1024;

/// The layers after a conv, in the same stage, that run inside it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fused<'a> {
    /// None: the output is the conv's.
    Nothing,
    /// A ReLU: the output is `relu(conv(x))`.
    Relu,
    /// A ReLU then this max-pool: the output is `pool(relu(conv(x)))`, and the pool's argmax
    /// indices (into the batch's `relu(conv(x))`, as [`MaxPool2d`] records them) go to the
    /// forward's `indices`.
    ReluPool(&'a MaxPool2d),
}

/// The gradient a backward starts from: of the conv's own output, or of the last fused layer's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum OutputGrad<'a> {
    /// `dL/dy` of the conv's output.
    Plain(&'a [f32]),
    /// `dL/d relu(y)`, with the ReLU's output (its mask).
    Relu {
        /// The ReLU's output gradient.
        dy: &'a [f32],
        /// The ReLU's output.
        relu_out: &'a [f32],
    },
    /// `dL/d pool(relu(y))`, with what the fused forward produced.
    ReluPool {
        /// The pool.
        pool: &'a MaxPool2d,
        /// The pool's output gradient.
        dy: &'a [f32],
        /// The pool's output.
        pooled: &'a [f32],
        /// The pool's argmax indices.
        indices: &'a [u32],
    },
}

impl OutputGrad<'_> {
    /// Whether the conv's output gradient must be built in a buffer (anything but `Plain`).
    fn builds(&self) -> bool {
        !matches!(self, OutputGrad::Plain(_))
    }

    /// The gradient of the conv's output for `samples` (of `sample_out` values each): a slice of
    /// `dy` itself, or built in `buffer`. For the pool, exactly what its backward followed by the
    /// ReLU's would give: each pooled gradient added (in output order) at its winner, where the
    /// winner — the pooled value — is positive; zero elsewhere.
    fn samples<'b>(
        &'b self,
        samples: Range<usize>,
        sample_out: usize,
        buffer: &'b mut [f32],
    ) -> &'b [f32] {
        let outputs = samples.start * sample_out..samples.end * sample_out;
        match *self {
            OutputGrad::Plain(dy) => &dy[outputs],
            OutputGrad::Relu { dy, relu_out } => {
                let buffer = &mut buffer[..outputs.len()];
                relu_backward(&relu_out[outputs.clone()], &dy[outputs], buffer);
                buffer
            }
            OutputGrad::ReluPool {
                pool,
                dy,
                pooled,
                indices,
            } => {
                let buffer = &mut buffer[..outputs.len()];
                let pooled_len = pool.sample_out();
                for (s, dx) in samples.zip(buffer.chunks_exact_mut(sample_out)) {
                    let of_sample = s * pooled_len..(s + 1) * pooled_len;
                    let grad = PooledGrad {
                        dy: &dy[of_sample.clone()],
                        pooled: &pooled[of_sample.clone()],
                        indices: &indices[of_sample],
                    };
                    pool.relu_backward_sample(grad, (s * sample_out) as u32, dx);
                }
                buffer
            }
        }
    }
}

/// One thread's share of a backward pass.
struct Part<'a> {
    /// Its first sample's position in the batch.
    first: usize,
    /// Its samples' input.
    x: &'a [f32],
    /// Their input gradient (empty when none is wanted).
    dx: &'a mut [f32],
    /// Its scratch space: `dWᵀ` and bias sums, a group's columns, a group's output gradient.
    space: &'a mut [f32],
}

/// One group of samples in a forward pass.
struct Group<'a> {
    /// Its first sample's position in the batch.
    first: usize,
    /// Its samples' input.
    x: &'a [f32],
    /// Their output (pooled, with a fused pool).
    y: &'a mut [f32],
    /// Their pool's argmax indices (empty without a fused pool).
    indices: &'a mut [u32],
}

/// A forward's per-thread buffers, kept between calls (no allocation in the steady state).
#[derive(Default)]
struct ForwardBuffers {
    /// A group's columns.
    cols: Vec<f32>,
    /// A group's conv output, when a fused pool reduces it before it is stored.
    out: Vec<f32>,
}

thread_local! {
    static FORWARD_BUFFERS: RefCell<ForwardBuffers> = RefCell::new(ForwardBuffers::default());
}

impl Conv2d {
    fn positions(&self) -> usize {
        self.out_height * self.out_width
    }

    /// Samples whose columns one group builds at a time: as many as fit [`GROUP_COLUMNS`], at
    /// least one.
    fn samples_per_group(&self) -> usize {
        (GROUP_COLUMNS / (self.positions() * self.fan_in()).max(1)).max(1)
    }

    /// `y = conv(x)` for `n` samples, followed by what `fused` names (see [`Fused`]). With a
    /// fused pool `y` is the pool's output, and `indices` receives its argmax positions.
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        fused: Fused<'_>,
        indices: &mut Vec<u32>,
        threads: usize,
    ) {
        let (positions, oc) = (self.positions(), self.out_channels);
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let pool = match fused {
            Fused::ReluPool(pool) => Some(pool),
            _ => None,
        };
        let relu = !matches!(fused, Fused::Nothing);
        let sample_y = pool.map_or(positions * oc, MaxPool2d::sample_out);
        let direct = conv_direct::applies(self);
        let (w, b) = p.split_at(self.weight_len());
        let mut blocked = Vec::new();
        if direct {
            conv_direct::block_weights(self, w, &mut blocked);
        }
        let blocked = direct.then_some(blocked.as_slice());
        // The GEMM path's groups are the cache-sized ones; the direct kernels work a sample at
        // a time, so their groups only spread the samples over the threads.
        let per = if direct {
            n.div_ceil(threads.max(1)).max(1)
        } else {
            self.samples_per_group()
        };
        indices.resize(if pool.is_some() { n * sample_y } else { 0 }, 0);
        let mut index_parts = indices.chunks_mut(per * sample_y);
        let groups: Vec<Group<'_>> = x[..n * sample_in]
            .chunks(per * sample_in)
            .zip(y[..n * sample_y].chunks_mut(per * sample_y))
            .enumerate()
            .map(|(g, (x, y))| Group {
                first: g * per,
                x,
                y,
                indices: index_parts.next().unwrap_or_default(),
            })
            .collect();
        let run = |group: Group<'_>| {
            FORWARD_BUFFERS.with_borrow_mut(|buffers| {
                let count = group.x.len() / sample_in;
                let Some(pool) = pool else {
                    self.forward_group(w, b, blocked, group.x, group.y, relu, &mut buffers.cols);
                    return;
                };
                // The GEMM's rows are the group's; the direct kernels go a sample at a time, so
                // the conv's output is pooled while still in L1/L2.
                let sample_out = positions * oc;
                let at_once = if blocked.is_some() { 1 } else { count };
                let out = &mut buffers.out;
                set_len(out, at_once * sample_out);
                let inputs = group.x.chunks(at_once * sample_in);
                let outputs = group.y.chunks_mut(at_once * sample_y);
                let indices = group.indices.chunks_mut(at_once * sample_y);
                for (k, (x, (y, indices))) in inputs.zip(outputs.zip(indices)).enumerate() {
                    self.forward_group(w, b, blocked, x, out, relu, &mut buffers.cols);
                    let first = group.first + k * at_once;
                    for (j, (o, (y, i))) in out
                        .chunks_exact(sample_out)
                        .zip(
                            y.chunks_exact_mut(sample_y)
                                .zip(indices.chunks_exact_mut(sample_y)),
                        )
                        .enumerate()
                    {
                        pool.forward_sample(o, y, i, ((first + j) * sample_out) as u32);
                    }
                }
            });
        };
        if threads > 1 && groups.len() > 1 {
            groups.into_par_iter().for_each(run);
        } else {
            groups.into_iter().for_each(run);
        }
    }

    /// The conv (and the ReLU, when `relu`) of the samples in `x` into `y`: the direct kernels
    /// when `blocked` holds their weights, else im2col and a GEMM with `cols` as the buffer.
    fn forward_group(
        &self,
        w: &[f32],
        b: &[f32],
        blocked: Option<&[[f32; conv_direct::LANES]]>,
        x: &[f32],
        y: &mut [f32],
        relu: bool,
        cols: &mut Vec<f32>,
    ) {
        let sample_in = self.in_height * self.in_width * self.in_channels;
        let (fan_in, oc) = (self.fan_in(), self.out_channels);
        if let Some(blocked) = blocked {
            let sample_out = self.positions() * oc;
            for (xs, ys) in x
                .chunks_exact(sample_in)
                .zip(y.chunks_exact_mut(sample_out))
            {
                conv_direct::forward_sample(self, blocked, b, xs, ys, relu);
            }
            return;
        }
        let rows = y.len() / oc;
        broadcast_rows(y, b);
        set_len(cols, rows * fan_in);
        self.im2col(x, cols);
        matmul(y, rows, oc, fan_in, cols, Op::N, w, Op::T, true, 1);
        if relu {
            relu_in_place(y);
        }
    }

    /// Weight, bias and (when `dx` is given) input gradients from `grad` (the conv's output
    /// gradient, or that of the fused layers after it: see [`OutputGrad`]), rebuilding the
    /// columns of `x` group by group as the forward did (or, where the direct kernels apply,
    /// summing the weight gradient from `x` in place). Each group's output gradient is built in
    /// cache when it has to be (a fused ReLU's mask, a fused pool's scatter).
    ///
    /// The samples are split into one contiguous part per thread; each part sums its own
    /// `dWᵀ[fan_in, oc] = colsᵀ · dy` and bias gradient over its groups, and for each group
    /// turns `dcols[rows, fan_in] = dy · W` back into pixels right away, in the same
    /// cache-resident buffer. The parts' sums are added (and `dWᵀ` transposed into `dW[oc,
    /// fan_in]`) at the end: `gemm` runs `colsᵀ · dy` faster than `dyᵀ · cols` (the cnn's second
    /// conv, one thread, AVX-512: 2.16 ms against 2.56 ms).
    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        grad: OutputGrad<'_>,
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
        let built_len = if grad.builds() { per * sample_out } else { 0 };
        let part_scratch = fan_in * dwt_width + oc + per * positions * fan_in + built_len;
        set_len(scratch, parts * part_scratch);
        let w = &p[..self.weight_len()];
        let want_dx = dx.is_some();
        let part = |part: Part<'_>| {
            let (dwt, rest) = part.space.split_at_mut(fan_in * dwt_width);
            if direct {
                dwt.fill(0.0);
            }
            let (db, rest) = rest.split_at_mut(oc);
            let (cols, built) = rest.split_at_mut(per * positions * fan_in);
            let samples = part.x.len() / sample_in;
            for (k, first) in (0..samples).step_by(per).enumerate() {
                let count = per.min(samples - first);
                let rows = count * positions;
                let at = part.first + first;
                let dy_group = grad.samples(at..at + count, sample_out, built);
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
                    // The columns are consumed: the same buffer takes the group's `dcols`, one
                    // GEMM for the whole group.
                    let dcols = &mut cols[..rows * fan_in];
                    matmul(dcols, rows, fan_in, oc, dy_group, Op::N, w, Op::N, false, 1);
                    let sample_cols = positions * fan_in;
                    for (s, dcols1) in (first..).zip(dcols.chunks_exact(sample_cols)) {
                        let dx1 = &mut part.dx[s * sample_in..(s + 1) * sample_in];
                        self.col2im_sample(dcols1, dx1);
                    }
                }
            }
        };
        let mut dx_parts: Vec<&mut [f32]> = match dx {
            Some(dx) => dx.chunks_mut(per_part * sample_in).collect(),
            None => Vec::new(),
        };
        dx_parts.resize_with(parts, || &mut [][..]);
        let work: Vec<Part<'_>> = x[..n * sample_in]
            .chunks(per_part * sample_in)
            .zip(dx_parts)
            .zip(scratch.chunks_exact_mut(part_scratch))
            .enumerate()
            .map(|(q, ((x, dx), space))| Part {
                first: q * per_part,
                x,
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
