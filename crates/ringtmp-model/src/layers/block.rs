//! A pre-norm transformer block as one layer of the chain, so a ring cuts between blocks:
//!
//! `x₂ = x + attn(ln₁(x))`, `y = x₂ + proj(gelu(fc(ln₂(x₂))))`
//!
//! over a sample's sequence `[seq, width]`, with GPT-2's pieces and names: `ln_1`, `attn`
//! ([`CausalSelfAttention`]), `ln_2`, and the MLP's `c_fc` (`width → ratio · width`) and `c_proj`
//! (back). Parameters in that order in the layer's flat slice.
//!
//! The forward stashes, per micro-batch, what the backward reads: both norms' row statistics and
//! outputs, the attention's stash, `x₂`, and the MLP's hidden layer before and after GELU. Nothing
//! of size `seq²` (see [`CausalSelfAttention`]).

use serde::{Deserialize, Serialize};

use super::norm::{gelu_backward_in_place_threaded, gelu_forward_threaded};
use super::{CausalSelfAttention, Norm, NormKind};
use crate::kernels::{Op, column_sums, linear_forward, matmul, set_len};

/// Transformer block geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    /// Positions per sample.
    pub seq: usize,
    /// Values per position.
    pub width: usize,
    /// Attention heads (dividing `width`).
    pub heads: usize,
    /// The MLP's hidden width over `width` (GPT-2: 4).
    pub mlp_ratio: usize,
}

/// Where each piece's parameters lie in the block's slice: `(offset, len)`.
struct Parts {
    ln1: (usize, usize),
    attn: (usize, usize),
    ln2: (usize, usize),
    fc_w: (usize, usize),
    fc_b: (usize, usize),
    proj_w: (usize, usize),
    proj_b: (usize, usize),
}

/// Where each stashed tensor lies in the block's stash, for `rows` rows: `(offset, len)`.
struct Stash {
    ln1_stats: (usize, usize),
    h1: (usize, usize),
    attn: (usize, usize),
    x2: (usize, usize),
    ln2_stats: (usize, usize),
    h2: (usize, usize),
    u: (usize, usize),
    m: (usize, usize),
    len: usize,
}

/// Lays `lens` out one after another.
pub(super) fn lay_out<const N: usize>(lens: [usize; N]) -> ([(usize, usize); N], usize) {
    let mut at = 0;
    let spans = lens.map(|l| {
        let span = (at, l);
        at += l;
        span
    });
    (spans, at)
}

pub(super) fn span(v: &[f32], (o, l): (usize, usize)) -> &[f32] {
    &v[o..o + l]
}

impl Block {
    fn norm(&self) -> Norm {
        Norm {
            kind: NormKind::Layer,
            features: self.width,
            eps: super::NORM_EPS,
        }
    }

    /// The block's attention.
    pub fn attention(&self) -> CausalSelfAttention {
        CausalSelfAttention {
            seq: self.seq,
            width: self.width,
            heads: self.heads,
        }
    }

    fn hidden(&self) -> usize {
        self.mlp_ratio * self.width
    }

    fn parts(&self) -> Parts {
        let (c, hid) = (self.width, self.hidden());
        let ([ln1, attn, ln2, fc_w, fc_b, proj_w, proj_b], _) = lay_out([
            self.norm().param_count(),
            self.attention().param_count(),
            self.norm().param_count(),
            hid * c,
            hid,
            c * hid,
            c,
        ]);
        Parts {
            ln1,
            attn,
            ln2,
            fc_w,
            fc_b,
            proj_w,
            proj_b,
        }
    }

    fn stash(&self, n: usize) -> Stash {
        let rows = n * self.seq;
        let (c, hid) = (self.width, self.hidden());
        let ([ln1_stats, h1, attn, x2, ln2_stats, h2, u, m], len) = lay_out([
            2 * rows,
            rows * c,
            self.attention().stash_len(n),
            rows * c,
            2 * rows,
            rows * c,
            rows * hid,
            rows * hid,
        ]);
        Stash {
            ln1_stats,
            h1,
            attn,
            x2,
            ln2_stats,
            h2,
            u,
            m,
            len,
        }
    }

    /// Both norms, the attention and the MLP.
    pub fn param_count(&self) -> usize {
        let p = self.parts();
        p.proj_b.0 + p.proj_b.1
    }

    /// Names and shapes of the block's tensors, GPT-2's (nanoGPT's) under `prefix`.
    pub fn param_tensors(&self, prefix: &str) -> Vec<(String, Vec<usize>)> {
        let (c, hid) = (self.width, self.hidden());
        [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![3 * c, c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![hid, c]),
            ("mlp.c_fc.bias", vec![hid]),
            ("mlp.c_proj.weight", vec![c, hid]),
            ("mlp.c_proj.bias", vec![c]),
        ]
        .into_iter()
        .map(|(name, shape)| (format!("{prefix}.{name}"), shape))
        .collect()
    }

    /// Norms at `γ = 1, β = 0`; the projections' weights normal with GPT-2's standard
    /// deviation of 0.02 (from `normal`, one value per call); biases zero.
    pub fn init(&self, params: &mut [f32], mut normal: impl FnMut() -> f32) {
        let p = self.parts();
        let norm = self.norm();
        norm.init(&mut params[p.ln1.0..p.ln1.0 + p.ln1.1]);
        norm.init(&mut params[p.ln2.0..p.ln2.0 + p.ln2.1]);
        let attn = self.attention();
        let [wqkv, bqkv, wproj, bproj] = attn.tensors();
        let at = |(o, l): (usize, usize)| (p.attn.0 + o, l);
        for (o, l) in [at(wqkv), at(wproj), p.fc_w, p.proj_w] {
            for v in &mut params[o..o + l] {
                *v = 0.02 * normal();
            }
        }
        for (o, l) in [at(bqkv), at(bproj), p.fc_b, p.proj_b] {
            params[o..o + l].fill(0.0);
        }
    }

    /// Values of the stash for a micro-batch of `n` samples.
    pub fn stash_len(&self, n: usize) -> usize {
        self.stash(n).len
    }

    /// `y` (`[n·seq, width]`) from `x`; what the backward reads into `stash`
    /// ([`Block::stash_len`] values).
    pub(crate) fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        y: &mut [f32],
        stash: &mut [f32],
        threads: usize,
    ) {
        let (c, hid, rows) = (self.width, self.hidden(), n * self.seq);
        let (parts, at) = (self.parts(), self.stash(n));
        let [ln1_stats, h1, attn_stash, x2, ln2_stats, h2, u, m] = split_spans(
            stash,
            [
                at.ln1_stats,
                at.h1,
                at.attn,
                at.x2,
                at.ln2_stats,
                at.h2,
                at.u,
                at.m,
            ],
        );
        let norm = self.norm();
        // x₂ = x + attn(ln₁(x)).
        norm.forward(span(p, parts.ln1), x, h1, ln1_stats, threads);
        self.attention()
            .forward(span(p, parts.attn), h1, n, x2, attn_stash, threads);
        for (a, b) in x2.iter_mut().zip(x) {
            *a += b;
        }
        // y = x₂ + proj(gelu(fc(ln₂(x₂)))).
        norm.forward(span(p, parts.ln2), x2, h2, ln2_stats, threads);
        let (fc_w, fc_b) = (span(p, parts.fc_w), span(p, parts.fc_b));
        linear_forward(u, rows, hid, c, h2, fc_w, fc_b, threads);
        gelu_forward_threaded(u, m, threads);
        let (proj_w, proj_b) = (span(p, parts.proj_w), span(p, parts.proj_b));
        linear_forward(y, rows, c, hid, m, proj_w, proj_b, threads);
        for (a, b) in y.iter_mut().zip(x2.iter()) {
            *a += b;
        }
    }

    /// Decoding: `y` (`[rows, width]`) for `rows` new positions `at..at + rows` of one
    /// sequence, its attention reading and extending `cache` (see
    /// [`CausalSelfAttention::decode`]); the same pieces as [`Block::forward`], nothing stashed.
    pub(crate) fn decode(
        &self,
        p: &[f32],
        x: &[f32],
        rows: usize,
        at: usize,
        cache: &mut super::KeyValues,
        y: &mut [f32],
        scratch: &mut Vec<f32>,
        threads: usize,
    ) {
        let (c, hid, parts, norm) = (self.width, self.hidden(), self.parts(), self.norm());
        let mut buffers = vec![0.0f32; 3 * rows * c + 2 * rows * hid + 2 * rows];
        let (h, rest) = buffers.split_at_mut(rows * c);
        let (x2, rest) = rest.split_at_mut(rows * c);
        let (h2, rest) = rest.split_at_mut(rows * c);
        let (u, rest) = rest.split_at_mut(rows * hid);
        let (m, stats) = rest.split_at_mut(rows * hid);
        norm.forward(span(p, parts.ln1), x, h, stats, threads);
        self.attention().decode(
            span(p, parts.attn),
            h,
            rows,
            at,
            cache,
            x2,
            scratch,
            threads,
        );
        for (a, b) in x2.iter_mut().zip(x) {
            *a += b;
        }
        norm.forward(span(p, parts.ln2), x2, h2, stats, threads);
        let (fc_w, fc_b) = (span(p, parts.fc_w), span(p, parts.fc_b));
        linear_forward(u, rows, hid, c, h2, fc_w, fc_b, threads);
        gelu_forward_threaded(u, m, threads);
        let (proj_w, proj_b) = (span(p, parts.proj_w), span(p, parts.proj_b));
        linear_forward(y, rows, c, hid, m, proj_w, proj_b, threads);
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
        let (c, hid, rows) = (self.width, self.hidden(), n * self.seq);
        let (parts, at) = (self.parts(), self.stash(n));
        let [g_ln1, g_attn, g_ln2, g_fc_w, g_fc_b, g_proj_w, g_proj_b] = split_spans(
            g,
            [
                parts.ln1,
                parts.attn,
                parts.ln2,
                parts.fc_w,
                parts.fc_b,
                parts.proj_w,
                parts.proj_b,
            ],
        );
        let norm = self.norm();
        // Scratch: the MLP's hidden gradient, dh₂, dx₂, dh₁; the attention's own after them.
        let attention = self.attention();
        set_len(
            scratch,
            rows * hid + 3 * rows * c + attention.scratch_len(n),
        );
        let (dm, rest) = scratch.split_at_mut(rows * hid);
        let (dh2, rest) = rest.split_at_mut(rows * c);
        let (dx2, rest) = rest.split_at_mut(rows * c);
        let (dh1, attn_scratch) = rest.split_at_mut(rows * c);
        // The MLP: y = x₂ + m·W_projᵀ + b, m = gelu(u), u = h₂·W_fcᵀ + b.
        let (h2, u, m) = (span(stash, at.h2), span(stash, at.u), span(stash, at.m));
        matmul(
            g_proj_w,
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
        column_sums(g_proj_b, dy, accumulate);
        matmul(
            dm,
            rows,
            hid,
            c,
            dy,
            Op::N,
            span(p, parts.proj_w),
            Op::N,
            false,
            threads,
        );
        // du = dm · gelu'(u), in place.
        let du = dm;
        gelu_backward_in_place_threaded(u, du, threads);
        matmul(
            g_fc_w,
            hid,
            c,
            rows,
            du,
            Op::T,
            h2,
            Op::N,
            accumulate,
            threads,
        );
        column_sums(g_fc_b, du, accumulate);
        matmul(
            dh2,
            rows,
            c,
            hid,
            du,
            Op::N,
            span(p, parts.fc_w),
            Op::N,
            false,
            threads,
        );
        // dx₂ = dy + ln₂'s backward of dh₂.
        let x2 = span(stash, at.x2);
        norm.backward(
            span(p, parts.ln2),
            g_ln2,
            accumulate,
            x2,
            span(stash, at.ln2_stats),
            dh2,
            Some(dx2),
        );
        for (a, b) in dx2.iter_mut().zip(dy) {
            *a += b;
        }
        // The attention: x₂ = x + attn(h₁), h₁ = ln₁(x).
        attention.backward(
            span(p, parts.attn),
            g_attn,
            accumulate,
            span(stash, at.h1),
            span(stash, at.attn),
            dx2,
            n,
            Some(dh1),
            attn_scratch,
            threads,
        );
        if let Some(dx) = dx {
            norm.backward(
                span(p, parts.ln1),
                g_ln1,
                accumulate,
                x,
                span(stash, at.ln1_stats),
                dh1,
                Some(&mut *dx),
            );
            for (a, b) in dx.iter_mut().zip(dx2.iter()) {
                *a += b;
            }
        } else {
            norm.backward(
                span(p, parts.ln1),
                g_ln1,
                accumulate,
                x,
                span(stash, at.ln1_stats),
                dh1,
                None,
            );
        }
    }
}

/// Disjoint mutable spans of `v`, laid out in increasing order.
pub(super) fn split_spans<const N: usize>(
    v: &mut [f32],
    spans: [(usize, usize); N],
) -> [&mut [f32]; N] {
    let mut rest = v;
    let mut at = 0;
    spans.map(|(o, l)| {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(o - at);
        let (part, tail) = tail.split_at_mut(l);
        rest = tail;
        at = o + l;
        part
    })
}
