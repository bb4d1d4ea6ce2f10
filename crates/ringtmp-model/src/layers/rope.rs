//! Rotary position embeddings (RoPE, Su et al. 2021) as the Llama family applies them to each
//! head's queries and keys, in Hugging Face's rotate-half convention: the pair `(i, i + d/2)` of
//! a head of size `d` is rotated by `position · inv_freq[i]`. The frequencies are
//! `theta^(−2i/d)`, scaled as `rope_scaling` says — `linear` (divided by the factor) or Llama 3's
//! (low frequencies divided by the factor, high ones kept, a smooth band between) — computed as
//! `transformers` computes them.
//!
//! The backward of a rotation is the rotation by the opposite angle, so [`Rope::apply`] with
//! `inverse` maps an output gradient to the input's.

/// RoPE's frequency scaling.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// Positions divided by `factor` (the frequencies, equivalently).
    Linear {
        /// The factor.
        factor: f64,
    },
    /// Llama 3's: wavelengths beyond `original / low_freq_factor` scaled by `1/factor`, below
    /// `original / high_freq_factor` kept, the band between interpolated smoothly.
    Llama3 {
        /// The factor.
        factor: f64,
        /// The band's low edge.
        low_freq_factor: f64,
        /// The band's high edge.
        high_freq_factor: f64,
        /// The context the model was trained at.
        original_max_position_embeddings: f64,
    },
    /// Each frequency divided by its own factor: how GGUF files keep Llama 3's scaling (the
    /// `rope_freqs` table llama.cpp's converter computes from it).
    Factors {
        /// One factor per frequency (`head_dim / 2`).
        factors: Vec<f64>,
    },
}

/// The rotation of one head size.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Values per head (even).
    pub head_dim: usize,
    /// The `head_dim / 2` frequencies.
    pub inv_freq: Vec<f32>,
}

impl Rope {
    /// The frequencies of heads of `head_dim` values with base `theta`, scaled by `scaling`
    /// (in f32, as `transformers` keeps them).
    ///
    /// # Panics
    /// If `head_dim` is odd (a configuration's check, before any model is built).
    pub fn new(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Self {
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE rotates pairs: head size {head_dim}"
        );
        let d = head_dim as f32;
        let base = theta as f32;
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d))
            .collect();
        match scaling {
            None => {}
            Some(RopeScaling::Factors { factors }) => {
                for (f, factor) in inv_freq.iter_mut().zip(factors) {
                    *f /= *factor as f32;
                }
            }
            Some(RopeScaling::Linear { factor }) => {
                let factor = *factor as f32;
                inv_freq.iter_mut().for_each(|f| *f /= factor);
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let (factor, low, high, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    // Wavelengths are finite and positive (frequencies are): no NaN to order.
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if medium {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Self { head_dim, inv_freq }
    }

    /// Rotates `x` — rows of `heads · head_dim` values, row `r` at position `positions[r]` — in
    /// place; by the opposite angles when `inverse` (the backward).
    ///
    /// # Panics
    /// If `x` is not one row per position of whole heads.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], inverse: bool) {
        let d = self.head_dim;
        let half = d / 2;
        assert!(
            !positions.is_empty() && x.len().is_multiple_of(positions.len() * d),
            "rows of whole heads"
        );
        let row = x.len() / positions.len();
        let sign = if inverse { -1.0 } else { 1.0 };
        for (values, &p) in x.chunks_exact_mut(row).zip(positions) {
            for head in values.chunks_exact_mut(d) {
                for i in 0..half {
                    let angle = p as f32 * self.inv_freq[i];
                    let (sin, cos) = (sign * angle.sin(), angle.cos());
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos - b * sin;
                    head[i + half] = b * cos + a * sin;
                }
            }
        }
    }
}

impl Rope {
    /// The factors that take the unscaled frequencies of heads of `head_dim` values with base
    /// `theta` to these (what GGUF keeps as `rope_freqs`).
    pub fn factors(&self, theta: f64) -> Vec<f64> {
        let plain = Self::new(self.head_dim, theta, None);
        plain
            .inv_freq
            .iter()
            .zip(&self.inv_freq)
            .map(|(p, s)| f64::from(p / s))
            .collect()
    }

    /// Rotates columns `col..col + width` (whole heads) of each row of `x` — rows of `stride`
    /// values, row `r` at position `positions[r]` — in place; by the opposite angles when
    /// `inverse`. Each row's angles are computed once for all its heads.
    ///
    /// # Panics
    /// If the columns are not whole heads inside the rows, or there is not a position a row.
    pub fn apply_columns(
        &self,
        x: &mut [f32],
        stride: usize,
        col: usize,
        width: usize,
        positions: &[usize],
        inverse: bool,
    ) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        assert!(
            width.is_multiple_of(d) && col + width <= stride && x.len() == positions.len() * stride,
            "rows of whole heads"
        );
        let sign = if inverse { -1.0 } else { 1.0 };
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        for (row, &p) in x.chunks_exact_mut(stride).zip(positions) {
            for i in 0..half {
                let angle = p as f32 * self.inv_freq[i];
                (sin[i], cos[i]) = (sign * angle.sin(), angle.cos());
            }
            for head in row[col..col + width].chunks_exact_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (u, v) = (a[i], b[i]);
                    a[i] = u * cos[i] - v * sin[i];
                    b[i] = v * cos[i] + u * sin[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation is orthogonal: the inverse undoes it, and it keeps every pair's length.
    #[test]
    fn the_inverse_undoes_the_rotation_and_lengths_are_kept() {
        let rope = Rope::new(8, 10_000.0, None);
        let x: Vec<f32> = (0..3 * 2 * 8)
            .map(|i| ((i * 37) % 11) as f32 - 5.0)
            .collect();
        let positions = [0, 7, 4096];
        let mut y = x.clone();
        rope.apply(&mut y, &positions, false);
        let norm = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
        assert!((norm(&y) - norm(&x)).abs() < 1e-3 * norm(&x));
        assert_eq!(&y[..16], &x[..16], "position 0 is not rotated");
        rope.apply(&mut y, &positions, true);
        for (a, b) in y.iter().zip(&x) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    /// The backward is the adjoint: ⟨R x, g⟩ = ⟨x, Rᵀ g⟩.
    #[test]
    fn the_inverse_is_the_adjoint() {
        let rope = Rope::new(4, 500_000.0, Some(&RopeScaling::Linear { factor: 2.0 }));
        let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
        let g: Vec<f32> = (0..8).map(|i| 1.0 - i as f32 * 0.2).collect();
        let (mut rx, mut rg) = (x.clone(), g.clone());
        rope.apply(&mut rx, &[3, 1000], false);
        rope.apply(&mut rg, &[3, 1000], true);
        let dot =
            |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(x * y)).sum::<f64>();
        assert!((dot(&rx, &g) - dot(&x, &rg)).abs() < 1e-5);
    }
}
