//! Causal multi-head self-attention over a sample's sequence `[seq, width]`, as GPT-2's
//! `c_attn` → scaled dot product under the causal mask → `c_proj`:
//!
//! `qkv = x·W_qkvᵀ + b_qkv` (`[seq, 3·width]`: queries, keys, values side by side), per head `h`
//! of `d = width / heads` columns `o_t = Σ_{j ≤ t} softmax_j(q_t·k_j / √d) · v_j`, the heads'
//! outputs side by side, then `y = o·W_projᵀ + b_proj`.
//!
//! Memory: the scores are never held for a batch: one head of one sample at a time (`seq × seq`
//! values, made by a GEMM, turned into probabilities in place, used and dropped), and the
//! forward keeps only each row's log-sum-exp. The backward makes the probabilities again from it
//! (as FlashAttention does), so a micro-batch's stash is its `qkv`, its heads' outputs and
//! `heads · seq` numbers per sample, linear in the sequence length.
//!
//! Work splits over threads by sample; within a sample the heads run in order on one thread, so
//! the results do not depend on the thread count.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::kernels::{Op, column_sums, linear_forward, matmul};

/// One attention's cached keys and values for decoding: `[positions, width]` each, all heads
/// side by side (as `qkv` holds them).
#[derive(Clone, Debug, Default)]
pub struct KeyValues {
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
}

/// Causal self-attention geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CausalSelfAttention {
    /// Positions per sample.
    pub seq: usize,
    /// Values per position.
    pub width: usize,
    /// Heads (dividing `width`).
    pub heads: usize,
}

impl CausalSelfAttention {
    /// `W_qkv`, `b_qkv`, `W_proj`, `b_proj`.
    pub fn param_count(&self) -> usize {
        let c = self.width;
        3 * c * c + 3 * c + c * c + c
    }

    /// `(offset, len)` of `W_qkv`, `b_qkv`, `W_proj` and `b_proj` in the layer's parameters.
    pub fn tensors(&self) -> [(usize, usize); 4] {
        let c = self.width;
        [
            (0, 3 * c * c),
            (3 * c * c, 3 * c),
            (3 * c * c + 3 * c, c * c),
            (4 * c * c + 3 * c, c),
        ]
    }

    /// Values a micro-batch of `n` samples stashes for the backward: its `qkv`, its heads'
    /// outputs, and each row's log-sum-exp per head.
    pub fn stash_len(&self, n: usize) -> usize {
        let rows = n * self.seq;
        rows * 3 * self.width + rows * self.width + n * self.heads * self.seq
    }

    /// Values the backward of `n` samples works in (the heads' output gradient and `dqkv`).
    pub fn scratch_len(&self, n: usize) -> usize {
        4 * n * self.seq * self.width
    }

    fn head_dim(&self) -> usize {
        self.width / self.heads.max(1)
    }

    /// `y` (`[n·seq, width]`) from `x`; stashes `qkv`, the heads' outputs and every row's
    /// log-sum-exp in `stash` ([`CausalSelfAttention::stash_len`] values).
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        stash: &mut [f32],
        threads: usize,
    ) {
        let (t, c, h) = (self.seq, self.width, self.heads);
        let rows = n * t;
        let [wqkv, bqkv, wproj, bproj] = self.tensors().map(|(o, l)| &p[o..o + l]);
        let (qkv, rest) = stash.split_at_mut(rows * 3 * c);
        let (att, lse) = rest.split_at_mut(rows * c);
        linear_forward(qkv, rows, 3 * c, c, x, wqkv, bqkv, threads);
        let qkv = &*qkv;
        let work = |(s, (att, lse)): (usize, (&mut [f32], &mut [f32]))| {
            self.attend(&qkv[s * t * 3 * c..(s + 1) * t * 3 * c], att, lse);
        };
        let parts = att.chunks_mut(t * c).zip(lse.chunks_mut(h * t)).enumerate();
        if threads > 1 && n > 1 {
            parts.par_bridge().for_each(work);
        } else {
            parts.for_each(work);
        }
        linear_forward(y, rows, c, c, att, wproj, bproj, threads);
    }

    /// Decoding: `y` (`[rows, width]`) for `rows` new positions `at..at + rows` of one
    /// sequence from their `x`, each attending to every earlier position through `cache` (the
    /// keys and values of positions `0..at`, to which theirs are added). The same products and
    /// softmax as [`CausalSelfAttention::forward`], in loops over the cached rows: a decode step
    /// reads each cached key and value once.
    pub(crate) fn decode(
        &self,
        p: &[f32],
        x: &[f32],
        rows: usize,
        at: usize,
        cache: &mut KeyValues,
        y: &mut [f32],
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let (c, d) = (self.width, self.head_dim());
        let [wqkv, bqkv, wproj, bproj] = self.tensors().map(|(o, l)| &p[o..o + l]);
        crate::kernels::set_len(scratch, rows * 4 * c + at + rows);
        let (qkv, rest) = scratch.split_at_mut(rows * 3 * c);
        let (att, scores) = rest.split_at_mut(rows * c);
        linear_forward(qkv, rows, 3 * c, c, x, wqkv, bqkv, threads);
        cache.keys.truncate(at * c);
        cache.values.truncate(at * c);
        for row in qkv.chunks_exact(3 * c) {
            cache.keys.extend_from_slice(&row[c..2 * c]);
            cache.values.extend_from_slice(&row[2 * c..]);
        }
        let scale = 1.0 / (d as f32).sqrt();
        for (i, (row, out)) in qkv
            .chunks_exact(3 * c)
            .zip(att.chunks_exact_mut(c))
            .enumerate()
        {
            let live = &mut scores[..=at + i];
            for h in 0..self.heads {
                let q = &row[h * d..(h + 1) * d];
                for (j, s) in live.iter_mut().enumerate() {
                    let k = &cache.keys[j * c + h * d..j * c + (h + 1) * d];
                    *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
                }
                let max = live
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                let mut sum = 0.0f32;
                for s in live.iter_mut() {
                    *s = (*s * scale - max).exp();
                    sum += *s;
                }
                let o = &mut out[h * d..(h + 1) * d];
                o.fill(0.0);
                for (j, &w) in live.iter().enumerate() {
                    let v = &cache.values[j * c + h * d..j * c + (h + 1) * d];
                    for (o, v) in o.iter_mut().zip(v) {
                        *o += w / sum * v;
                    }
                }
            }
        }
        linear_forward(y, rows, c, c, att, wproj, bproj, threads);
    }

    /// One sample: its heads' outputs `att` (`[seq, width]`) and each row's log-sum-exp `lse`
    /// (`[heads, seq]`) from its `qkv` (`[seq, 3·width]`). Per head, the scores `q·kᵀ` and the
    /// output `p·v` are GEMMs over the head's `seq × seq` block (one head's, never the batch's).
    fn attend(&self, qkv: &[f32], att: &mut [f32], lse: &mut [f32]) {
        let (t, d) = (self.seq, self.head_dim());
        let scale = 1.0 / (d as f32).sqrt();
        let mut head = HeadBuffers::new(t, d);
        for h in 0..self.heads {
            head.gather(qkv, self.width, h, d);
            let HeadBuffers { q, k, v, s, o, .. } = &mut head;
            matmul(s, t, t, d, q, Op::N, k, Op::T, false, 1);
            for (i, row) in s.chunks_exact_mut(t).enumerate() {
                let live = &mut row[..=i];
                let max = live
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                let mut sum = 0.0f32;
                for x in live.iter_mut() {
                    *x = (*x * scale - max).exp();
                    sum += *x;
                }
                for x in live.iter_mut() {
                    *x /= sum;
                }
                row[i + 1..].fill(0.0);
                lse[h * t + i] = max + sum.ln();
            }
            matmul(o, t, d, t, s, Op::N, v, Op::N, false, 1);
            scatter(o, att, self.width, h * d, d);
        }
    }

    /// One sample's `dqkv` from its stash and `datt`: with `P` made again from the scores and
    /// the log-sum-exp, `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`, `dQ = dS·K/√d`,
    /// `dK = dSᵀ·Q/√d`, each a GEMM over the head's block.
    fn attend_backward(
        &self,
        qkv: &[f32],
        att: &[f32],
        lse: &[f32],
        datt: &[f32],
        dqkv: &mut [f32],
    ) {
        let (t, c, d) = (self.seq, self.width, self.head_dim());
        let scale = 1.0 / (d as f32).sqrt();
        let mut head = HeadBuffers::new(t, d);
        for h in 0..self.heads {
            head.gather(qkv, c, h, d);
            let HeadBuffers {
                q,
                k,
                v,
                s,
                o,
                d_o,
                dp,
                dq,
                dk,
                dv,
            } = &mut head;
            gather(att, o, c, h * d, d);
            gather(datt, d_o, c, h * d, d);
            matmul(s, t, t, d, q, Op::N, k, Op::T, false, 1);
            for (i, row) in s.chunks_exact_mut(t).enumerate() {
                let l = lse[h * t + i];
                for x in &mut row[..=i] {
                    *x = (*x * scale - l).exp();
                }
                row[i + 1..].fill(0.0);
            }
            matmul(dv, t, d, t, s, Op::T, d_o, Op::N, false, 1);
            matmul(dp, t, t, d, d_o, Op::N, v, Op::T, false, 1);
            for (i, (p_row, dp_row)) in s.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate() {
                let delta = dot(&d_o[i * d..(i + 1) * d], &o[i * d..(i + 1) * d]);
                for (dpx, &px) in dp_row.iter_mut().zip(p_row) {
                    *dpx = px * (*dpx - delta) * scale;
                }
            }
            let ds = &*dp;
            matmul(dq, t, d, t, ds, Op::N, k, Op::N, false, 1);
            matmul(dk, t, d, t, ds, Op::T, q, Op::N, false, 1);
            scatter(dq, dqkv, 3 * c, h * d, d);
            scatter(dk, dqkv, 3 * c, c + h * d, d);
            scatter(dv, dqkv, 3 * c, 2 * c + h * d, d);
        }
    }

    /// Parameter gradients (added, or overwritten when `!accumulate`) and, when asked, `dx`.
    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        stash: &[f32],
        dy: &[f32],
        n: usize,
        dx: Option<&mut [f32]>,
        scratch: &mut [f32],
        threads: usize,
    ) {
        let (t, c, h) = (self.seq, self.width, self.heads);
        let rows = n * t;
        let [wqkv, _, wproj, _] = self.tensors().map(|(o, l)| &p[o..o + l]);
        let (qkv, rest) = stash.split_at(rows * 3 * c);
        let (att, lse) = rest.split_at(rows * c);
        let [gwqkv, gbqkv, gwproj, gbproj] = {
            let (a, rest) = g.split_at_mut(3 * c * c);
            let (b, rest) = rest.split_at_mut(3 * c);
            let (w, b2) = rest.split_at_mut(c * c);
            [a, b, w, b2]
        };
        // The projection: dW_proj (+)= dyᵀ·o, db_proj (+)= Σ dy, do = dy·W_proj.
        matmul(
            gwproj,
            c,
            c,
            rows,
            dy,
            Op::T,
            att,
            Op::N,
            accumulate,
            threads,
        );
        column_sums(gbproj, dy, accumulate);
        let (datt, dqkv) = scratch[..self.scratch_len(n)].split_at_mut(rows * c);
        matmul(datt, rows, c, c, dy, Op::N, wproj, Op::N, false, threads);
        let datt = &*datt;
        let work = |(s, dqkv): (usize, &mut [f32])| {
            let span = |w: usize| s * t * w..(s + 1) * t * w;
            self.attend_backward(
                &qkv[span(3 * c)],
                &att[span(c)],
                &lse[s * h * t..(s + 1) * h * t],
                &datt[span(c)],
                dqkv,
            );
        };
        let parts = dqkv.chunks_mut(t * 3 * c).enumerate();
        if threads > 1 && n > 1 {
            parts.par_bridge().for_each(work);
        } else {
            parts.for_each(work);
        }
        let dqkv = &*dqkv;
        // The input projection: dW_qkv (+)= dqkvᵀ·x, db_qkv (+)= Σ dqkv, dx = dqkv·W_qkv.
        matmul(
            gwqkv,
            3 * c,
            c,
            rows,
            dqkv,
            Op::T,
            x,
            Op::N,
            accumulate,
            threads,
        );
        column_sums(gbqkv, dqkv, accumulate);
        if let Some(dx) = dx {
            matmul(dx, rows, c, 3 * c, dqkv, Op::N, wqkv, Op::N, false, threads);
        }
    }
}

/// One head's operands, gathered contiguous from a sample's strided rows, and its scratch.
struct HeadBuffers {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores, then probabilities: `[seq, seq]`.
    s: Vec<f32>,
    o: Vec<f32>,
    d_o: Vec<f32>,
    dp: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

impl HeadBuffers {
    fn new(t: usize, d: usize) -> Self {
        let m = || vec![0.0; t * d];
        Self {
            q: m(),
            k: m(),
            v: m(),
            s: vec![0.0; t * t],
            o: m(),
            d_o: m(),
            dp: vec![0.0; t * t],
            dq: m(),
            dk: m(),
            dv: m(),
        }
    }

    /// Head `h`'s queries, keys and values (`d` columns each) from `qkv` (`[seq, 3·width]`).
    fn gather(&mut self, qkv: &[f32], width: usize, h: usize, d: usize) {
        gather(qkv, &mut self.q, 3 * width, h * d, d);
        gather(qkv, &mut self.k, 3 * width, width + h * d, d);
        gather(qkv, &mut self.v, 3 * width, 2 * width + h * d, d);
    }
}

/// Columns `col..col + d` of every row (`stride` values each) of `from` into `to`, contiguous.
fn gather(from: &[f32], to: &mut [f32], stride: usize, col: usize, d: usize) {
    for (row, out) in from.chunks_exact(stride).zip(to.chunks_exact_mut(d)) {
        out.copy_from_slice(&row[col..col + d]);
    }
}

/// Contiguous rows of `d` from `from` into columns `col..col + d` of `to`'s rows.
fn scatter(from: &[f32], to: &mut [f32], stride: usize, col: usize, d: usize) {
    for (row, out) in from.chunks_exact(d).zip(to.chunks_exact_mut(stride)) {
        out[col..col + d].copy_from_slice(row);
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
