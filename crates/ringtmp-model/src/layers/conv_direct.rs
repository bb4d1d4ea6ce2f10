//! Direct kernels for a convolution with short kernel rows — the first conv of a grey or colour
//! image, whose kernel row is 5 or 15 values — without im2col.
//!
//! Through im2col such a conv copies 25 (or 75) values per output pixel and then runs a GEMM
//! whose inner dimension is only 25: on the cnn's first conv the copy took half the forward and
//! the GEMM ran at a third of its peak. Here each output pixel reads its input in place:
//! - forward: a block of [`PIXELS`] neighbouring output pixels × [`LANES`] output channels is
//!   held in registers, and every tap (kernel position and input channel) adds one input value
//!   per pixel times [`LANES`] weights;
//! - weight gradient: for each kernel row, the `run = kernel × in_channels` weights of that row
//!   × [`LANES`] output channels are held in registers over all of a sample's output pixels (the
//!   input values of a kernel row are contiguous in NHWC).
//!
//! Only for geometries without padding and with `run ≤ MAX_RUN`; the others take im2col. The
//! weights are used transposed, `[fan_in, oc_pad]`, with `oc_pad` the output channels rounded up
//! to [`LANES`] (zeros in the padding), so every block loads whole vectors. The sums run in a
//! different order than the GEMM's, so results agree to rounding, not bit for bit (tested).

use multiversion::multiversion;

use super::conv_shape::Conv2d;

/// Output channels per register block: one AVX-512 vector, two AVX2 or four NEON vectors.
pub(super) const LANES: usize = 16;
/// Neighbouring output pixels per forward block.
const PIXELS: usize = 4;
/// Longest kernel row (kernel × in_channels values) the direct kernels take.
pub(super) const MAX_RUN: usize = 16;

/// Whether the direct kernels handle this convolution.
pub(super) fn applies(conv: &Conv2d) -> bool {
    conv.padding == 0 && conv.kernel * conv.in_channels <= MAX_RUN
}

/// Output channels rounded up to whole blocks.
pub(super) fn padded_channels(conv: &Conv2d) -> usize {
    conv.out_channels.div_ceil(LANES) * LANES
}

/// The weights `w[oc, fan_in]` as blocks of [`LANES`] output channels:
/// `wt[block · fan_in + f][l] = w[block · LANES + l, f]`, zero past the last channel.
pub(super) fn block_weights(conv: &Conv2d, w: &[f32], wt: &mut Vec<[f32; LANES]>) {
    let (fan_in, oc) = (conv.fan_in(), conv.out_channels);
    wt.clear();
    wt.resize(oc.div_ceil(LANES) * fan_in, [0.0; LANES]);
    for (o, row) in w.chunks_exact(fan_in).enumerate().take(oc) {
        for (f, v) in row.iter().enumerate() {
            wt[(o / LANES) * fan_in + f][o % LANES] = *v;
        }
    }
}

/// Calls `$f::<RUN>($args)` with the convolution's kernel row length as the constant `RUN`.
macro_rules! with_run {
    ($conv:expr, $f:ident($($arg:expr),*)) => {
        match $conv.kernel * $conv.in_channels {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*),
            8 => $f::<8>($($arg),*),
            9 => $f::<9>($($arg),*),
            10 => $f::<10>($($arg),*),
            11 => $f::<11>($($arg),*),
            12 => $f::<12>($($arg),*),
            13 => $f::<13>($($arg),*),
            14 => $f::<14>($($arg),*),
            15 => $f::<15>($($arg),*),
            16 => $f::<16>($($arg),*),
            other => unreachable!("a kernel row of {other} values: `applies` admits 1..=16"),
        }
    };
}

/// One sample's output `y[positions, oc] = bias + conv(x)` (then ReLU when `relu`), from the
/// blocked weights of [`block_weights`].
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub(super) fn forward_sample(
    conv: &Conv2d,
    wt: &[[f32; LANES]],
    bias: &[f32],
    x: &[f32],
    y: &mut [f32],
    relu: bool,
) {
    with_run!(conv, forward_rows(conv, wt, bias, x, y, relu));
}

#[inline(always)]
fn forward_rows<const RUN: usize>(
    conv: &Conv2d,
    wt: &[[f32; LANES]],
    bias: &[f32],
    x: &[f32],
    y: &mut [f32],
    relu: bool,
) {
    let (s, c, oc, fan_in) = (
        conv.stride,
        conv.in_channels,
        conv.out_channels,
        conv.fan_in(),
    );
    let row_len = conv.in_width * c;
    let mut init = [0.0f32; LANES];
    for (block, ob) in (0..oc).step_by(LANES).enumerate() {
        let width = LANES.min(oc - ob);
        init[..width].copy_from_slice(&bias[ob..ob + width]);
        let block = Block::<RUN> {
            x,
            wt: &wt[block * fan_in..(block + 1) * fan_in],
            row_len,
            step: s * c,
            kernel: conv.kernel,
        };
        for oy in 0..conv.out_height {
            let mut ox = 0;
            while ox < conv.out_width {
                let origin = oy * s * row_len + ox * s * c;
                let at = (oy * conv.out_width + ox) * oc + ob;
                if ox + PIXELS <= conv.out_width {
                    let acc = block.sums::<PIXELS>(origin, init);
                    store(&acc, &mut y[at..], oc, width, relu);
                    ox += PIXELS;
                } else {
                    let acc = block.sums::<1>(origin, init);
                    store(&acc, &mut y[at..], oc, width, relu);
                    ox += 1;
                }
            }
        }
    }
}

/// What a forward block reads: the sample's input and one block of output channels' weights.
struct Block<'a, const RUN: usize> {
    x: &'a [f32],
    /// `[fan_in]` vectors of [`LANES`] weights.
    wt: &'a [[f32; LANES]],
    /// Input values in one image row.
    row_len: usize,
    /// Input values between neighbouring output pixels.
    step: usize,
    kernel: usize,
}

impl<const RUN: usize> Block<'_, RUN> {
    /// Sums for `P` neighbouring output pixels, the first of which reads its input from
    /// `origin`, starting from `init`. Kernel row by kernel row: each pixel's `RUN` input values
    /// are contiguous, and with `P` and `RUN` constant the sums stay in registers and the
    /// indices need no checks inside the row.
    #[inline(always)]
    fn sums<const P: usize>(&self, origin: usize, init: [f32; LANES]) -> [[f32; LANES]; P] {
        let mut acc = [init; P];
        for ky in 0..self.kernel {
            let w: &[[f32; LANES]; RUN] = self.wt[ky * RUN..(ky + 1) * RUN]
                .try_into()
                .expect("RUN weight vectors");
            let base = origin + ky * self.row_len;
            let xs: [&[f32; RUN]; P] = std::array::from_fn(|j| {
                let at = base + j * self.step;
                self.x[at..at + RUN].try_into().expect("RUN input values")
            });
            for (q, w) in w.iter().enumerate() {
                for (acc, xs) in acc.iter_mut().zip(&xs) {
                    let a = xs[q];
                    for l in 0..LANES {
                        acc[l] = a.mul_add(w[l], acc[l]);
                    }
                }
            }
        }
        acc
    }
}

/// Writes `P` pixels' sums (`width` channels of each, ReLU applied when `relu`) to `y`, whose
/// pixels are `oc` values apart.
#[inline(always)]
fn store<const P: usize>(
    acc: &[[f32; LANES]; P],
    y: &mut [f32],
    oc: usize,
    width: usize,
    relu: bool,
) {
    for (j, acc) in acc.iter().enumerate() {
        for (o, v) in y[j * oc..j * oc + width].iter_mut().zip(acc) {
            *o = if relu { v.max(0.0) } else { *v };
        }
    }
}

/// Adds one sample's weight gradient to `dwt[fan_in, oc_pad]` (`oc_pad` =
/// [`padded_channels`]), from its input `x` and output gradient `dy[positions, oc]`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub(super) fn add_weight_grad_sample(conv: &Conv2d, x: &[f32], dy: &[f32], dwt: &mut [f32]) {
    with_run!(conv, weight_grad_rows(conv, x, dy, dwt));
}

/// For each block of output channels and each kernel row, the `RUN` weights of that row are
/// summed in registers over all the sample's output pixels, two pixels at a time into two sets
/// of sums (one set would wait on the previous pixel's multiply-add every time).
#[inline(always)]
fn weight_grad_rows<const RUN: usize>(conv: &Conv2d, x: &[f32], dy: &[f32], dwt: &mut [f32]) {
    let (s, c) = (conv.stride, conv.in_channels);
    let (oc, oc_pad) = (conv.out_channels, padded_channels(conv));
    let (ow, row_len, step) = (conv.out_width, conv.in_width * c, conv.stride * c);
    let input = |at: usize| -> &[f32; RUN] { x[at..at + RUN].try_into().expect("RUN values") };
    for ob in (0..oc).step_by(LANES) {
        let width = LANES.min(oc - ob);
        if width < LANES {
            // A last partial block of channels: plainly, value by value.
            for p in 0..conv.out_height * ow {
                let (oy, ox) = (p / ow, p % ow);
                for ky in 0..conv.kernel {
                    let xs = input((oy * s + ky) * row_len + ox * step);
                    for (q, a) in xs.iter().enumerate() {
                        let at = (ky * RUN + q) * oc_pad + ob;
                        for (d, g) in dwt[at..at + width].iter_mut().zip(&dy[p * oc + ob..]) {
                            *d = a.mul_add(*g, *d);
                        }
                    }
                }
            }
            continue;
        }
        let gradient = |p: usize| -> &[f32; LANES] {
            dy[p * oc + ob..p * oc + ob + LANES]
                .try_into()
                .expect("LANES values")
        };
        for ky in 0..conv.kernel {
            let mut even = [[0.0f32; LANES]; RUN];
            let mut odd = [[0.0f32; LANES]; RUN];
            for oy in 0..conv.out_height {
                let row = (oy * s + ky) * row_len;
                let mut ox = 0;
                while ox + 2 <= ow {
                    let (g0, g1) = (gradient(oy * ow + ox), gradient(oy * ow + ox + 1));
                    let (x0, x1) = (input(row + ox * step), input(row + (ox + 1) * step));
                    for ((e, o), (a0, a1)) in even.iter_mut().zip(&mut odd).zip(x0.iter().zip(x1)) {
                        for l in 0..LANES {
                            e[l] = a0.mul_add(g0[l], e[l]);
                            o[l] = a1.mul_add(g1[l], o[l]);
                        }
                    }
                    ox += 2;
                }
                if ox < ow {
                    let (g0, x0) = (gradient(oy * ow + ox), input(row + ox * step));
                    for (e, a0) in even.iter_mut().zip(x0) {
                        for l in 0..LANES {
                            e[l] = a0.mul_add(g0[l], e[l]);
                        }
                    }
                }
            }
            for (q, (e, o)) in even.iter().zip(&odd).enumerate() {
                let at = (ky * RUN + q) * oc_pad + ob;
                for (l, d) in dwt[at..at + LANES].iter_mut().enumerate() {
                    *d += e[l] + o[l];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{Aux, Fused, MaxPool2d, OutputGrad};

    fn geometry(size: (usize, usize, usize), oc: usize, k: usize, s: usize, p: usize) -> Conv2d {
        let (h, w, c) = size;
        Conv2d {
            in_height: h,
            in_width: w,
            in_channels: c,
            out_channels: oc,
            kernel: k,
            stride: s,
            padding: p,
            out_height: (h + 2 * p - k) / s + 1,
            out_width: (w + 2 * p - k) / s + 1,
        }
    }

    fn values(len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + salt * 104_729) % 211) as f32 - 105.0) / 53.0)
            .collect()
    }

    /// The convolution by its definition, in f64: `(y, dW, db, dx)` for `n` samples.
    fn reference(
        conv: &Conv2d,
        w: &[f32],
        b: &[f32],
        x: &[f32],
        dy: &[f32],
        n: usize,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (h, wd, c, oc, k) = (
            conv.in_height,
            conv.in_width,
            conv.in_channels,
            conv.out_channels,
            conv.kernel,
        );
        let (oh, ow) = (conv.out_height, conv.out_width);
        let mut y = vec![0.0; n * oh * ow * oc];
        let mut dw = vec![0.0; w.len()];
        let mut db = vec![0.0; oc];
        let mut dx = vec![0.0; x.len()];
        for bi in 0..n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for o in 0..oc {
                        let at = ((bi * oh + oy) * ow + ox) * oc + o;
                        let g = dy[at] as f64;
                        let mut sum = b[o] as f64;
                        db[o] += g;
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * conv.stride + ky) as isize - conv.padding as isize;
                                let ix = (ox * conv.stride + kx) as isize - conv.padding as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                for ci in 0..c {
                                    let xi = ((bi * h + iy as usize) * wd + ix as usize) * c + ci;
                                    let wi = ((o * k + ky) * k + kx) * c + ci;
                                    sum += x[xi] as f64 * w[wi] as f64;
                                    dw[wi] += g * x[xi] as f64;
                                    dx[xi] += g * w[wi] as f64;
                                }
                            }
                        }
                        y[at] = sum;
                    }
                }
            }
        }
        (y, dw, db, dx)
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-5 * scale,
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }

    // Both paths — the direct kernels (no padding, short kernel rows) and grouped im2col + GEMM
    // (the rest) — against the convolution's definition: outputs, the fused ReLU, weight, bias
    // and input gradients, at one and two threads, for channel counts that fill the register
    // blocks and counts that leave a tail.
    #[test]
    fn both_conv_paths_match_the_definition() {
        let cases = [
            (geometry((12, 11, 1), 32, 5, 1, 0), true),
            (geometry((9, 13, 3), 20, 5, 2, 0), true),
            (geometry((7, 8, 2), 17, 4, 1, 0), true),
            (geometry((6, 6, 1), 5, 1, 1, 0), true),
            (geometry((8, 8, 3), 7, 3, 1, 1), false),
            (geometry((8, 9, 8), 10, 3, 2, 0), false),
        ];
        for (conv, direct) in cases {
            assert_eq!(applies(&conv), direct, "{conv:?}");
            let n = 5;
            let sample_in = conv.in_height * conv.in_width * conv.in_channels;
            let out = n * conv.out_height * conv.out_width * conv.out_channels;
            let p = values(conv.param_count(), 1);
            let (w, b) = p.split_at(conv.weight_len());
            let x = values(n * sample_in, 2);
            let dy = values(out, 3);
            let (y_ref, dw_ref, db_ref, dx_ref) = reference(&conv, w, b, &x, &dy, n);
            for threads in [1, 2] {
                let what = |part: &str| format!("{part}, direct {direct}, {threads} thread(s)");
                let mut y = vec![f32::NAN; out];
                let mut indices = Vec::new();
                conv.forward(&p, &x, n, &mut y, Fused::Nothing, &mut indices, threads);
                assert_close(&y, &y_ref, &what("y"));
                let (g, dx) = gradients(&conv, &p, &x, OutputGrad::Plain(&dy), n, threads);
                let (gw, gb) = g.split_at(conv.weight_len());
                assert_close(gw, &dw_ref, &what("dW"));
                assert_close(gb, &db_ref, &what("db"));
                assert_close(&dx, &dx_ref, &what("dx"));

                // With the ReLU fused: its output, and the gradient masked by it.
                let mut r = vec![f32::NAN; out];
                conv.forward(&p, &x, n, &mut r, Fused::Relu, &mut indices, threads);
                let relu_ref: Vec<f64> = y_ref.iter().map(|v| v.max(0.0)).collect();
                assert_close(&r, &relu_ref, &what("relu(y)"));
                let masked: Vec<f32> = dy
                    .iter()
                    .zip(&r)
                    .map(|(g, y)| if *y > 0.0 { *g } else { 0.0 })
                    .collect();
                let (_, dw_m, db_m, dx_m) = reference(&conv, w, b, &x, &masked, n);
                let grad = OutputGrad::Relu {
                    dy: &dy,
                    relu_out: &r,
                };
                let (g, dx) = gradients(&conv, &p, &x, grad, n, threads);
                let (gw, gb) = g.split_at(conv.weight_len());
                assert_close(gw, &dw_m, &what("dW under the ReLU"));
                assert_close(gb, &db_m, &what("db under the ReLU"));
                assert_close(&dx, &dx_m, &what("dx under the ReLU"));

                // With the ReLU and a max-pool fused (windows apart and overlapping): the same
                // bits as the pool run on the fused ReLU's output, and as the ReLU-fused backward
                // from the pool's own backward. The biases are lowered by the median window
                // maximum, so that whole windows are negative (pooled to zero, their gradient
                // masked) and others are not.
                for (kernel, stride) in [(2, 2), (3, 2)] {
                    let what = |part: &str| what(&format!("{part}, pool {kernel}/{stride}"));
                    let pool = pool_after(&conv, kernel, stride);
                    let pooled_len = n * pool.sample_out();
                    let (mut want, mut aux) = (vec![f32::NAN; pooled_len], Aux::default());
                    pool.forward(&y, n, &mut want, &mut aux, 1);
                    want.sort_by(f32::total_cmp);
                    let mut p = p.clone();
                    let median = want[pooled_len / 2];
                    p[conv.weight_len()..].iter_mut().for_each(|b| *b -= median);
                    conv.forward(&p, &x, n, &mut r, Fused::Relu, &mut indices, threads);
                    pool.forward(&r, n, &mut want, &mut aux, 1);
                    let mut pooled = vec![f32::NAN; pooled_len];
                    let fused = Fused::ReluPool(&pool);
                    conv.forward(&p, &x, n, &mut pooled, fused, &mut indices, threads);
                    assert_eq!(bits(&pooled), bits(&want), "{}", what("pooled"));
                    assert_eq!(indices, aux.indices, "{}", what("pool indices"));
                    let zeros = pooled.iter().filter(|v| **v == 0.0).count();
                    assert!(
                        zeros > 0 && zeros < pooled_len,
                        "{zeros}/{pooled_len} {conv:?}"
                    );
                    let dpooled = values(pooled_len, 4);
                    let mut drelu = vec![f32::NAN; out];
                    MaxPool2d::backward(&aux, &dpooled, &mut drelu);
                    let grad = OutputGrad::Relu {
                        dy: &drelu,
                        relu_out: &r,
                    };
                    let (g_apart, dx_apart) = gradients(&conv, &p, &x, grad, n, threads);
                    let grad = OutputGrad::ReluPool {
                        pool: &pool,
                        dy: &dpooled,
                        pooled: &pooled,
                        indices: &indices,
                    };
                    let (g, dx) = gradients(&conv, &p, &x, grad, n, threads);
                    assert_eq!(bits(&g), bits(&g_apart), "{}", what("gradients"));
                    assert_eq!(bits(&dx), bits(&dx_apart), "{}", what("dx"));
                }
            }
        }
    }

    /// `conv`'s parameter and input gradients from `grad`, into buffers filled with NaN first
    /// (so a value the backward did not write shows).
    fn gradients(
        conv: &Conv2d,
        p: &[f32],
        x: &[f32],
        grad: OutputGrad<'_>,
        n: usize,
        threads: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut g, mut dx) = (vec![f32::NAN; p.len()], vec![f32::NAN; x.len()]);
        let mut scratch = Vec::new();
        conv.backward(
            p,
            &mut g,
            false,
            x,
            grad,
            n,
            Some(&mut dx),
            &mut scratch,
            threads,
        );
        (g, dx)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// A max-pool over `conv`'s output.
    fn pool_after(conv: &Conv2d, kernel: usize, stride: usize) -> MaxPool2d {
        MaxPool2d {
            in_height: conv.out_height,
            in_width: conv.out_width,
            channels: conv.out_channels,
            kernel,
            stride,
            out_height: (conv.out_height - kernel) / stride + 1,
            out_width: (conv.out_width - kernel) / stride + 1,
        }
    }
}
