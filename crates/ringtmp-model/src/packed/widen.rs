//! Packed rows widened to `f32` for the GEMM of a many-row product (a prompt's positions):
//! sixteen values an instruction with AVX-512 — the nibbles or bytes widened to 32-bit
//! integers and converted, the 16-bit floats by `vcvtph2ps` or a shift — where
//! [`super::dequantize`] takes a value at a time (a sixth of a prompt's time went there).
//! [`PackedTensor::dequantize_rows`] and `dequantize_row` widen through here.
//!
//! Invariants: the result equals [`super::dequantize`]'s bit for bit (the same products and
//! sums in the same order, each rounded once: `d·q`, then `+ m`; no fused multiply–add);
//! whole blocks in, as many values out (the callers' rows).

use super::format::{Format, PackedTensor, dequantize};

impl PackedTensor {
    /// Row `i` as `f32` into `out` (`cols` values).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        widen(self.format(), self.row(i), out);
    }

    /// Rows `rows` as `f32` into `out` (row-major, `rows.len() × cols` values).
    pub fn dequantize_rows(&self, rows: std::ops::Range<usize>, out: &mut [f32]) {
        if !self.rows_in_stored_order() {
            for (i, out) in rows.zip(out.chunks_exact_mut(self.cols())) {
                self.dequantize_row(i, out);
            }
            return;
        }
        let n = self.row_bytes();
        let raw = &self.bytes()[rows.start * n..rows.end * n];
        widen(self.format(), raw, &mut out[..rows.len() * self.cols()]);
    }
}

/// `raw` (whole blocks of `format`) as `f32` into `out`, as [`dequantize`] gives them.
pub fn widen(format: Format, raw: &[u8], out: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    if super::cpu::avx512() {
        assert_eq!(
            raw.len() / format.block_bytes() * format.block(),
            out.len(),
            "whole blocks"
        );
        // SAFETY: the CPU has the features (checked) and `raw` is `out.len()` values' blocks.
        unsafe { x86::widen(format, raw, out) };
        return;
    }
    dequantize(format, raw, out);
}

#[cfg(all(target_arch = "x86_64", feature = "avx512"))]
mod x86 {
    use std::arch::x86_64::*;

    use super::Format;

    /// Bytes ahead of the one read that the loop asks the cache for (the blocks come from
    /// memory, read once a prompt).
    const AHEAD: usize = 1024;

    /// The f16 at `p` broadcast.
    #[inline(always)]
    unsafe fn half(p: *const u8) -> __m512 {
        unsafe {
            let bits = _mm_cvtsi32_si128(i32::from(p.cast::<u16>().read_unaligned()));
            _mm512_broadcastss_ps(_mm_cvtph_ps(bits))
        }
    }

    /// Writes `raw`'s values into `out` (as many as `raw`'s blocks hold, checked by the caller).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub(super) unsafe fn widen(format: Format, raw: &[u8], out: &mut [f32]) {
        let (size, block) = (format.block_bytes(), format.block());
        let blocks = raw.len() / size;
        let (mut p, mut o) = (raw.as_ptr(), out.as_mut_ptr());
        // SAFETY (every arm): block `b` reads `raw[b·size..(b+1)·size]` and writes
        // `out[b·block..(b+1)·block]`, inside both for `b < blocks`; the 16-bit formats take
        // sixteen 1-value blocks an iteration, the rest one at a time.
        unsafe {
            match format {
                Format::F16 | Format::Bf16 => {
                    let whole = blocks / 16 * 16;
                    for _ in 0..whole / 16 {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                        let h = _mm256_loadu_si256(p.cast());
                        let v = if format == Format::F16 {
                            _mm512_cvtph_ps(h)
                        } else {
                            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                        };
                        _mm512_storeu_ps(o, v);
                        (p, o) = (p.add(32), o.add(16));
                    }
                    let rest = blocks - whole;
                    let (raw, out) = (
                        std::slice::from_raw_parts(p, rest * 2),
                        std::slice::from_raw_parts_mut(o, rest),
                    );
                    super::dequantize(format, raw, out);
                }
                Format::Q8_0 => {
                    for _ in 0..blocks {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                        let d = half(p);
                        let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2).cast()));
                        let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18).cast()));
                        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
                        _mm512_storeu_ps(o.add(16), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
                        (p, o) = (p.add(size), o.add(block));
                    }
                }
                Format::Q4_0 | Format::Q4_1 => {
                    let q4_1 = format == Format::Q4_1;
                    let (low, eight) = (_mm512_set1_epi32(0x0F), _mm512_set1_epi32(8));
                    for _ in 0..blocks {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                        let d = half(p);
                        let head = if q4_1 { 4 } else { 2 };
                        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(head).cast()));
                        let mut lo = _mm512_and_si512(bytes, low);
                        let mut hi = _mm512_srli_epi32::<4>(bytes);
                        if !q4_1 {
                            (lo, hi) = (_mm512_sub_epi32(lo, eight), _mm512_sub_epi32(hi, eight));
                        }
                        let mut lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
                        let mut hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
                        if q4_1 {
                            let m = half(p.add(2));
                            (lo, hi) = (_mm512_add_ps(lo, m), _mm512_add_ps(hi, m));
                        }
                        _mm512_storeu_ps(o, lo);
                        _mm512_storeu_ps(o.add(16), hi);
                        (p, o) = (p.add(size), o.add(block));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of `format` with random values and finite scales (a NaN's bits may differ
    /// between conversions).
    fn random_blocks(format: Format, blocks: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let mut raw = Vec::with_capacity(blocks * format.block_bytes());
        for _ in 0..blocks {
            let mut block: Vec<u8> = (0..format.block_bytes()).map(|_| next() as u8).collect();
            let halves = match format {
                Format::F16 | Format::Bf16 => 1,
                Format::Q8_0 | Format::Q4_0 => 1,
                Format::Q4_1 => 2,
            };
            for h in 0..halves {
                let v =
                    (next() as f32 / u32::MAX as f32 - 0.5) * 2f32.powi(next() as i32 % 20 - 10);
                let bits = if format == Format::Bf16 {
                    super::super::bf16_bits(v)
                } else {
                    half::f16::from_f32(v).to_le_bytes()
                };
                block[2 * h..2 * h + 2].copy_from_slice(&bits);
            }
            raw.extend(block);
        }
        raw
    }

    #[test]
    fn widened_blocks_equal_the_reference_bit_for_bit() {
        for format in Format::ALL {
            for blocks in [0, 1, 15, 16, 17, 96, 101] {
                let raw = random_blocks(format, blocks, blocks as u64 + 7);
                let n = blocks * format.block();
                let (mut fast, mut reference) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                widen(format, &raw, &mut fast);
                dequantize(format, &raw, &mut reference);
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fast),
                    bits(&reference),
                    "{} × {blocks}",
                    format.name()
                );
            }
        }
    }
}
