//! Fully connected layer: `y = x · Wᵀ + b` with `W` stored `[out, in]` (the common convention, so
//! checkpoints read naturally in other tools).

use serde::{Deserialize, Serialize};

use crate::kernels::{Op, column_sums, linear_forward, matmul};

/// Fully connected layer geometry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

impl Linear {
    /// Weights plus biases.
    pub fn param_count(&self) -> usize {
        self.out_features * (self.in_features + 1)
    }

    pub(crate) fn forward(&self, p: &[f32], x: &[f32], n: usize, y: &mut [f32], threads: usize) {
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
