//! The Llama family's decoder block as one layer of the chain (Llama 2 and 3, SmolLM2,
//! TinyLlama, Mistral's layout; Qwen 2 with its q/k/v biases; Qwen 3 with its per-head q/k
//! norms), computed as `transformers`' `LlamaDecoderLayer` computes it:
//!
//! `h = rms₁(x)`, `q, k, v = h·W_qᵀ (+b_q), h·W_kᵀ (+b_k), h·W_vᵀ (+b_v)`, (Qwen 3: each head of
//! `q` and `k` through its RMSNorm), RoPE on `q` and `k` at each row's position, causal
//! attention with grouped-query heads ([`Heads`]), `x₂ = x + att·W_oᵀ`, then
//! `y = x₂ + (silu(rms₂(x₂)·W_gateᵀ) ∘ rms₂(x₂)·W_upᵀ)·W_downᵀ`.
//!
//! Parameters, in this order in the layer's slice: `input_layernorm` `[width]`; `q_proj`,
//! `k_proj`, `v_proj` weights one after another (so they are one `[(heads + 2·kv_heads)·d,
//! width]` matrix and one GEMM); their biases if any; `q_norm`, `k_norm` (`[d]` each) if any;
//! `o_proj` `[width, heads·d]`; `post_attention_layernorm` `[width]`; `gate_proj` and `up_proj`
//! (one `[2·hidden, width]` matrix); `down_proj` `[width, hidden]`. Checkpoints name them as
//! Hugging Face does.
//!
//! The forward stashes what the backward reads: both norms' statistics and outputs, the
//! projected rows after RoPE (and before the q/k norms when there are any), the heads' outputs
//! and log-sum-exps, `x₂`, and the MLP's gate and up values and their product. Nothing of
//! size `seq²`.

use serde::{Deserialize, Serialize};

use super::block::{lay_out, span, split_spans};
use super::heads::{Heads, gather, scatter};
use super::rope::{Rope, RopeScaling};
use super::swiglu;
use super::{KeyValues, Norm, NormKind};
use crate::kernels::{Op, column_sums, matmul, set_len};
use crate::packed::{Params, matrix_forward};

/// A Llama-family block's geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaBlock {
    /// Positions per sample.
    pub seq: usize,
    /// Values per position (the residual stream).
    pub width: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Values per head (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// The MLP's hidden width (`intermediate_size`).
    pub hidden: usize,
    /// RoPE's base.
    pub rope_theta: f64,
    /// RoPE's frequency scaling, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// The RMSNorms' ε.
    pub eps: f32,
    /// Biases on q, k and v (Qwen 2).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qkv_bias: bool,
    /// An RMSNorm over each head of q and of k before RoPE (Qwen 3).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
}

/// Where each piece's parameters lie in the block's slice: `(offset, len)`.
struct Parts {
    ln1: (usize, usize),
    w_qkv: (usize, usize),
    b_qkv: (usize, usize),
    q_norm: (usize, usize),
    k_norm: (usize, usize),
    w_o: (usize, usize),
    ln2: (usize, usize),
    w_gu: (usize, usize),
    w_down: (usize, usize),
}

/// The buffers the part after the attention writes: `x₂`, `rms₂(x₂)` and its statistics, the
/// MLP's gate and up values and their product; and whether it runs for decoding (whose
/// element-wise work may go to the decoder's workers, which training's threads never wait on).
struct After<'a> {
    x2: &'a mut [f32],
    h2: &'a mut [f32],
    stats: &'a mut [f32],
    gu: &'a mut [f32],
    m: &'a mut [f32],
    decoding: bool,
}

/// Where each stashed tensor lies in the block's stash, for `rows` rows: `(offset, len)`.
struct Stash {
    ln1_stats: (usize, usize),
    h1: (usize, usize),
    qkv: (usize, usize),
    qk_pre: (usize, usize),
    qk_stats: (usize, usize),
    att: (usize, usize),
    lse: (usize, usize),
    x2: (usize, usize),
    ln2_stats: (usize, usize),
    h2: (usize, usize),
    gu: (usize, usize),
    m: (usize, usize),
    len: usize,
}

/// `m = silu(gate) ∘ up` row by row from `gu` (`[rows, 2·hidden]`, gate then up).
fn swiglu_rows(gu: &[f32], m: &mut [f32], hid: usize) {
    for (gu, m) in gu.chunks_exact(2 * hid).zip(m.chunks_exact_mut(hid)) {
        let (gate, up) = gu.split_at(hid);
        swiglu::forward(gate, up, m);
    }
}

/// [`swiglu_rows`] with a prompt's rows shared out over the decoder's workers.
fn swiglu_rows_shared(gu: &[f32], m: &mut [f32], hid: usize, rows: usize, threads: usize) {
    let parts = threads.min(crate::packed::pool::parallelism()).min(rows);
    if parts < 2 {
        swiglu_rows(gu, m, hid);
        return;
    }
    let per = rows.div_ceil(parts) * hid;
    let pieces: Vec<std::sync::Mutex<&mut [f32]>> = m[..rows * hid]
        .chunks_mut(per)
        .map(std::sync::Mutex::new)
        .collect();
    crate::packed::pool::run(pieces.len(), &|part| {
        let mut m = pieces[part]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = part * per / hid;
        swiglu_rows(&gu[2 * hid * first..], &mut m, hid);
    });
}

impl LlamaBlock {
    fn norm(&self, features: usize) -> Norm {
        Norm {
            kind: NormKind::Rms,
            features,
            eps: self.eps,
        }
    }

    pub(crate) fn heads(&self) -> Heads {
        Heads {
            seq: self.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    fn rope(&self) -> Rope {
        Rope::new(self.head_dim, self.rope_theta, self.rope_scaling.as_ref())
    }

    /// Values of the queries (`heads · d`) and of the keys or values (`kv_heads · d`).
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Values of one projected row (queries, keys, values).
    fn stride(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    fn parts(&self) -> Parts {
        let (c, s, hid, d) = (self.width, self.stride(), self.hidden, self.head_dim);
        let ([ln1, w_qkv, b_qkv, q_norm, k_norm, w_o, ln2, w_gu, w_down], _) = lay_out([
            c,
            s * c,
            if self.qkv_bias { s } else { 0 },
            if self.qk_norm { d } else { 0 },
            if self.qk_norm { d } else { 0 },
            c * self.q_width(),
            c,
            2 * hid * c,
            c * hid,
        ]);
        Parts {
            ln1,
            w_qkv,
            b_qkv,
            q_norm,
            k_norm,
            w_o,
            ln2,
            w_gu,
            w_down,
        }
    }

    fn stash(&self, n: usize) -> Stash {
        let rows = n * self.seq;
        let (c, hid) = (self.width, self.hidden);
        let normed = if self.qk_norm {
            self.heads + self.kv_heads
        } else {
            0
        };
        let (
            [
                ln1_stats,
                h1,
                qkv,
                qk_pre,
                qk_stats,
                att,
                lse,
                x2,
                ln2_stats,
                h2,
                gu,
                m,
            ],
            len,
        ) = lay_out([
            2 * rows,
            rows * c,
            rows * self.stride(),
            rows * normed * self.head_dim,
            2 * rows * normed,
            rows * self.q_width(),
            n * self.heads * self.seq,
            rows * c,
            2 * rows,
            rows * c,
            rows * 2 * hid,
            rows * hid,
        ]);
        Stash {
            ln1_stats,
            h1,
            qkv,
            qk_pre,
            qk_stats,
            att,
            lse,
            x2,
            ln2_stats,
            h2,
            gu,
            m,
            len,
        }
    }

    /// Both norms, the attention and the MLP.
    pub fn param_count(&self) -> usize {
        let p = self.parts();
        p.w_down.0 + p.w_down.1
    }

    /// Values of the stash for a micro-batch of `n` samples.
    pub fn stash_len(&self, n: usize) -> usize {
        self.stash(n).len
    }

    /// Names and shapes of the block's tensors, Hugging Face's under `prefix`, in the order of
    /// the layer's slice.
    pub fn param_tensors(&self, prefix: &str) -> Vec<(String, Vec<usize>)> {
        let (c, q, kv, d, hid) = (
            self.width,
            self.q_width(),
            self.kv_width(),
            self.head_dim,
            self.hidden,
        );
        let mut t = vec![
            ("input_layernorm.weight", vec![c]),
            ("self_attn.q_proj.weight", vec![q, c]),
            ("self_attn.k_proj.weight", vec![kv, c]),
            ("self_attn.v_proj.weight", vec![kv, c]),
        ];
        if self.qkv_bias {
            t.extend([
                ("self_attn.q_proj.bias", vec![q]),
                ("self_attn.k_proj.bias", vec![kv]),
                ("self_attn.v_proj.bias", vec![kv]),
            ]);
        }
        if self.qk_norm {
            t.extend([
                ("self_attn.q_norm.weight", vec![d]),
                ("self_attn.k_norm.weight", vec![d]),
            ]);
        }
        t.extend([
            ("self_attn.o_proj.weight", vec![c, q]),
            ("post_attention_layernorm.weight", vec![c]),
            ("mlp.gate_proj.weight", vec![hid, c]),
            ("mlp.up_proj.weight", vec![hid, c]),
            ("mlp.down_proj.weight", vec![c, hid]),
        ]);
        t.into_iter()
            .map(|(name, shape)| (format!("{prefix}.{name}"), shape))
            .collect()
    }

    /// Norms at 1; every projection normal with `transformers`' standard deviation of 0.02
    /// (from `normal`, one value per call); biases zero.
    pub fn init(&self, params: &mut [f32], mut normal: impl FnMut() -> f32) {
        let p = self.parts();
        for (o, l) in [p.ln1, p.q_norm, p.k_norm, p.ln2] {
            params[o..o + l].fill(1.0);
        }
        for (o, l) in [p.w_qkv, p.w_o, p.w_gu, p.w_down] {
            for v in &mut params[o..o + l] {
                *v = 0.02 * normal();
            }
        }
        params[p.b_qkv.0..p.b_qkv.0 + p.b_qkv.1].fill(0.0);
    }

    /// The projected rows `qkv` (`[rows, stride]`) from `h`, through the q/k norms (their
    /// inputs and statistics into `pre` and `stats` when there are norms) and RoPE at
    /// `positions`.
    fn project(
        &self,
        p: Params<'_>,
        h: &[f32],
        rows: usize,
        positions: &[usize],
        qkv: &mut [f32],
        pre: &mut [f32],
        stats: &mut [f32],
        threads: usize,
    ) {
        let parts = self.parts();
        let (c, s, q, kv) = (self.width, self.stride(), self.q_width(), self.kv_width());
        let (w, b) = (p.matrix(parts.w_qkv), p.vector(parts.b_qkv));
        matrix_forward(qkv, rows, s, c, h, &w, b, threads);
        if self.qk_norm {
            let norm = self.norm(self.head_dim);
            let (q_pre, k_pre) = pre.split_at_mut(rows * q);
            let (q_stats, k_stats) = stats.split_at_mut(2 * rows * self.heads);
            let mut out = vec![0.0f32; rows * q.max(kv)];
            for (pre, stats, gamma, col, width) in [
                (q_pre, q_stats, p.vector(parts.q_norm), 0, q),
                (k_pre, k_stats, p.vector(parts.k_norm), q, kv),
            ] {
                gather(qkv, pre, s, col, width);
                let out = &mut out[..rows * width];
                norm.forward(gamma, pre, out, stats, threads);
                scatter(out, qkv, s, col, width);
            }
        }
        let rope = self.rope();
        rope.apply_columns(qkv, s, 0, q, positions, false);
        rope.apply_columns(qkv, s, q, kv, positions, false);
    }

    /// `y` (`[n·seq, width]`) from `x`; what the backward reads into `stash`
    /// ([`LlamaBlock::stash_len`] values).
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        stash: &mut [f32],
        threads: usize,
    ) {
        let (c, q, rows) = (self.width, self.q_width(), n * self.seq);
        let (parts, at) = (self.parts(), self.stash(n));
        let [
            ln1_stats,
            h1,
            qkv,
            qk_pre,
            qk_stats,
            att,
            lse,
            x2,
            ln2_stats,
            h2,
            gu,
            m,
        ] = split_spans(
            stash,
            [
                at.ln1_stats,
                at.h1,
                at.qkv,
                at.qk_pre,
                at.qk_stats,
                at.att,
                at.lse,
                at.x2,
                at.ln2_stats,
                at.h2,
                at.gu,
                at.m,
            ],
        );
        let norm = self.norm(c);
        norm.forward(span(p, parts.ln1), x, h1, ln1_stats, threads);
        let positions: Vec<usize> = (0..rows).map(|r| r % self.seq).collect();
        self.project(
            Params::Flat(p),
            h1,
            rows,
            &positions,
            qkv,
            qk_pre,
            qk_stats,
            threads,
        );
        let (heads, t, s) = (self.heads(), self.seq, self.stride());
        let qkv = &*qkv;
        let work = |(i, (att, lse)): (usize, (&mut [f32], &mut [f32]))| {
            heads.attend(&qkv[i * t * s..(i + 1) * t * s], att, lse);
        };
        let samples = att
            .chunks_mut(t * q)
            .zip(lse.chunks_mut(self.heads * t))
            .enumerate();
        if threads > 1 && n > 1 {
            use rayon::prelude::*;
            samples.par_bridge().for_each(work);
        } else {
            samples.for_each(work);
        }
        let after = After {
            x2,
            h2,
            stats: ln2_stats,
            gu,
            m,
            decoding: false,
        };
        self.after_attention(Params::Flat(p), x, att, rows, after, y, threads);
    }

    /// Decoding: `y` (`[rows, width]`) for `rows` new positions `at..at + rows` of one
    /// sequence, its attention reading and extending `cache` (keys and values of
    /// `kv_heads · d` values a position); the same pieces as [`LlamaBlock::forward`].
    pub(crate) fn decode(
        &self,
        p: Params<'_>,
        x: &[f32],
        rows: usize,
        at: usize,
        cache: &mut KeyValues,
        y: &mut [f32],
        scores: &mut Vec<f32>,
        threads: usize,
    ) {
        let (c, s, q, kv, hid) = (
            self.width,
            self.stride(),
            self.q_width(),
            self.kv_width(),
            self.hidden,
        );
        let normed = if self.qk_norm {
            self.heads + self.kv_heads
        } else {
            0
        };
        let parts = self.parts();
        thread_local! {
            /// Every piece below is written before it is read: kept from call to call
            /// rather than allocated and zeroed (a prompt's are megabytes a block).
            static BUFFERS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let mut buffers = BUFFERS.take();
        set_len(
            &mut buffers,
            rows * (3 * c + s + 2 * q + 3 * hid + 2) + normed * rows * (self.head_dim + 2),
        );
        let (h, rest) = buffers.split_at_mut(rows * c);
        let (qkv, rest) = rest.split_at_mut(rows * s);
        let (queries, rest) = rest.split_at_mut(rows * q);
        let (att, rest) = rest.split_at_mut(rows * q);
        let (x2, rest) = rest.split_at_mut(rows * c);
        let (h2, rest) = rest.split_at_mut(rows * c);
        let (gu, rest) = rest.split_at_mut(rows * 2 * hid);
        let (m, rest) = rest.split_at_mut(rows * hid);
        let (stats, rest) = rest.split_at_mut(2 * rows);
        let (pre, qk_stats) = rest.split_at_mut(normed * rows * self.head_dim);
        let norm = self.norm(c);
        norm.forward(p.vector(parts.ln1), x, h, stats, threads);
        let positions: Vec<usize> = (at..at + rows).collect();
        self.project(p, h, rows, &positions, qkv, pre, qk_stats, threads);
        cache.append(qkv, s, q, kv, at);
        gather(qkv, queries, s, 0, q);
        self.heads().decode(
            queries,
            at,
            &cache.keys,
            &cache.values,
            att,
            scores,
            threads,
        );
        let after = After {
            x2,
            h2,
            stats,
            gu,
            m,
            decoding: true,
        };
        self.after_attention(p, x, att, rows, after, y, threads);
        BUFFERS.set(buffers);
    }

    /// What follows the heads' outputs `att`, in the forward and in decoding alike:
    /// `x₂ = x + att·W_oᵀ`, then `y = x₂ + MLP(rms₂(x₂))`, the pieces kept in `after`.
    fn after_attention(
        &self,
        p: Params<'_>,
        x: &[f32],
        att: &[f32],
        rows: usize,
        after: After<'_>,
        y: &mut [f32],
        threads: usize,
    ) {
        let (c, q, hid, parts) = (self.width, self.q_width(), self.hidden, self.parts());
        let After {
            x2,
            h2,
            stats,
            gu,
            m,
            decoding,
        } = after;
        matrix_forward(x2, rows, c, q, att, &p.matrix(parts.w_o), &[], threads);
        for (a, b) in x2.iter_mut().zip(x) {
            *a += b;
        }
        self.norm(c)
            .forward(p.vector(parts.ln2), x2, h2, stats, threads);
        matrix_forward(
            gu,
            rows,
            2 * hid,
            c,
            h2,
            &p.matrix(parts.w_gu),
            &[],
            threads,
        );
        if decoding {
            swiglu_rows_shared(gu, m, hid, rows, threads);
        } else {
            swiglu_rows(gu, m, hid);
        }
        matrix_forward(y, rows, c, hid, m, &p.matrix(parts.w_down), &[], threads);
        for (a, b) in y.iter_mut().zip(x2.iter()) {
            *a += b;
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
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let (c, s, q, hid, rows) = (
            self.width,
            self.stride(),
            self.q_width(),
            self.hidden,
            n * self.seq,
        );
        let (parts, at) = (self.parts(), self.stash(n));
        let [g_ln1, g_qkv, g_bqkv, g_qn, g_kn, g_o, g_ln2, g_gu, g_down] = split_spans(
            g,
            [
                parts.ln1,
                parts.w_qkv,
                parts.b_qkv,
                parts.q_norm,
                parts.k_norm,
                parts.w_o,
                parts.ln2,
                parts.w_gu,
                parts.w_down,
            ],
        );
        set_len(scratch, rows * (3 * hid + 3 * c + q + s));
        let (dm, rest) = scratch.split_at_mut(rows * hid);
        let (dgu, rest) = rest.split_at_mut(rows * 2 * hid);
        let (dh2, rest) = rest.split_at_mut(rows * c);
        let (dx2, rest) = rest.split_at_mut(rows * c);
        let (datt, rest) = rest.split_at_mut(rows * q);
        let (dqkv, dh1) = rest.split_at_mut(rows * s);
        // The MLP: y = x₂ + m·W_downᵀ, m = silu(gate) ∘ up, [gate | up] = h₂·W_guᵀ.
        let (h2, gu, m) = (span(stash, at.h2), span(stash, at.gu), span(stash, at.m));
        matmul(
            g_down,
            c,
            hid,
            rows,
            dy,
            Op::T,
            m,
            Op::N,
            accumulate,
            threads,
        );
        let w_down = span(p, parts.w_down);
        matmul(dm, rows, hid, c, dy, Op::N, w_down, Op::N, false, threads);
        for ((dgu, gu), dm) in dgu
            .chunks_exact_mut(2 * hid)
            .zip(gu.chunks_exact(2 * hid))
            .zip(dm.chunks_exact(hid))
        {
            let (gate, up) = gu.split_at(hid);
            let (dgate, dup) = dgu.split_at_mut(hid);
            swiglu::backward(gate, up, dm, dgate, dup);
        }
        matmul(
            g_gu,
            2 * hid,
            c,
            rows,
            dgu,
            Op::T,
            h2,
            Op::N,
            accumulate,
            threads,
        );
        let w_gu = span(p, parts.w_gu);
        matmul(
            dh2,
            rows,
            c,
            2 * hid,
            dgu,
            Op::N,
            w_gu,
            Op::N,
            false,
            threads,
        );
        let norm = self.norm(c);
        let (x2, ln2_stats) = (span(stash, at.x2), span(stash, at.ln2_stats));
        norm.backward(
            span(p, parts.ln2),
            g_ln2,
            accumulate,
            x2,
            ln2_stats,
            dh2,
            Some(dx2),
        );
        for (a, b) in dx2.iter_mut().zip(dy) {
            *a += b;
        }
        // The attention: x₂ = x + att·W_oᵀ.
        let att = span(stash, at.att);
        matmul(g_o, c, q, rows, dx2, Op::T, att, Op::N, accumulate, threads);
        let w_o = span(p, parts.w_o);
        matmul(datt, rows, q, c, dx2, Op::N, w_o, Op::N, false, threads);
        self.attention_backward(stash, &at, datt, dqkv, n, threads);
        self.projection_backward(p, stash, &at, dqkv, [g_qn, g_kn], accumulate, rows);
        column_sums(g_bqkv, dqkv, accumulate);
        let h1 = span(stash, at.h1);
        matmul(
            g_qkv,
            s,
            c,
            rows,
            dqkv,
            Op::T,
            h1,
            Op::N,
            accumulate,
            threads,
        );
        let w_qkv = span(p, parts.w_qkv);
        matmul(dh1, rows, c, s, dqkv, Op::N, w_qkv, Op::N, false, threads);
        let ln1 = (span(p, parts.ln1), span(stash, at.ln1_stats));
        match dx {
            Some(dx) => {
                norm.backward(ln1.0, g_ln1, accumulate, x, ln1.1, dh1, Some(&mut *dx));
                for (a, b) in dx.iter_mut().zip(dx2.iter()) {
                    *a += b;
                }
            }
            None => norm.backward(ln1.0, g_ln1, accumulate, x, ln1.1, dh1, None),
        }
    }

    /// `dqkv` from the heads' output gradient `datt`, sample by sample.
    fn attention_backward(
        &self,
        stash: &[f32],
        at: &Stash,
        datt: &[f32],
        dqkv: &mut [f32],
        n: usize,
        threads: usize,
    ) {
        let (heads, t, s, q) = (self.heads(), self.seq, self.stride(), self.q_width());
        let (qkv, att, lse) = (
            span(stash, at.qkv),
            span(stash, at.att),
            span(stash, at.lse),
        );
        let work = |(i, dqkv): (usize, &mut [f32])| {
            heads.attend_backward(
                &qkv[i * t * s..(i + 1) * t * s],
                &att[i * t * q..(i + 1) * t * q],
                &lse[i * self.heads * t..(i + 1) * self.heads * t],
                &datt[i * t * q..(i + 1) * t * q],
                dqkv,
            );
        };
        let samples = dqkv.chunks_mut(t * s).enumerate();
        if threads > 1 && n > 1 {
            use rayon::prelude::*;
            samples.par_bridge().for_each(work);
        } else {
            samples.for_each(work);
        }
    }

    /// Takes `dqkv` back through RoPE (the opposite rotation) and the q/k norms (their gains'
    /// gradients into `g_norms`), in place.
    fn projection_backward(
        &self,
        p: &[f32],
        stash: &[f32],
        at: &Stash,
        dqkv: &mut [f32],
        g_norms: [&mut [f32]; 2],
        accumulate: bool,
        rows: usize,
    ) {
        let (s, q, kv) = (self.stride(), self.q_width(), self.kv_width());
        let positions: Vec<usize> = (0..rows).map(|r| r % self.seq).collect();
        let rope = self.rope();
        rope.apply_columns(dqkv, s, 0, q, &positions, true);
        rope.apply_columns(dqkv, s, q, kv, &positions, true);
        if !self.qk_norm {
            return;
        }
        let parts = self.parts();
        let norm = self.norm(self.head_dim);
        let (q_pre, k_pre) = span(stash, at.qk_pre).split_at(rows * q);
        let (q_stats, k_stats) = span(stash, at.qk_stats).split_at(2 * rows * self.heads);
        let [g_qn, g_kn] = g_norms;
        let mut d_out = vec![0.0f32; rows * q.max(kv)];
        let mut d_in = vec![0.0f32; rows * q.max(kv)];
        for (pre, stats, gamma, grad, col, width) in [
            (q_pre, q_stats, span(p, parts.q_norm), g_qn, 0, q),
            (k_pre, k_stats, span(p, parts.k_norm), g_kn, q, kv),
        ] {
            let (d_out, d_in) = (&mut d_out[..rows * width], &mut d_in[..rows * width]);
            gather(dqkv, d_out, s, col, width);
            norm.backward(gamma, grad, accumulate, pre, stats, d_out, Some(d_in));
            scatter(d_in, dqkv, s, col, width);
        }
    }
}
