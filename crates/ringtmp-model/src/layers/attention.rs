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

use super::heads::Heads;
use crate::kernels::{Op, column_sums, linear_forward, matmul};

/// One attention's cached keys and values for decoding: `[positions, width]` each, all heads
/// side by side (as `qkv` holds them).
#[derive(Clone, Debug, Default)]
pub struct KeyValues {
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
}

impl KeyValues {
    /// Keeps positions `0..at` and appends the keys and values of the projected rows `qkv`
    /// (rows of `stride` values: queries, then `width` keys from column `keys_at`, then `width`
    /// values).
    pub(crate) fn append(
        &mut self,
        qkv: &[f32],
        stride: usize,
        keys_at: usize,
        width: usize,
        at: usize,
    ) {
        self.keys.truncate(at * width);
        self.values.truncate(at * width);
        for row in qkv.chunks_exact(stride) {
            self.keys.extend_from_slice(&row[keys_at..keys_at + width]);
            self.values
                .extend_from_slice(&row[keys_at + width..keys_at + 2 * width]);
        }
    }
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
        let c = self.width;
        let [wqkv, bqkv, wproj, bproj] = self.tensors().map(|(o, l)| &p[o..o + l]);
        crate::kernels::set_len(scratch, rows * 4 * c);
        let (qkv, att) = scratch.split_at_mut(rows * 3 * c);
        linear_forward(qkv, rows, 3 * c, c, x, wqkv, bqkv, threads);
        cache.append(qkv, 3 * c, c, c, at);
        // The queries side by side, as the shared core reads them (the cache holds the keys
        // and values).
        let mut queries = vec![0.0f32; rows * c];
        super::heads::gather(qkv, &mut queries, 3 * c, 0, c);
        let mut scores = Vec::new();
        self.heads().decode(
            &queries,
            at,
            &cache.keys,
            &cache.values,
            att,
            &mut scores,
            threads,
        );
        linear_forward(y, rows, c, c, att, wproj, bproj, threads);
    }

    /// The core's geometry: as many key/value heads as query heads.
    fn heads(&self) -> Heads {
        Heads {
            seq: self.seq,
            heads: self.heads,
            kv_heads: self.heads,
            head_dim: self.head_dim(),
        }
    }

    /// One sample: its heads' outputs `att` (`[seq, width]`) and each row's log-sum-exp `lse`
    /// (`[heads, seq]`) from its `qkv` (`[seq, 3·width]`).
    fn attend(&self, qkv: &[f32], att: &mut [f32], lse: &mut [f32]) {
        self.heads().attend(qkv, att, lse);
    }

    /// One sample's `dqkv` from its stash and `datt`.
    fn attend_backward(
        &self,
        qkv: &[f32],
        att: &[f32],
        lse: &[f32],
        datt: &[f32],
        dqkv: &mut [f32],
    ) {
        self.heads().attend_backward(qkv, att, lse, datt, dqkv);
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
