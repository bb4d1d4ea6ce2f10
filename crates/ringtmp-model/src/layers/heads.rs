//! The core of causal attention for one sample, shared by GPT-2's attention and the Llama
//! family's: per query head `h`, `o_t = Σ_{j ≤ t} softmax_j(q_t·k_j / √d) · v_j`, with
//! grouped-query attention — `kv_heads` key/value heads, each read by `heads / kv_heads`
//! consecutive query heads (multi-head attention when the two are equal, multi-query when there
//! is one).
//!
//! Layout: a sample's projected rows are `[q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]`,
//! `seq` of them (GPT-2's `c_attn` output is this with `kv_heads = heads`); the output is
//! `[seq, heads·d]`, the heads side by side; the forward keeps each row's log-sum-exp per head
//! (`[heads, seq]`) so the backward makes the probabilities again instead of storing them (as
//! FlashAttention does). Scores exist for one head at a time (`seq × seq`), made by GEMMs.

use crate::kernels::{Op, matmul};

/// One sample's attention geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    /// Positions per sample.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl Heads {
    /// Values of one projected row: queries, keys and values.
    pub fn stride(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Column of key/value head `j`'s keys in a projected row (its values are `kv_heads · d`
    /// further).
    fn k_col(&self, j: usize) -> usize {
        (self.heads + j) * self.head_dim
    }

    fn v_col(&self, j: usize) -> usize {
        (self.heads + self.kv_heads + j) * self.head_dim
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// One sample: its heads' outputs `att` (`[seq, heads·d]`) and each row's log-sum-exp
    /// `lse` (`[heads, seq]`) from its projected rows `qkv` (`[seq, stride]`).
    pub fn attend(&self, qkv: &[f32], att: &mut [f32], lse: &mut [f32]) {
        let (t, d, s) = (self.seq, self.head_dim, self.stride());
        let scale = self.scale();
        let mut b = HeadBuffers::new(t, d);
        for j in 0..self.kv_heads {
            gather(qkv, &mut b.k, s, self.k_col(j), d);
            gather(qkv, &mut b.v, s, self.v_col(j), d);
            for h in j * self.group()..(j + 1) * self.group() {
                gather(qkv, &mut b.q, s, h * d, d);
                let HeadBuffers { q, k, v, s, o, .. } = &mut b;
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
                scatter(o, att, self.heads * d, h * d, d);
            }
        }
    }

    /// One sample's `dqkv` (`[seq, stride]`, overwritten) from its projected rows, outputs,
    /// log-sum-exps and the outputs' gradient `datt`: with `P` made again from the scores,
    /// `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`, `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`; a
    /// key/value head's gradients are the sums over the query heads that read it.
    pub fn attend_backward(
        &self,
        qkv: &[f32],
        att: &[f32],
        lse: &[f32],
        datt: &[f32],
        dqkv: &mut [f32],
    ) {
        let (t, d, stride) = (self.seq, self.head_dim, self.stride());
        let width = self.heads * d;
        let scale = self.scale();
        let mut b = HeadBuffers::new(t, d);
        let (mut dk_sum, mut dv_sum) = (vec![0.0f32; t * d], vec![0.0f32; t * d]);
        for j in 0..self.kv_heads {
            gather(qkv, &mut b.k, stride, self.k_col(j), d);
            gather(qkv, &mut b.v, stride, self.v_col(j), d);
            dk_sum.fill(0.0);
            dv_sum.fill(0.0);
            for h in j * self.group()..(j + 1) * self.group() {
                gather(qkv, &mut b.q, stride, h * d, d);
                gather(att, &mut b.o, width, h * d, d);
                gather(datt, &mut b.d_o, width, h * d, d);
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
                } = &mut b;
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
                for (i, (p_row, dp_row)) in
                    s.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate()
                {
                    let delta = dot(&d_o[i * d..(i + 1) * d], &o[i * d..(i + 1) * d]);
                    for (dpx, &px) in dp_row.iter_mut().zip(p_row) {
                        *dpx = px * (*dpx - delta) * scale;
                    }
                }
                let ds = &*dp;
                matmul(dq, t, d, t, ds, Op::N, k, Op::N, false, 1);
                matmul(dk, t, d, t, ds, Op::T, q, Op::N, false, 1);
                scatter(dq, dqkv, stride, h * d, d);
                for (a, b) in dk_sum.iter_mut().zip(dk.iter()) {
                    *a += b;
                }
                for (a, b) in dv_sum.iter_mut().zip(dv.iter()) {
                    *a += b;
                }
            }
            scatter(&dk_sum, dqkv, stride, self.k_col(j), d);
            scatter(&dv_sum, dqkv, stride, self.v_col(j), d);
        }
    }

    /// Decoding: the outputs `out` (`[rows, heads·d]`) of `rows` new positions `at..` from
    /// their queries `q` (`[rows, heads·d]`), each attending to every position up to its own
    /// in the cache (`keys`, `values`: `[positions, kv_heads·d]`, the new ones' included). A
    /// step reads each cached key and value once per query head; one position's heads, or a
    /// prompt's positions, are shared out over `threads` of the decoder's workers.
    pub fn decode(
        &self,
        q: &[f32],
        at: usize,
        keys: &[f32],
        values: &[f32],
        out: &mut [f32],
        scores: &mut Vec<f32>,
        threads: usize,
    ) {
        let (d, width) = (self.head_dim, self.heads * self.head_dim);
        let parts = threads
            .min(crate::packed::pool::parallelism())
            .min(self.heads);
        if q.len() == width && parts > 1 {
            // One position (a token of decoding): its heads shared out over the decoder's
            // workers, each writing its own heads' outputs.
            let per = self.heads.div_ceil(parts);
            let shared = SharedOut(out.as_mut_ptr());
            crate::packed::pool::run(parts, &|part| {
                let mut scores = Vec::new();
                for h in part * per..((part + 1) * per).min(self.heads) {
                    // SAFETY: head `h`'s outputs are `d` values of `out` at `h·d`, which no
                    // other part writes; `out` outlives the run.
                    let o = unsafe { std::slice::from_raw_parts_mut(shared.at(h * d), d) };
                    self.decode_head(h, q, at + 1, keys, values, o, &mut scores);
                }
            });
            return;
        }
        let rows = q.len() / width;
        if parts > 1 && rows > 1 {
            // A prompt's positions dealt out in turn (a later one reads more of the cache),
            // each part writing its positions' outputs.
            let shared = SharedOut(out.as_mut_ptr());
            crate::packed::pool::run(parts, &|part| {
                let mut scores = Vec::new();
                for i in (part..rows).step_by(parts) {
                    // SAFETY: position `i`'s outputs are `width` values of `out` at
                    // `i·width`, which no other part writes; `out` outlives the run.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(shared.at(i * width), width) };
                    let q = &q[i * width..(i + 1) * width];
                    self.decode_position(q, at + i + 1, keys, values, out, &mut scores);
                }
            });
            return;
        }
        for (i, (q, out)) in q
            .chunks_exact(width)
            .zip(out.chunks_exact_mut(width))
            .enumerate()
        {
            self.decode_position(q, at + i + 1, keys, values, out, scores);
        }
    }

    /// One position's outputs `out` (`[heads·d]`) from its queries `q`, every head over the
    /// first `positions` of the cache.
    fn decode_position(
        &self,
        q: &[f32],
        positions: usize,
        keys: &[f32],
        values: &[f32],
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        for (h, o) in out.chunks_exact_mut(self.head_dim).enumerate() {
            self.decode_head(h, q, positions, keys, values, o, scores);
        }
    }

    /// Head `h`'s output `o` for one position's queries `q` (`[heads·d]`) over the first
    /// `positions` of the cache.
    #[allow(clippy::too_many_arguments)]
    fn decode_head(
        &self,
        h: usize,
        q: &[f32],
        positions: usize,
        keys: &[f32],
        values: &[f32],
        o: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let (d, kv) = (self.head_dim, self.kv_heads * self.head_dim);
        crate::kernels::set_len(scores, positions);
        let col = (h / self.group()) * d;
        attend(
            &q[h * d..(h + 1) * d],
            keys,
            values,
            kv,
            col,
            self.scale(),
            scores,
            o,
        );
    }
}

/// One head's attention for one query `q` (`d` values) over the cached `keys` and `values`
/// (rows of `kv` values, the head's at `col`), one score a position in `scores`: `o` the
/// softmax-weighted sum of the values. Compiled for the CPU's vector width, the dot products
/// in 16 lanes.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    kv: usize,
    col: usize,
    scale: f32,
    scores: &mut [f32],
    o: &mut [f32],
) {
    let d = q.len();
    for (j, s) in scores.iter_mut().enumerate() {
        let k = &keys[j * kv + col..j * kv + col + d];
        let mut acc = [0.0f32; 16];
        let whole = d / 16 * 16;
        for (q, k) in q[..whole].chunks_exact(16).zip(k[..whole].chunks_exact(16)) {
            for ((a, q), k) in acc.iter_mut().zip(q).zip(k) {
                *a += q * k;
            }
        }
        let tail: f32 = q[whole..].iter().zip(&k[whole..]).map(|(q, k)| q * k).sum();
        *s = (acc.iter().sum::<f32>() + tail) * scale;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    o.fill(0.0);
    let inv = 1.0 / sum;
    for (j, &w) in scores.iter().enumerate() {
        let p = w * inv;
        let v = &values[j * kv + col..j * kv + col + d];
        for (o, v) in o.iter_mut().zip(v) {
            *o += p * v;
        }
    }
}

/// `out`'s address, shared by the parts that write disjoint heads of it.
struct SharedOut(*mut f32);
// SAFETY: each part writes its own heads (see `Heads::decode`).
unsafe impl Sync for SharedOut {}
impl SharedOut {
    fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: `i` is inside the slice the pointer came from (callers' ranges).
        unsafe { self.0.add(i) }
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
}

/// Columns `col..col + d` of every row (`stride` values each) of `from` into `to`, contiguous.
pub(crate) fn gather(from: &[f32], to: &mut [f32], stride: usize, col: usize, d: usize) {
    for (row, out) in from.chunks_exact(stride).zip(to.chunks_exact_mut(d)) {
        out.copy_from_slice(&row[col..col + d]);
    }
}

/// Contiguous rows of `d` from `from` into columns `col..col + d` of `to`'s rows.
pub(crate) fn scatter(from: &[f32], to: &mut [f32], stride: usize, col: usize, d: usize) {
    for (row, out) in from.chunks_exact(d).zip(to.chunks_exact_mut(stride)) {
        out[col..col + d].copy_from_slice(row);
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
