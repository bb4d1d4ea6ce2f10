//! Inverted dropout: in training each value is kept with probability `1 - p` and scaled by
//! `1 / (1 - p)`; in evaluation the layer is the identity.
//!
//! The mask of a sample is a pure function of `(seed, layer index, step, row in the mini-batch)`
//! (a counter-based stream), not of a generator's running state. So a mini-batch gets the same
//! masks whether it runs whole or split into micro-batches on several stages, and a resumed run
//! needs no generator state to continue exactly.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Aux, Pass, mix};
use crate::kernels::set_len;

/// Dropout probability.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dropout {
    /// Probability of zeroing a value, in `[0, 1)`.
    pub p: f32,
}

impl Dropout {
    pub(crate) fn forward(
        &self,
        index: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        aux: &mut Aux,
        pass: &Pass,
    ) {
        if !pass.train || self.p == 0.0 {
            y.copy_from_slice(x);
            set_len(&mut aux.values, x.len());
            aux.values.fill(1.0);
            return;
        }
        let keep = 1.0 - self.p;
        let scale = 1.0 / keep;
        let width = x.len() / n.max(1);
        set_len(&mut aux.values, x.len());
        let layer_stream = mix(pass.seed, index as u64);
        for (row, (mask, (xs, ys))) in aux
            .values
            .chunks_exact_mut(width)
            .zip(x.chunks_exact(width).zip(y.chunks_exact_mut(width)))
            .enumerate()
        {
            let key = mix(mix(layer_stream, pass.step), (pass.row_offset + row) as u64);
            let mut rng = ChaCha8Rng::seed_from_u64(key);
            for ((m, xv), yv) in mask.iter_mut().zip(xs).zip(ys.iter_mut()) {
                *m = if rng.random::<f32>() < keep {
                    scale
                } else {
                    0.0
                };
                *yv = xv * *m;
            }
        }
    }

    pub(crate) fn backward(aux: &Aux, dy: &[f32], dx: &mut [f32]) {
        crate::kernels::multiply(dy, &aux.values, dx);
    }
}
