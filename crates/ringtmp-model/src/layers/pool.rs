//! Max-pooling over channels-last images; records the winning input position of every output so
//! the backward pass is a scatter.

use serde::{Deserialize, Serialize};

use super::Aux;

/// Max-pooling geometry (square window, no padding; a partial window at the edge is dropped, as
/// in the common frameworks' default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxPool2d {
    /// Input height.
    pub in_height: usize,
    /// Input width.
    pub in_width: usize,
    /// Channels (unchanged by pooling).
    pub channels: usize,
    /// Window side.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Output height.
    pub out_height: usize,
    /// Output width.
    pub out_width: usize,
}

impl MaxPool2d {
    pub(crate) fn forward(&self, x: &[f32], n: usize, y: &mut [f32], aux: &mut Aux) {
        let c = self.channels;
        let sample_in = self.in_height * self.in_width * c;
        let sample_out = self.out_height * self.out_width * c;
        aux.indices.resize(n * sample_out, 0);
        for b in 0..n {
            let xs = &x[b * sample_in..(b + 1) * sample_in];
            for oy in 0..self.out_height {
                for ox in 0..self.out_width {
                    let o = b * sample_out + (oy * self.out_width + ox) * c;
                    let (ys, idx) = (&mut y[o..o + c], &mut aux.indices[o..o + c]);
                    // Start from the window's first element (not -inf) so a NaN input still
                    // leaves a valid index behind.
                    let first = ((oy * self.stride) * self.in_width + ox * self.stride) * c;
                    ys.copy_from_slice(&xs[first..first + c]);
                    for (ch, i) in idx.iter_mut().enumerate() {
                        *i = (b * sample_in + first + ch) as u32;
                    }
                    for ky in 0..self.kernel {
                        for kx in 0..self.kernel {
                            let at =
                                ((oy * self.stride + ky) * self.in_width + ox * self.stride + kx)
                                    * c;
                            for ch in 0..c {
                                let v = xs[at + ch];
                                // `>` keeps the first maximum, like the common frameworks.
                                if v > ys[ch] {
                                    ys[ch] = v;
                                    idx[ch] = (b * sample_in + at + ch) as u32;
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    pub(crate) fn backward(aux: &Aux, dy: &[f32], dx: &mut [f32]) {
        dx.fill(0.0);
        for (g, &i) in dy.iter().zip(&aux.indices) {
            dx[i as usize] += g;
        }
    }
}
