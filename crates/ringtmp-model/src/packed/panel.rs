//! A prompt's positions times a slice of weight rows widened to `f32`, the product a prefill
//! spends its time in: `t[j, r] = x[j] · W[r]` for every position `j` and the slice's rows `r`.
//!
//! The positions are transposed once per product into panels of 16 ([`Positions`]: for each
//! input feature, sixteen positions' values side by side), so the AVX-512 kernel holds a tile
//! of 8 rows × 48 positions in 24 registers and, per input feature, loads three vectors of
//! positions and broadcasts each row's weight — 24 fused multiply–adds for 11 loads, the
//! weights read where they were widened, nothing else packed. (The `gemm` crate packs both
//! operands on every call; at 46 positions through SmolLM2's projections that took as long
//! as the products.) Elsewhere the product goes to [`linear_forward`].
//!
//! Invariants: `t` is `m × rows` row-major (a position's products with the slice's rows side
//! by side, as they lie in `y = x·Wᵀ`); each value is a sum over the input features in order,
//! one rounding a term (fused).

use crate::kernels::linear_forward;

/// Positions a panel holds (an AVX-512 vector of `f32`).
const LANES: usize = 16;

/// `m` positions of `k` features, transposed into panels of [`LANES`] (zeros past `m`).
#[derive(Default)]
pub struct Positions {
    m: usize,
    k: usize,
    /// Panel `p`, feature `i`, lane `l` at `(p · k + i) · LANES + l`: position `p · LANES + l`.
    panels: Vec<f32>,
    /// The positions as given (row-major `m × k`), for the portable path.
    rows: Vec<f32>,
}

impl Positions {
    /// Takes `x` (`m × k`, row-major) in, reusing the buffers.
    pub fn set(&mut self, x: &[f32], m: usize, k: usize) {
        (self.m, self.k) = (m, k);
        self.rows.clear();
        self.panels.clear();
        if !super::cpu::avx512() {
            self.rows.extend_from_slice(&x[..m * k]);
            return;
        }
        let count = m.div_ceil(LANES);
        self.panels.resize(count * k * LANES, 0.0);
        // Only the AVX-512 kernel reads panels (`cpu::avx512`).
        #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
        // SAFETY: the CPU has AVX-512 (`cpu::avx512`); `x` holds `m × k` values (the slice) and the
        // panels `count · k · 16`.
        unsafe {
            x86::transpose(&x[..m * k], m, k, &mut self.panels)
        };
    }
}

/// `t[j, r] = x[j] · w[r]` for every position `j` of `x` and the `rows` rows of `w`
/// (`rows × k`, row-major); `t` is `m × rows`, as the rows' columns of `y = x·Wᵀ` lie.
pub fn product(t: &mut [f32], w: &[f32], rows: usize, x: &Positions) {
    let (m, k) = (x.m, x.k);
    assert!(
        w.len() >= rows * k && t.len() >= rows * m,
        "panel::product: bad lengths"
    );
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    if super::cpu::avx512() {
        // SAFETY: the CPU has AVX-512 (checked); the lengths were checked above and the
        // panels hold `ceil(m / 16)` panels of `k` features (`Positions::set`).
        unsafe { x86::product(t, w, rows, x) };
        return;
    }
    linear_forward(t, m, rows, k, &x.rows, w, &[], 1);
}

#[cfg(all(target_arch = "x86_64", feature = "avx512"))]
mod x86 {
    use std::arch::x86_64::*;

    use super::{LANES, Positions};

    /// Rows of a tile.
    const ROWS: usize = 8;

    /// Lane `l`'s offset `l · step` (a gather's or a scatter's indices).
    #[target_feature(enable = "avx512f")]
    fn lane_offsets(step: usize) -> __m512i {
        _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(step as i32),
        )
    }

    /// The first `valid` (at most 16) lanes.
    fn first_lanes(valid: usize) -> __mmask16 {
        if valid >= LANES {
            !0
        } else {
            (1u16 << valid) - 1
        }
    }

    /// `x` (`m × k`) into panels of 16 positions (see [`Positions`]): each feature's 16
    /// positions gathered in one instruction, those past `m` zero.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(x: &[f32], m: usize, k: usize, panels: &mut [f32]) {
        let stride = lane_offsets(k);
        for p in 0..m.div_ceil(LANES) {
            let mask = first_lanes(m - p * LANES);
            let base = x.as_ptr().wrapping_add(p * LANES * k);
            for i in 0..k {
                // SAFETY: lane `l < valid` reads `x[(16p + l)·k + i]`, inside `x` as
                // `16p + l < m`; masked lanes read nothing; the store is panel `p`'s feature `i`.
                unsafe {
                    let v = _mm512_mask_i32gather_ps::<4>(
                        _mm512_setzero_ps(),
                        mask,
                        stride,
                        base.add(i).cast(),
                    );
                    _mm512_storeu_ps(panels.as_mut_ptr().add((p * k + i) * LANES), v);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(t: &mut [f32], w: &[f32], rows: usize, x: &Positions) {
        let (m, k) = (x.m, x.k);
        let panels = m.div_ceil(LANES);
        let mut r = 0;
        while r < rows {
            let height = (rows - r).min(ROWS);
            let mut p = 0;
            while p < panels {
                let width = (panels - p).min(3);
                // SAFETY: rows `r..r + height` of `w` and panels `p..p + width` lie inside
                // their buffers (`product`'s checks); `tile` writes `t`'s columns
                // `r..r + height` of positions `16p..min(16(p + width), m)`.
                unsafe {
                    let (wp, xp) = (w.as_ptr().add(r * k), x.panels.as_ptr().add(p * k * LANES));
                    let out = Out {
                        at: t.as_mut_ptr().add(r),
                        stride: rows,
                        m,
                        first: p * LANES,
                    };
                    match (height, width) {
                        (ROWS, 3) => tile::<ROWS, 3>(wp, xp, k, &out),
                        (ROWS, 2) => tile::<ROWS, 2>(wp, xp, k, &out),
                        (ROWS, _) => tile::<ROWS, 1>(wp, xp, k, &out),
                        (_, 3) => rows_one_by_one::<3>(height, wp, xp, k, &out),
                        (_, 2) => rows_one_by_one::<2>(height, wp, xp, k, &out),
                        _ => rows_one_by_one::<1>(height, wp, xp, k, &out),
                    }
                }
                p += width;
            }
            r += height;
        }
    }

    /// Where a tile writes: position `j`'s product with the tile's row `r` at
    /// `at[j · stride + r]`, for the positions `first + j` below `m`.
    struct Out {
        at: *mut f32,
        stride: usize,
        m: usize,
        first: usize,
    }

    /// Fewer rows than a tile, one at a time.
    #[inline(always)]
    unsafe fn rows_one_by_one<const P: usize>(
        height: usize,
        w: *const f32,
        x: *const f32,
        k: usize,
        out: &Out,
    ) {
        for r in 0..height {
            // SAFETY: row `r` of the tile (the caller's bounds).
            unsafe {
                let row = Out {
                    at: out.at.add(r),
                    ..*out
                };
                tile::<1, P>(w.add(r * k), x, k, &row);
            }
        }
    }

    /// `R` rows (`k` apart at `w`) times `P` panels (`k · 16` apart at `x`), scattered to
    /// `out`.
    #[inline(always)]
    unsafe fn tile<const R: usize, const P: usize>(
        w: *const f32,
        x: *const f32,
        k: usize,
        out: &Out,
    ) {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for i in 0..k {
                let mut xv = [_mm512_setzero_ps(); P];
                for (p, v) in xv.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(x.add((p * k + i) * LANES));
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*w.add(r * k + i));
                    for (a, v) in acc.iter_mut().zip(&xv) {
                        *a = _mm512_fmadd_ps(b, *v, *a);
                    }
                }
            }
            // Lane `l` of a row's vector is position `first + 16p + l`: `stride` apart in `t`.
            let lanes = lane_offsets(out.stride);
            for (r, acc) in acc.iter().enumerate() {
                for (p, a) in acc.iter().enumerate() {
                    let first = out.first + p * LANES;
                    let mask = first_lanes(out.m.saturating_sub(first));
                    let at = out.at.wrapping_add(first * out.stride + r);
                    _mm512_mask_i32scatter_ps::<4>(at.cast(), mask, lanes, *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_give_each_rows_products_with_each_position() {
        for (m, rows, k) in [
            (1, 1, 3),
            (46, 96, 64),
            (17, 13, 32),
            (50, 9, 40),
            (16, 8, 1),
        ] {
            let w: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.1)
                .collect();
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 5 % 19) as f32 - 9.0) * 0.1)
                .collect();
            let mut positions = Positions::default();
            positions.set(&x, m, k);
            let mut t = vec![f32::NAN; rows * m];
            product(&mut t, &w, rows, &positions);
            for r in 0..rows {
                for j in 0..m {
                    let want: f64 = (0..k)
                        .map(|i| f64::from(w[r * k + i]) * f64::from(x[j * k + i]))
                        .sum();
                    let got = t[j * rows + r];
                    assert!(
                        (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "m {m}, rows {rows}, k {k}: t[{r}, {j}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}
