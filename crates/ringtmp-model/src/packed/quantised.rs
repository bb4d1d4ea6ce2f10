//! Matrix–vector products of 8- and 4-bit blocks (`Q8_0`, `Q4_0`, `Q4_1`) with the vector
//! quantised as well and the block sums taken in integers: the vector ([`QuantisedX`]) is cut
//! in blocks of 32 values, each block `dx · q` with `dx` its largest magnitude over `L` and `q`
//! in `−L..=L`; a weight block `d · w` (`+ m` for `Q4_1`) then contributes `d · dx · Σ w·q`
//! (`+ m · Σx`, the block's exact sum). Two precisions ([`Precision`]): 16-bit values
//! (`L` = 32767; AVX-512 VNNI's `vpdpwssd`, 32 products an instruction), which move a product
//! by at most half a 32767th of its block's largest value a weight (SmolLM2's logits by a
//! two-thousandth of their range), and 8-bit ones (`L` = 127; `vpdpbusd`,
//! 64 an instruction), llama.cpp's, faster and 258 times coarser: enough to change a small
//! model's greedy answer. The portable version computes the same sums where the CPU has no
//! VNNI (the tests hold the two to each other).
//!
//! Invariants: a vector is whole blocks (`len % 32 == 0`); every weight block format read here
//! has 32 values; the 16-bit values of two neighbouring blocks are stored interleaved (see
//! [`q16_index`]).

use super::format::{Format, PackedTensor};

/// Values per block.
const BLOCK: usize = 32;

/// How finely a vector is quantised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 16-bit values (`q` in −32767..=32767).
    #[default]
    Int16,
    /// 8-bit values (`q` in −127..=127), as llama.cpp's `Q8_0`/`Q8_1` vectors.
    Int8,
}

impl Precision {
    /// The largest `q`.
    fn levels(self) -> f32 {
        match self {
            Precision::Int16 => 32767.0,
            Precision::Int8 => 127.0,
        }
    }
}

/// How a decoded vector meets 8- and 4-bit blocks in their products (`--activations`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// As `f32`, the blocks dequantised inside the loop ([`super::dot_rows`]).
    F32,
    /// Quantised to 16 bits, the sums in integers.
    Int16,
    /// Quantised to 8 bits, the sums in integers (llama.cpp's).
    Int8,
}

impl Activations {
    /// The names `--activations` takes.
    pub const NAMES: [&str; 3] = ["f32", "int16", "int8"];

    /// Parses a name of [`Self::NAMES`].
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "f32" => Ok(Self::F32),
            "int16" => Ok(Self::Int16),
            "int8" => Ok(Self::Int8),
            other => Err(format!(
                "{other:?} is not one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// What this CPU computes fastest without changing a model's answers: 16-bit integers
    /// where it has AVX-512 VNNI, else `f32`.
    pub fn default_for_cpu() -> Self {
        if fast() { Self::Int16 } else { Self::F32 }
    }

    /// The vector's quantisation, `None` for `f32`.
    pub fn precision(self) -> Option<Precision> {
        match self {
            Self::F32 => None,
            Self::Int16 => Some(Precision::Int16),
            Self::Int8 => Some(Precision::Int8),
        }
    }
}

/// Where value `j` of block `b` (of `blocks`) lies among the 16-bit values: two neighbouring
/// blocks `a`, `b` as `a[..16], b[..16], a[16..], b[16..]` (each half of a pair one vector of
/// the kernel, lanes 0..8 summing `a` and 8..16 `b`); a last block without a neighbour as is.
pub fn q16_index(b: usize, j: usize, blocks: usize) -> usize {
    if b == blocks - 1 && blocks % 2 == 1 {
        return b * BLOCK + j;
    }
    let (pair, second) = (b / 2, b % 2);
    pair * 2 * BLOCK + (j / 16) * BLOCK + second * 16 + j % 16
}

/// A vector quantised in blocks of 32, with what each format's sums need.
#[derive(Clone, Debug, Default)]
pub struct QuantisedX {
    precision: Precision,
    blocks: usize,
    /// The 8-bit values (in order), for [`Precision::Int8`].
    q8: Vec<i8>,
    /// The 16-bit values (pairs of blocks interleaved), for [`Precision::Int16`].
    q16: Vec<i16>,
    /// Per block: its scale `dx` and the exact sum of its values.
    ds: Vec<f32>,
    /// 8-bit: per 4 values, −128 × their sum (`Q8_0`'s weights read as unsigned, `w + 128`).
    corr_q8: Vec<i32>,
    /// Per kernel lane: −8 × the sum of the values it multiplies (`Q4_0`'s weights are
    /// `q − 8`): 8-bit, 4 values a lane; 16-bit, 4 values a lane over a pair's two vectors.
    corr_q4: Vec<i32>,
}

impl QuantisedX {
    /// Quantises `x` (whole blocks of 32) at `precision` into `self`, reusing its buffers.
    ///
    /// # Panics
    /// If `x` is not whole blocks.
    pub fn quantise(&mut self, x: &[f32], precision: Precision) {
        assert!(x.len().is_multiple_of(BLOCK), "{} values", x.len());
        let blocks = x.len() / BLOCK;
        self.precision = precision;
        self.blocks = blocks;
        self.q8.clear();
        self.q16.clear();
        self.ds.clear();
        self.corr_q8.clear();
        self.corr_q4.clear();
        let levels = precision.levels();
        let mut q = Vec::with_capacity(x.len());
        for block in x.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let inv = if amax > 0.0 { levels / amax } else { 0.0 };
            q.extend(
                block
                    .iter()
                    .map(|v| (v * inv).round().clamp(-levels, levels) as i32),
            );
            self.ds.push(amax / levels);
            self.ds.push(block.iter().sum());
        }
        match precision {
            Precision::Int8 => {
                self.q8.extend(q.iter().map(|&v| v as i8));
                for four in q.chunks_exact(4) {
                    let sum: i32 = four.iter().sum();
                    self.corr_q8.push(-128 * sum);
                    self.corr_q4.push(-8 * sum);
                }
            }
            Precision::Int16 => {
                self.q16.resize(x.len(), 0);
                for (i, &v) in q.iter().enumerate() {
                    self.q16[q16_index(i / BLOCK, i % BLOCK, blocks)] = v as i16;
                }
                // A lane of `vpdpwssd` multiplies two neighbouring values of each of a pair's
                // two vectors.
                for pair in self.q16.chunks_exact(2 * BLOCK).take(blocks / 2) {
                    for lane in 0..16 {
                        let (a, b) = (&pair[..BLOCK], &pair[BLOCK..]);
                        let sum: i32 = [a[2 * lane], a[2 * lane + 1], b[2 * lane], b[2 * lane + 1]]
                            .iter()
                            .map(|&v| i32::from(v))
                            .sum();
                        self.corr_q4.push(-8 * sum);
                    }
                }
            }
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.blocks * BLOCK
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// Value `j` of block `b`.
    fn q(&self, b: usize, j: usize) -> i32 {
        match self.precision {
            Precision::Int8 => i32::from(self.q8[b * BLOCK + j]),
            Precision::Int16 => i32::from(self.q16[q16_index(b, j, self.blocks)]),
        }
    }
}

/// Whether `format`'s products can take a quantised vector.
pub fn takes_int8(format: Format) -> bool {
    matches!(format, Format::Q8_0 | Format::Q4_0 | Format::Q4_1)
}

/// `y[k] = row (first + k) · x` for every `k` of `y`, `x` quantised.
///
/// # Panics
/// If the format takes no quantised vector, `x` is not `cols` values or the rows run past the
/// matrix.
pub fn dot_rows_int8(t: &PackedTensor, first: usize, x: &QuantisedX, y: &mut [f32]) {
    assert!(
        takes_int8(t.format()) && x.len() == t.cols() && first + y.len() <= t.rows(),
        "dot_rows_int8: {} for {} values, {} columns, rows {first}..{} of {}",
        t.format().name(),
        x.len(),
        t.cols(),
        first + y.len(),
        t.rows()
    );
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    if fast() {
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and F16C (checked); the sizes were checked.
        unsafe { x86::dot_rows(t, first, x, y) };
        return;
    }
    portable(t, first, x, y);
}

/// Whether this CPU runs the integer products at their full speed (AVX-512 VNNI).
pub fn fast() -> bool {
    super::cpu::vnni()
}

/// The f16 at `p` as f32.
fn f16_at(p: &[u8]) -> f32 {
    half::f16::from_le_bytes([p[0], p[1]]).to_f32()
}

/// Block `b` of `row` against block `b` of `x`.
fn block_product(format: Format, row: &[u8], x: &QuantisedX, b: usize) -> f32 {
    let size = format.block_bytes();
    let block = &row[b * size..(b + 1) * size];
    let (dx, sx) = (x.ds[2 * b], x.ds[2 * b + 1]);
    let d = f16_at(block);
    let nibble = |j: usize, bytes: &[u8]| -> i32 {
        if j < 16 {
            i32::from(bytes[j] & 0x0F)
        } else {
            i32::from(bytes[j - 16] >> 4)
        }
    };
    // Integer sums: exact, whichever order.
    let sum = |w: &dyn Fn(usize) -> i32| -> i64 {
        (0..BLOCK)
            .map(|j| i64::from(w(j)) * i64::from(x.q(b, j)))
            .sum()
    };
    match format {
        Format::Q8_0 => d * dx * sum(&|j| i32::from(block[2 + j] as i8)) as f32,
        Format::Q4_0 => d * dx * sum(&|j| nibble(j, &block[2..]) - 8) as f32,
        Format::Q4_1 => d * dx * sum(&|j| nibble(j, &block[4..])) as f32 + f16_at(&block[2..]) * sx,
        other => unreachable!("{} takes no quantised vector", other.name()),
    }
}

fn portable(t: &PackedTensor, first: usize, x: &QuantisedX, y: &mut [f32]) {
    let blocks = t.cols() / BLOCK;
    for (k, out) in y.iter_mut().enumerate() {
        let row = t.row(first + k);
        *out = (0..blocks)
            .map(|b| block_product(t.format(), row, x, b))
            .sum();
    }
}

#[cfg(all(target_arch = "x86_64", feature = "avx512"))]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, Precision, QuantisedX, block_product};
    use crate::packed::format::{Format, PackedTensor};

    /// Bytes ahead of the one read that the loop asks the cache for.
    const AHEAD: usize = 1024;

    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn dot_rows(t: &PackedTensor, first: usize, x: &QuantisedX, y: &mut [f32]) {
        let format = t.format();
        let blocks = t.cols() / BLOCK;
        let sixteen = x.precision == Precision::Int16;
        for (k, out) in y.iter_mut().enumerate() {
            let row = t.row(first + k).as_ptr();
            let n = blocks / 2;
            // SAFETY (every arm): `row` is `blocks` whole blocks of the format and `x` holds
            // `blocks` blocks (checked by the caller).
            let mut sum = unsafe {
                match (format, sixteen) {
                    (Format::Q8_0, false) => pairs8::<Q8_0>(row, x, n),
                    (Format::Q4_0, false) => pairs8::<Q4_0>(row, x, n),
                    (Format::Q4_1, false) => pairs8::<Q4_1>(row, x, n),
                    (Format::Q8_0, true) => pairs16::<Q8_0>(row, x, n),
                    (Format::Q4_0, true) => pairs16::<Q4_0>(row, x, n),
                    (Format::Q4_1, true) => pairs16::<Q4_1>(row, x, n),
                    (other, _) => unreachable!("{}", other.name()),
                }
            };
            if blocks % 2 == 1 {
                sum += block_product(format, t.row(first + k), x, blocks - 1);
            }
            *out = sum;
        }
    }

    /// Bytes of a block of format `F`.
    const fn size<const F: u8>() -> usize {
        match F {
            Q8_0 => 34,
            Q4_0 => 18,
            _ => 20,
        }
    }

    /// Two blocks' scales times the vector's: `[d0·dx0, m0·Σx0, d1·dx1, m1·Σx1]` (the `m`
    /// lanes meaningful for `Q4_1` only), from the blocks at `p0`, `p1` and pair `pair`.
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8, ds: *const f32, pair: usize) -> __m128 {
        unsafe {
            let heads = _mm_unpacklo_epi32(
                _mm_cvtsi32_si128(p0.cast::<i32>().read_unaligned()),
                _mm_cvtsi32_si128(p1.cast::<i32>().read_unaligned()),
            );
            _mm_mul_ps(_mm_cvtph_ps(heads), _mm_loadu_ps(ds.add(pair * 4)))
        }
    }

    /// The nibbles of the 4-bit blocks at `p0` and `p1` as bytes: `[a_lo, b_lo]` (each
    /// block's values 0..16) and `[a_hi, b_hi]` (16..32).
    #[inline(always)]
    unsafe fn nibbles<const F: u8>(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        unsafe {
            let head = if F == Q4_0 { 2 } else { 4 };
            let low = _mm256_set1_epi8(0x0F);
            let a = _mm_loadu_si128(p0.add(head).cast());
            let b = _mm_loadu_si128(p1.add(head).cast());
            let both = _mm256_set_m128i(b, a);
            (
                _mm256_and_si256(both, low),
                _mm256_and_si256(_mm256_srli_epi16::<4>(both), low),
            )
        }
    }

    /// Two blocks' integer sums `dot` (lanes 0..8 the first's, 8..16 the second's) scaled by
    /// their `d · dx` from `prod` ([`scales`]) into `acc`; `Q4_1`'s `m · Σx` into `mins`.
    #[inline(always)]
    unsafe fn add_scaled<const F: u8>(
        dot: __m512i,
        prod: __m128,
        acc: &mut __m512,
        mins: &mut __m128,
    ) {
        unsafe {
            if F == Q4_1 {
                *mins = _mm_add_ps(*mins, prod);
            }
            let pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
            let scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(prod));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
        }
    }

    /// The sum of `acc`'s lanes, and for `Q4_1` the `m · Σx` lanes of `mins`.
    #[inline(always)]
    unsafe fn total<const F: u8>(acc: __m512, mins: __m128) -> f32 {
        unsafe {
            let mut sum = _mm512_reduce_add_ps(acc);
            if F == Q4_1 {
                let mut m = [0.0f32; 4];
                _mm_storeu_ps(m.as_mut_ptr(), mins);
                sum += m[1] + m[3];
            }
            sum
        }
    }

    /// The first `2 · pairs` blocks of `row` against `x`'s 8-bit values, two blocks (64
    /// products) an iteration: the weights as 64 unsigned bytes in order (`Q8_0`'s `w + 128`,
    /// the 4-bit formats' nibbles), one `vpdpbusd` from the format's correction, the sums
    /// scaled by `d · dx` (lanes 0..8 the first block's, 8..16 the second's).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    unsafe fn pairs8<const F: u8>(row: *const u8, x: &QuantisedX, pairs: usize) -> f32 {
        unsafe {
            let size = size::<F>();
            let flip = _mm512_set1_epi8(-128);
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm_setzero_ps());
            let (q, ds) = (x.q8.as_ptr(), x.ds.as_ptr());
            let corr = if F == Q8_0 {
                x.corr_q8.as_ptr()
            } else {
                x.corr_q4.as_ptr()
            };
            for pair in 0..pairs {
                let p0 = row.add(2 * pair * size);
                let p1 = p0.add(size);
                _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(AHEAD).cast());
                let w = if F == Q8_0 {
                    let a = _mm256_loadu_si256(p0.add(2).cast());
                    let b = _mm256_loadu_si256(p1.add(2).cast());
                    _mm512_xor_si512(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b), flip)
                } else {
                    let (lo, hi) = nibbles::<F>(p0, p1);
                    // [a_lo, b_lo, a_hi, b_hi] → [a_lo, a_hi, b_lo, b_hi]: values in order.
                    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                    _mm512_shuffle_i64x2::<0b11_01_10_00>(v, v)
                };
                let xq = _mm512_loadu_si512(q.add(pair * 64).cast());
                let init = if F == Q4_1 {
                    _mm512_setzero_si512()
                } else {
                    _mm512_loadu_si512(corr.add(pair * 16).cast())
                };
                let dot = _mm512_dpbusd_epi32(init, w, xq);
                add_scaled::<F>(dot, scales(p0, p1, ds, pair), &mut acc, &mut mins);
            }
            total::<F>(acc, mins)
        }
    }

    /// The first `2 · pairs` blocks of `row` against `x`'s 16-bit values, two blocks an
    /// iteration: each block's first halves (then second halves) widened to 16 bits side by
    /// side — `Q8_0`'s signed bytes, the nibbles — two `vpdpwssd` (`Q4_0`'s `− 8` from the
    /// correction), the sums scaled by `d · dx` (lanes 0..8 the first block's, 8..16 the
    /// second's).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    unsafe fn pairs16<const F: u8>(row: *const u8, x: &QuantisedX, pairs: usize) -> f32 {
        unsafe {
            let size = size::<F>();
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm_setzero_ps());
            let (q, ds, corr) = (x.q16.as_ptr(), x.ds.as_ptr(), x.corr_q4.as_ptr());
            for pair in 0..pairs {
                let p0 = row.add(2 * pair * size);
                let p1 = p0.add(size);
                _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(AHEAD).cast());
                let (first, second) = if F == Q8_0 {
                    let a = _mm256_loadu_si256(p0.add(2).cast());
                    let b = _mm256_loadu_si256(p1.add(2).cast());
                    // [a[..16], b[..16]] and [a[16..], b[16..]], widened with their signs.
                    let lo = _mm256_permute2x128_si256::<0x20>(a, b);
                    let hi = _mm256_permute2x128_si256::<0x31>(a, b);
                    (_mm512_cvtepi8_epi16(lo), _mm512_cvtepi8_epi16(hi))
                } else {
                    let (lo, hi) = nibbles::<F>(p0, p1);
                    (_mm512_cvtepu8_epi16(lo), _mm512_cvtepu8_epi16(hi))
                };
                let init = if F == Q4_0 {
                    _mm512_loadu_si512(corr.add(pair * 16).cast())
                } else {
                    _mm512_setzero_si512()
                };
                let x0 = _mm512_loadu_si512(q.add(pair * 64).cast());
                let x1 = _mm512_loadu_si512(q.add(pair * 64 + 32).cast());
                let dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(init, first, x0), second, x1);
                add_scaled::<F>(dot, scales(p0, p1, ds, pair), &mut acc, &mut mins);
            }
            total::<F>(acc, mins)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919 % 1009) as f32 / 1009.0 - 0.5) * (1.0 + (i % 7) as f32))
            .collect()
    }

    /// Random bytes as blocks of `format` with finite, moderate scales.
    fn random_blocks(format: Format, rows: usize, cols: usize) -> PackedTensor {
        let size = format.block_bytes();
        let n = rows * cols / BLOCK;
        let mut bytes: Vec<u8> = (0..n * size)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for (b, block) in bytes.chunks_exact_mut(size).enumerate() {
            let d = half::f16::from_f32(0.01 + (b % 5) as f32 * 0.003).to_le_bytes();
            block[..2].copy_from_slice(&d);
            if format == Format::Q4_1 {
                let m = half::f16::from_f32(-0.05 - (b % 3) as f32 * 0.01).to_le_bytes();
                block[2..4].copy_from_slice(&m);
            }
        }
        PackedTensor::new(format, rows, cols, bytes).unwrap()
    }

    /// The quantised vector's products, at both precisions: on this CPU's kernel equal to the
    /// portable sums (the integer sums exact, the scaled blocks summed in another order), and
    /// both within the quantisation's bound of the `f32` products: `Σ_blocks Σ|w| · dx/2`.
    #[test]
    fn integer_products_are_the_quantised_vectors_and_near_the_f32_ones() {
        for (cols, precision) in [64, 96, 576, 1568]
            .into_iter()
            .flat_map(|c| [(c, Precision::Int8), (c, Precision::Int16)])
        {
            let rows = 19;
            let x = values(cols, cols);
            let mut qx = QuantisedX::default();
            qx.quantise(&x, precision);
            for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
                let t = random_blocks(format, rows, cols);
                let (mut fast, mut plain) = (vec![0.0f32; rows - 2], vec![0.0f32; rows - 2]);
                dot_rows_int8(&t, 2, &qx, &mut fast);
                portable(&t, 2, &qx, &mut plain);
                let mut row = vec![0.0f32; cols];
                for k in 0..rows - 2 {
                    let scale = plain[k].abs().max(1.0);
                    assert!(
                        (fast[k] - plain[k]).abs() <= 1e-5 * scale,
                        "{} {precision:?} cols {cols} row {k}: {} against {}",
                        format.name(),
                        fast[k],
                        plain[k]
                    );
                    t.dequantize_row(k + 2, &mut row);
                    let exact: f64 = row.iter().zip(&x).map(|(w, x)| f64::from(w * x)).sum();
                    let bound: f64 = row
                        .chunks_exact(BLOCK)
                        .enumerate()
                        .map(|(b, w)| {
                            let wsum: f64 = w.iter().map(|v| f64::from(v.abs())).sum();
                            wsum * f64::from(qx.ds[2 * b]) / 2.0
                        })
                        .sum();
                    let err = (f64::from(plain[k]) - exact).abs();
                    assert!(
                        err <= bound * 1.001 + 1e-5,
                        "{} {precision:?} row {k}: {err} past {bound}",
                        format.name()
                    );
                }
            }
        }
    }

    #[test]
    fn a_zero_block_quantises_to_zeros_and_blocks_pair_up() {
        let mut qx = QuantisedX::default();
        let mut x = vec![0.0f32; 96];
        x[40] = 2.0;
        x[70] = -1.0;
        qx.quantise(&x, Precision::Int8);
        assert!(qx.q8[..32].iter().all(|&v| v == 0));
        assert_eq!((qx.q8[40], qx.q8[70]), (127, -127));
        assert_eq!(qx.ds[..4], [0.0, 0.0, 2.0 / 127.0, 2.0]);
        qx.quantise(&x, Precision::Int16);
        // Blocks 0 and 1 interleaved by halves; block 2, alone, as it is.
        assert_eq!(q16_index(1, 8, 3), 16 + 8);
        assert_eq!(q16_index(0, 20, 3), 32 + 4);
        assert_eq!(q16_index(2, 6, 3), 70);
        assert_eq!((qx.q16[16 + 8], qx.q16[70]), (32767, -32767));
        assert_eq!(qx.q(1, 8), 32767);
    }
}
