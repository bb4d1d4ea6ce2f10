//! GGML's tensor types and their dequantisation to f32, written after ggml's reference
//! `dequantize_row_*` (ggml-quants.c) with the arithmetic in the same order as the `gguf`
//! package's numpy versions, so the values are equal bit for bit (each product and sum rounded
//! to f32 as there; no fused multiply–add).
//!
//! Layouts (little-endian, one block after another): Q8_0 `d: f16, q: [i8; 32]`; Q4_0
//! `d, q: [u8; 16]` (element j the low nibble of byte j, element j + 16 its high nibble, minus
//! 8); Q4_1 `d, m, q`; Q5_0 `d, qh: u32, q` (bit j of `qh` is element j's fifth bit, minus
//! 16); Q5_1 `d, m, qh, q`; the K-quants group 256 elements into sub-blocks with 6-bit
//! scales and minimums (Q4_K, Q5_K), 8-bit scales (Q6_K) or one f32 scale (Q8_K).

use half::f16;
use ringtmp_model::packed::{self, Format};

/// A tensor's element type, with GGML's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// Blocks of 32: f16 scale, 8-bit values.
    Q8_0,
    /// Blocks of 32: f16 scale, 4-bit values.
    Q4_0,
    /// Blocks of 32: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// Blocks of 32: f16 scale, 5-bit values.
    Q5_0,
    /// Blocks of 32: f16 scale and minimum, 5-bit values.
    Q5_1,
    /// Super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4K,
    /// Super-blocks of 256: as Q4_K with a fifth bit per value.
    Q5K,
    /// Super-blocks of 256: 16 sub-blocks with 8-bit scales, 6-bit values.
    Q6K,
    /// Super-blocks of 256: f32 scale, 8-bit values (and sums ggml's dot products use).
    Q8K,
    /// A type GGML defines that ringtmp does not dequantise (its id, name, block and size).
    Other {
        /// GGML's id.
        id: u32,
        /// GGML's name.
        name: &'static str,
        /// Elements per block.
        block: u64,
        /// Bytes per block.
        size: u64,
    },
    /// An id GGML does not define.
    Unknown(u32),
}

/// GGML's types ringtmp reads the table of but does not dequantise: (id, name, block, bytes).
const OTHERS: &[(u32, &str, u64, u64)] = &[
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl TensorType {
    /// The type of GGML id `id`.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::Bf16,
            _ => match OTHERS.iter().find(|o| o.0 == id) {
                Some(&(id, name, block, size)) => Self::Other {
                    id,
                    name,
                    block,
                    size,
                },
                None => Self::Unknown(id),
            },
        }
    }

    /// GGML's id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::Bf16 => 30,
            Self::Other { id, .. } | Self::Unknown(id) => id,
        }
    }

    /// GGML's name (`Q4_K`).
    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::Bf16 => "BF16".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q4K => "Q4_K".into(),
            Self::Q5K => "Q5_K".into(),
            Self::Q6K => "Q6_K".into(),
            Self::Q8K => "Q8_K".into(),
            Self::Other { name, .. } => name.into(),
            Self::Unknown(id) => format!("unknown type {id}"),
        }
    }

    /// Elements per block and bytes per block (`None` for an unknown id).
    fn block(self) -> Option<(u64, u64)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q8_0 => (32, 34),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::Q8K => (256, 292),
            Self::Other { block, size, .. } => (block, size),
            Self::Unknown(_) => return None,
        })
    }

    /// Elements per block (1 for an unknown id).
    pub fn block_elements(self) -> u64 {
        self.block().map_or(1, |b| b.0)
    }

    /// The bytes of `elements` elements in rows of `row` (rows must be whole blocks, as ggml
    /// requires); `None` if they are not, the type is unknown, or the size overflows.
    pub fn bytes_for(self, row: u64, elements: u64) -> Option<u64> {
        let (block, size) = self.block()?;
        (row.is_multiple_of(block) && elements.is_multiple_of(block))
            .then(|| (elements / block).checked_mul(size))
            .flatten()
    }

    /// Whether the reader dequantises this type ([`super::Gguf::dequantize`]).
    pub fn dequantizes(self) -> bool {
        !matches!(self, Self::Other { .. } | Self::Unknown(_))
    }
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantises `raw` (whole blocks of `kind`, as [`TensorType::bytes_for`] checked) into `out`
/// (its elements). A type that does not [`TensorType::dequantizes`] is the caller's to refuse.
///
/// # Panics
/// If `raw` and `out` are not the same number of elements of `kind`, or `kind` is not read.
pub fn dequantize(kind: TensorType, raw: &[u8], out: &mut [f32]) {
    let (block, size) = kind.block().expect("a known type");
    assert_eq!(
        raw.len() as u64 / size * block,
        out.len() as u64,
        "whole blocks"
    );
    let blocks = raw
        .chunks_exact(size as usize)
        .zip(out.chunks_exact_mut(block as usize));
    match kind {
        TensorType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        TensorType::F16 => packed::dequantize(Format::F16, raw, out),
        TensorType::Bf16 => packed::dequantize(Format::Bf16, raw, out),
        TensorType::Q8_0 => packed::dequantize(Format::Q8_0, raw, out),
        TensorType::Q4_0 => packed::dequantize(Format::Q4_0, raw, out),
        TensorType::Q4_1 => packed::dequantize(Format::Q4_1, raw, out),
        TensorType::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
        TensorType::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
        TensorType::Q4K => blocks.for_each(|(b, o)| q4_k(b, o)),
        TensorType::Q5K => blocks.for_each(|(b, o)| q5_k(b, o)),
        TensorType::Q6K => blocks.for_each(|(b, o)| q6_k(b, o)),
        TensorType::Q8K => blocks.for_each(|(b, o)| q8_k(b, o)),
        TensorType::Other { .. } | TensorType::Unknown(_) => {
            panic!("{} is not dequantised", kind.name())
        }
    }
}

/// The fifth bits of a Q5 block: bit j for element j.
fn fifth_bits(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let qh = fifth_bits(b, 2);
    for (j, q) in b[6..22].iter().enumerate() {
        let lo = (q & 0x0F) | (((qh >> j) & 1) as u8) << 4;
        let hi = (q >> 4) | (((qh >> (j + 16)) & 1) as u8) << 4;
        o[j] = d * f32::from(lo as i8 - 16);
        o[j + 16] = d * f32::from(hi as i8 - 16);
    }
}

fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = fifth_bits(b, 4);
    for (j, q) in b[8..24].iter().enumerate() {
        let lo = (q & 0x0F) | (((qh >> j) & 1) as u8) << 4;
        let hi = (q >> 4) | (((qh >> (j + 16)) & 1) as u8) << 4;
        o[j] = d * f32::from(lo) + m;
        o[j + 16] = d * f32::from(hi) + m;
    }
}

/// Q4_K's and Q5_K's 8 sub-blocks' 6-bit scales and minimums from their 12 packed bytes.
fn scales_and_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (sc, mn) = scales_and_mins(&b[4..16]);
    let qs = &b[16..144];
    for sub in 0..8 {
        let (scale, min) = (d * f32::from(sc[sub]), dmin * f32::from(mn[sub]));
        let (bytes, shift) = (&qs[32 * (sub / 2)..32 * (sub / 2) + 32], 4 * (sub % 2));
        for (t, q) in bytes.iter().enumerate() {
            o[32 * sub + t] = scale * f32::from((q >> shift) & 0x0F) - min;
        }
    }
}

fn q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (sc, mn) = scales_and_mins(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for sub in 0..8 {
        let (scale, min) = (d * f32::from(sc[sub]), dmin * f32::from(mn[sub]));
        let (bytes, shift) = (&qs[32 * (sub / 2)..32 * (sub / 2) + 32], 4 * (sub % 2));
        for (t, q) in bytes.iter().enumerate() {
            let v = ((q >> shift) & 0x0F) | ((qh[t] >> sub) & 1) << 4;
            o[32 * sub + t] = scale * f32::from(v) - min;
        }
    }
}

fn q6_k(b: &[u8], o: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for half_block in 0..2 {
        for k in 0..4 {
            for t in 0..32 {
                let e = 128 * half_block + 32 * k + t;
                let low = (ql[64 * half_block + 32 * (k % 2) + t] >> (4 * (k / 2))) & 0x0F;
                let high = (qh[32 * half_block + t] >> (2 * k)) & 0x03;
                let q = (low | high << 4) as i8 - 32;
                let scale = d * f32::from(scales[e / 16] as i8);
                o[e] = scale * f32::from(q);
            }
        }
    }
}

fn q8_k(b: &[u8], o: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, q) in o.iter_mut().zip(&b[4..260]) {
        *y = d * f32::from(*q as i8);
    }
}
