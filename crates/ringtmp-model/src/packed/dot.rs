//! Matrix–vector products over held weights: `y[i] = row_i · x`, each row dequantised inside
//! the loop (a block at a time, never written out), as llama.cpp's kernels read GGUF blocks.
//! Decoding one token reads every weight once, so these loops run at the speed memory delivers
//! the bytes: the fewer bytes a weight takes, the faster a token.
//!
//! Two versions: AVX-512 (F with F16C, chosen at run time, and only in a build with the
//! crate's `avx512` feature), and a portable one that dequantises a block into 32 floats on the
//! stack and sums its products (compiled for AVX2 and NEON by `multiversion`). Both sum in
//! another order than [`super::format::dequantize`] followed by a dot product would: results
//! agree to float rounding, not bit for bit (the tests bound the difference).

use multiversion::multiversion;

use super::format::{PackedTensor, dequantize};

/// `y[k] = row (first + k) · x` for every `k` of `y`.
///
/// # Panics
/// If `x` is not `cols` values or the rows run past the matrix.
pub fn dot_rows(t: &PackedTensor, first: usize, x: &[f32], y: &mut [f32]) {
    assert!(
        x.len() == t.cols() && first + y.len() <= t.rows(),
        "dot_rows: {} values for {} columns, rows {first}..{} of {}",
        x.len(),
        t.cols(),
        first + y.len(),
        t.rows()
    );
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    if super::cpu::avx512() {
        // SAFETY: the CPU has AVX-512F and F16C (checked above); the slices' lengths were
        // checked against the matrix.
        unsafe { x86::dot_rows(t, first, x, y) };
        return;
    }
    portable(t, first, x, y);
}

#[multiversion(targets("x86_64+avx2+fma+f16c", "aarch64+neon"))]
fn portable(t: &PackedTensor, first: usize, x: &[f32], y: &mut [f32]) {
    let format = t.format();
    // A block's values dequantised on the stack (16-bit floats: 32 at a time), then summed in
    // eight lanes.
    let (values, size) = match format.block() {
        1 => (32, 64),
        block => (block, format.block_bytes()),
    };
    let mut vals = [0.0f32; 32];
    for (k, out) in y.iter_mut().enumerate() {
        let row = t.row(first + k);
        let mut acc = [0.0f32; 8];
        let mut tail = 0.0f32;
        for (bytes, xs) in row.chunks(size).zip(x.chunks(values)) {
            let vals = &mut vals[..xs.len()];
            dequantize(format, bytes, vals);
            let (whole, rest) = (xs.len() / 8 * 8, xs.len() % 8);
            for (v, x) in vals[..whole].chunks_exact(8).zip(xs.chunks_exact(8)) {
                for ((a, v), x) in acc.iter_mut().zip(v).zip(x) {
                    *a += v * x;
                }
            }
            if rest > 0 {
                tail += vals[whole..]
                    .iter()
                    .zip(&xs[whole..])
                    .map(|(v, x)| v * x)
                    .sum::<f32>();
            }
        }
        *out = acc.iter().sum::<f32>() + tail;
    }
}

#[cfg(all(target_arch = "x86_64", feature = "avx512"))]
mod x86 {
    use std::arch::x86_64::*;

    use crate::packed::format::{Format, PackedTensor};

    /// Bytes ahead of the one read that the loops ask the cache for (the next rows: a row of
    /// a small model is a few hundred bytes, and the hardware prefetcher stops at page ends).
    const AHEAD: usize = 1024;

    /// The scale at `p` (an f16) as f32.
    #[inline(always)]
    unsafe fn scale(p: *const u8) -> f32 {
        unsafe {
            let bits = i32::from(p.cast::<u16>().read_unaligned());
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    pub(super) unsafe fn dot_rows(t: &PackedTensor, first: usize, x: &[f32], y: &mut [f32]) {
        let cols = t.cols();
        let xp = x.as_ptr();
        for (k, out) in y.iter_mut().enumerate() {
            let row = t.row(first + k).as_ptr();
            // SAFETY (all arms): `row` holds `cols` values of the format (whole blocks, checked
            // when the tensor was built) and `x` holds `cols` floats.
            *out = unsafe {
                match t.format() {
                    Format::Q8_0 => q8_0(row, xp, cols / 32),
                    Format::Q4_0 => q4_0(row, xp, cols / 32),
                    Format::Q4_1 => q4_1(row, xp, cols / 32),
                    Format::Bf16 => bf16(row, xp, cols),
                    Format::F16 => f16(row, xp, cols),
                }
            };
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn q8_0(row: *const u8, x: *const f32, blocks: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for b in 0..blocks {
                let p = row.add(b * 34);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                let xs = x.add(b * 32);
                let d = _mm512_set1_ps(scale(p));
                let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2).cast()));
                let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18).cast()));
                let s = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), _mm512_loadu_ps(xs));
                let s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_loadu_ps(xs.add(16)), s);
                if b % 2 == 0 {
                    acc0 = _mm512_fmadd_ps(d, s, acc0);
                } else {
                    acc1 = _mm512_fmadd_ps(d, s, acc1);
                }
            }
            _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
        }
    }

    /// The 32 four-bit values of a block's 16 bytes at `p` as two vectors of 16 floats: the
    /// low nibbles (values 0..16) and the high ones (16..32).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> (__m512, __m512) {
        unsafe {
            let bytes = _mm_loadu_si128(p.cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask));
            let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
            (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn q4_0(row: *const u8, x: *const f32, blocks: usize) -> f32 {
        unsafe {
            let eight = _mm512_set1_ps(8.0);
            let mut acc = _mm512_setzero_ps();
            for b in 0..blocks {
                let p = row.add(b * 18);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                let xs = x.add(b * 32);
                let (lo, hi) = nibbles(p.add(2));
                let s = _mm512_mul_ps(_mm512_sub_ps(lo, eight), _mm512_loadu_ps(xs));
                let s = _mm512_fmadd_ps(_mm512_sub_ps(hi, eight), _mm512_loadu_ps(xs.add(16)), s);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(scale(p)), s, acc);
            }
            _mm512_reduce_add_ps(acc)
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn q4_1(row: *const u8, x: *const f32, blocks: usize) -> f32 {
        unsafe {
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for b in 0..blocks {
                let p = row.add(b * 20);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                let xs = x.add(b * 32);
                let (x0, x1) = (_mm512_loadu_ps(xs), _mm512_loadu_ps(xs.add(16)));
                let (lo, hi) = nibbles(p.add(4));
                let s = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(scale(p)), s, acc);
                mins =
                    _mm512_fmadd_ps(_mm512_set1_ps(scale(p.add(2))), _mm512_add_ps(x0, x1), mins);
            }
            _mm512_reduce_add_ps(_mm512_add_ps(acc, mins))
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn bf16(row: *const u8, x: *const f32, cols: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut j = 0;
            while j + 32 <= cols {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(2 * j + AHEAD).cast());
                let w0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(2 * j).cast()));
                let w1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(2 * j + 32).cast()));
                let w0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
                let w1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
                acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x.add(j)), acc0);
                acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(j + 16)), acc1);
                j += 32;
            }
            let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            while j < cols {
                let bits = u32::from(row.add(2 * j).cast::<u16>().read_unaligned()) << 16;
                sum += f32::from_bits(bits) * *x.add(j);
                j += 1;
            }
            sum
        }
    }

    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn f16(row: *const u8, x: *const f32, cols: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut j = 0;
            while j + 32 <= cols {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(2 * j + AHEAD).cast());
                let w0 = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * j).cast()));
                let w1 = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * j + 32).cast()));
                acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x.add(j)), acc0);
                acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(j + 16)), acc1);
                j += 32;
            }
            let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            while j < cols {
                sum += scale(row.add(2 * j)) * *x.add(j);
                j += 1;
            }
            sum
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::Format;

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * (1.0 + (i % 13) as f32))
            .collect()
    }

    /// A tensor in `format` from `values` (the 4-bit formats built from the values' Q8_0
    /// blocks, their nibbles the top bits of each byte: any bytes are a valid block).
    fn packed(format: Format, rows: usize, cols: usize, values: &[f32]) -> PackedTensor {
        match format {
            Format::Q4_0 | Format::Q4_1 => {
                let q8 = PackedTensor::quantize(Format::Q8_0, rows, cols, values).unwrap();
                let size = format.block_bytes();
                let bytes = q8
                    .bytes()
                    .chunks_exact(34)
                    .flat_map(|b| {
                        let mut out = vec![0u8; size];
                        let head = size - 16;
                        out[..2].copy_from_slice(&b[..2]);
                        if head == 4 {
                            out[2..4].copy_from_slice(&[0x00, 0xB0]); // m = -0.125
                        }
                        for j in 0..16 {
                            out[head + j] = (b[2 + j] >> 4) | (b[18 + j] & 0xF0);
                        }
                        out
                    })
                    .collect();
                PackedTensor::new(format, rows, cols, bytes).unwrap()
            }
            _ => PackedTensor::quantize(format, rows, cols, values).unwrap(),
        }
    }

    /// Every format's products equal the dequantised rows' dot products (in f64) to within
    /// float rounding, on the kernel this CPU runs and on the portable one.
    #[test]
    fn products_equal_the_dequantised_rows() {
        let (rows, cols) = (37, 96);
        let values = matrix(rows, cols);
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        for format in Format::ALL {
            let t = packed(format, rows, cols, &values);
            let mut want = vec![0.0f64; rows];
            let mut row = vec![0.0f32; cols];
            for (i, w) in want.iter_mut().enumerate() {
                t.dequantize_row(i, &mut row);
                *w = row.iter().zip(&x).map(|(a, b)| f64::from(*a * *b)).sum();
            }
            let (mut fast, mut plain) = (vec![0.0f32; rows - 3], vec![0.0f32; rows - 3]);
            dot_rows(&t, 3, &x, &mut fast);
            portable(&t, 3, &x, &mut plain);
            for (got, name) in [(&fast, "dispatched"), (&plain, "portable")] {
                for (k, g) in got.iter().enumerate() {
                    let w = want[k + 3];
                    assert!(
                        (f64::from(*g) - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{} {name} row {}: {g} against {w}",
                        format.name(),
                        k + 3
                    );
                }
            }
        }
    }

    /// A row of 16-bit floats that is not whole vectors sums its tail too.
    #[test]
    fn sixteen_bit_rows_of_any_length() {
        let (rows, cols) = (3, 45);
        let values = matrix(rows, cols);
        let x = vec![1.0f32; cols];
        for format in [Format::Bf16, Format::F16] {
            let t = PackedTensor::quantize(format, rows, cols, &values).unwrap();
            let mut y = vec![0.0f32; rows];
            dot_rows(&t, 0, &x, &mut y);
            let mut row = vec![0.0f32; cols];
            for (i, y) in y.iter().enumerate() {
                t.dequantize_row(i, &mut row);
                let want: f32 = row.iter().sum();
                assert!((y - want).abs() < 1e-3, "{} row {i}", format.name());
            }
        }
    }
}
