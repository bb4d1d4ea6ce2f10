//! Token and learned position embeddings, as GPT-2's `wte` and `wpe`: a sample of `seq` token
//! ids (as `f32`, exact below 2^24) becomes `[seq, width]`, row `t` the sum of the token's row
//! of `wte` (`[vocab, width]`) and row `t` of `wpe` (`[seq, width]`). Without learned positions
//! (the Llama family, whose attention rotates by position instead) there is no `wpe`.
//!
//! Ids are checked where they are read (the text readers refuse an id past the vocabulary); an
//! id out of range here is a programming error, caught by a debug assertion and clamped in
//! release, never an out-of-bounds read. Ids are not differentiable: an input gradient, when
//! asked for, is zero.

use serde::{Deserialize, Serialize};

/// Embedding geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Embedding {
    /// Token ids.
    pub vocab: usize,
    /// Positions per sample.
    pub seq: usize,
    /// Values per position.
    pub width: usize,
    /// Whether it adds a learned position embedding (`wpe`).
    #[serde(default = "yes", skip_serializing_if = "Clone::clone")]
    pub positions: bool,
}

fn yes() -> bool {
    true
}

impl Embedding {
    /// `wte` then, with positions, `wpe`.
    pub fn param_count(&self) -> usize {
        (self.vocab + self.position_rows()) * self.width
    }

    /// Rows of `wpe`: `seq`, or none.
    fn position_rows(&self) -> usize {
        if self.positions { self.seq } else { 0 }
    }

    /// `out` = the token's row of `wte`, plus position `t`'s row of `wpe` when there is one.
    fn embed(&self, p: &[f32], id: usize, t: usize, out: &mut [f32]) {
        let c = self.width;
        let (wte, wpe) = p.split_at(self.vocab * c);
        let tok = &wte[id * c..(id + 1) * c];
        if self.positions {
            let pos = &wpe[t * c..(t + 1) * c];
            for ((o, a), b) in out.iter_mut().zip(tok).zip(pos) {
                *o = a + b;
            }
        } else {
            out.copy_from_slice(tok);
        }
    }

    fn id(&self, x: f32) -> usize {
        debug_assert!(
            x >= 0.0 && (x as usize) < self.vocab && x.fract() == 0.0,
            "token id {x} outside a vocabulary of {}",
            self.vocab
        );
        (x.max(0.0) as usize).min(self.vocab - 1)
    }

    /// `y` (`[n·seq, width]`) from the ids `x` (`[n·seq]`).
    pub(crate) fn forward(&self, p: &[f32], x: &[f32], y: &mut [f32]) {
        for (i, (&token, out)) in x.iter().zip(y.chunks_exact_mut(self.width)).enumerate() {
            self.embed(p, self.id(token), i % self.seq, out);
        }
    }

    /// Decoding: `y` (`[ids, width]`) for the ids `x` at positions `at..at + ids` of one
    /// sequence (each below `seq`: the caller checks).
    pub(crate) fn forward_at(&self, p: &[f32], x: &[f32], at: usize, y: &mut [f32]) {
        for (i, (&token, out)) in x.iter().zip(y.chunks_exact_mut(self.width)).enumerate() {
            self.embed(p, self.id(token), at + i, out);
        }
    }

    /// Adds (or writes, when `!accumulate`) each position's gradient to its token's row of
    /// `wte` and its position's row of `wpe`.
    pub(crate) fn backward(
        &self,
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut Vec<f32>>,
    ) {
        if !accumulate {
            g.fill(0.0);
        }
        let c = self.width;
        let (gte, gpe) = g.split_at_mut(self.vocab * c);
        for (i, (&token, d)) in x.iter().zip(dy.chunks_exact(c)).enumerate() {
            let id = self.id(token);
            let t = i % self.seq;
            for (g, d) in gte[id * c..(id + 1) * c].iter_mut().zip(d) {
                *g += d;
            }
            if self.positions {
                for (g, d) in gpe[t * c..(t + 1) * c].iter_mut().zip(d) {
                    *g += d;
                }
            }
        }
        if let Some(dx) = dx {
            dx.fill(0.0);
        }
    }
}
