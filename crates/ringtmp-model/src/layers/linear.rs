//! Fully connected layer: `y = x · Wᵀ + b` with `W` stored `[out, in]` (the common convention, so
//! checkpoints read naturally in other tools), `b` optional (the Llama family's heads have none).

use serde::{Deserialize, Serialize};

use crate::kernels::{Op, column_sums, linear_forward, matmul, matmul_tn_rows, set_len};

/// Fully connected layer geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Whether it adds a bias (after the weights in its parameters).
    #[serde(default = "yes", skip_serializing_if = "Clone::clone")]
    pub bias: bool,
}

fn yes() -> bool {
    true
}

impl Linear {
    /// A layer with a bias.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self {
            in_features,
            out_features,
            bias: true,
        }
    }

    /// Weights plus biases.
    pub fn param_count(&self) -> usize {
        self.out_features * (self.in_features + usize::from(self.bias))
    }

    pub(crate) fn forward(&self, p: &[f32], x: &[f32], n: usize, y: &mut [f32], threads: usize) {
        // Without a bias, `b` is empty: the kernels add none.
        let (w, b) = p.split_at(self.in_features * self.out_features);
        linear_forward(y, n, self.out_features, self.in_features, x, w, b, threads);
    }

    pub(crate) fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        dy: &[f32],
        n: usize,
        dx: Option<&mut Vec<f32>>,
        threads: usize,
    ) {
        self.weight_grad(g, accumulate, x, dy, n, threads);
        if let Some(dx) = dx {
            self.input_grad(p, dy, n, dx, threads);
        }
    }

    /// `dW[out, in] (+)= dyᵀ[out, n] · x[n, in]` and `db (+)= Σ_rows dy`.
    pub(crate) fn weight_grad(
        &self,
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        dy: &[f32],
        n: usize,
        threads: usize,
    ) {
        let (fi, fo) = (self.in_features, self.out_features);
        let (gw, gb) = g.split_at_mut(fi * fo);
        matmul(gw, fo, fi, n, dy, Op::T, x, Op::N, accumulate, threads);
        column_sums(gb, dy, accumulate);
    }

    /// Parameters per block of [`Linear::weight_grad_block`]: whole rows of `W`, about 256 KB of
    /// gradient (in L2 while its update reads it), in rows of a multiple of 64 — the AVX-512
    /// GEMM's micro-tile height — where the layer has that many.
    pub(crate) fn grad_block(&self) -> usize {
        let rows = ((64 * 1024 / self.in_features.max(1)) / 64 * 64).max(64);
        rows.min(self.out_features).max(1) * self.in_features
    }

    /// The weight gradient's values `range` (whole rows of `dW[out, in]`, a range given by
    /// [`Linear::grad_block`]'s blocks) into `out`: `dy[:, rows]ᵀ · x`, plus `acc` (the gradient
    /// accumulated so far, the same range) when given. The bits of [`Linear::weight_grad`].
    pub(crate) fn weight_grad_block(
        &self,
        range: std::ops::Range<usize>,
        out: &mut [f32],
        acc: Option<&[f32]>,
        x: &[f32],
        dy: &[f32],
        n: usize,
    ) {
        let fi = self.in_features;
        debug_assert!(
            range.start.is_multiple_of(fi)
                && range.end.is_multiple_of(fi)
                && range.end <= fi * self.out_features
        );
        if let Some(acc) = acc {
            out.copy_from_slice(acc);
        }
        let rows = range.start / fi..range.end / fi;
        matmul_tn_rows(out, rows, self.out_features, fi, n, dy, x, acc.is_some());
    }

    /// [`Linear::input_grad`] into `dx` resized to `n × in`.
    pub(crate) fn input_grad_into(
        &self,
        p: &[f32],
        dy: &[f32],
        n: usize,
        dx: &mut Vec<f32>,
        threads: usize,
    ) {
        set_len(dx, n * self.in_features);
        self.input_grad(p, dy, n, dx, threads);
    }

    /// `dx[n, in] = dy[n, out] · W[out, in]`.
    pub(crate) fn input_grad(
        &self,
        p: &[f32],
        dy: &[f32],
        n: usize,
        dx: &mut [f32],
        threads: usize,
    ) {
        let (fi, fo) = (self.in_features, self.out_features);
        matmul(
            dx,
            n,
            fi,
            fo,
            dy,
            Op::N,
            &p[..fi * fo],
            Op::N,
            false,
            threads,
        );
    }
}
