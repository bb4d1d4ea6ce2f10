//! How a weight matrix is held for inference: the formats, their byte layouts (ggml's, so a
//! GGUF file's blocks are held as they are read) and the reference conversions to and from
//! `f32` that the kernels are tested against.
//!
//! Invariants: a [`PackedTensor`] holds `rows` rows of `cols` values, each row `row_bytes`
//! contiguous bytes (rows never share a block: `cols` is a whole number of blocks, checked at
//! construction); dequantising a block here gives what `gguf.quants.dequantize` gives, bit
//! for bit (the pretrained crate's tests check it against golden files).

use half::{bf16, f16};

/// A held format: 16-bit floats, or ggml's blocks of 32 values with a 16-bit scale (`Q8_0`:
/// 8-bit values; `Q4_0`: 4-bit values less 8; `Q4_1`: 4-bit values and a 16-bit minimum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// IEEE half precision.
    F16,
    /// bfloat16: f32's exponent, 7 bits of mantissa.
    Bf16,
    /// Blocks of 32: an f16 scale `d`, 32 signed bytes `q`; a value is `d·q`.
    Q8_0,
    /// Blocks of 32: an f16 scale `d`, 16 bytes of nibbles; a value is `d·(q − 8)`.
    Q4_0,
    /// Blocks of 32: f16 scale `d` and minimum `m`, 16 bytes of nibbles; a value is `d·q + m`.
    Q4_1,
}

impl Format {
    /// Every format, in the order the documentation lists them.
    pub const ALL: [Format; 5] = [
        Format::F16,
        Format::Bf16,
        Format::Q8_0,
        Format::Q4_0,
        Format::Q4_1,
    ];

    /// Values a block holds.
    pub fn block(self) -> usize {
        match self {
            Format::F16 | Format::Bf16 => 1,
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => 32,
        }
    }

    /// Bytes a block takes.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F16 | Format::Bf16 => 2,
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
        }
    }

    /// Bytes a row of `cols` values takes, or `None` when `cols` is not whole blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        cols.is_multiple_of(self.block())
            .then(|| cols / self.block() * self.block_bytes())
    }

    /// ggml's name (`q8_0`, `bf16`, …), as `--weights-dtype` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Q8_0 => "q8_0",
            Format::Q4_0 => "q4_0",
            Format::Q4_1 => "q4_1",
        }
    }
}

/// A matrix of `rows × cols` values held in `format`, row after row (or in the stored order
/// [`PackedTensor::with_row_order`] gives).
#[derive(Clone, Debug)]
pub struct PackedTensor {
    format: Format,
    rows: usize,
    cols: usize,
    bytes: Held,
    /// Row `i`'s place among the stored rows, where they lie in another order (llama.cpp's
    /// interleaved query and key rows, read where the file holds them rather than copied).
    order: Option<std::sync::Arc<[u32]>>,
}

/// A buffer that tensors read ranges of (a mapped file: its pages are the tensors' memory).
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A tensor's bytes: its own, or a range of a buffer it shares.
#[derive(Clone)]
enum Held {
    Owned(Vec<u8>),
    Shared {
        owner: SharedBytes,
        start: usize,
        len: usize,
    },
}

impl Held {
    fn as_slice(&self) -> &[u8] {
        match self {
            Held::Owned(v) => v,
            Held::Shared { owner, start, len } => &(**owner).as_ref()[*start..*start + *len],
        }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Owned(v) => write!(f, "{} bytes", v.len()),
            Held::Shared { start, len, .. } => {
                write!(f, "bytes {start}..{} of a shared buffer", start + len)
            }
        }
    }
}

impl PackedTensor {
    /// The matrix whose rows are `bytes` in `format`; refused (saying why) when `cols` is not
    /// whole blocks or `bytes` is not `rows` rows.
    pub fn new(format: Format, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self, String> {
        Self::checked_len(format, rows, cols, bytes.len())?;
        Ok(Self {
            format,
            rows,
            cols,
            bytes: Held::Owned(bytes),
            order: None,
        })
    }

    /// The matrix whose rows are the bytes of `owner` from `start` on, in `format`, read where
    /// they lie (a mapped file's pages, shared with the cache and with other tensors); refused
    /// (saying why) when `cols` is not whole blocks or the rows run past the buffer.
    pub fn view(
        format: Format,
        rows: usize,
        cols: usize,
        owner: SharedBytes,
        start: usize,
    ) -> Result<Self, String> {
        let len = Self::checked_len(format, rows, cols, usize::MAX)?;
        let available = (*owner).as_ref().len().saturating_sub(start);
        if len > available {
            return Err(format!(
                "{rows} rows of {cols} {} values take {len} bytes; {available} lie from {start} on",
                format.name()
            ));
        }
        Ok(Self {
            format,
            rows,
            cols,
            bytes: Held::Shared { owner, start, len },
            order: None,
        })
    }

    /// The same stored rows read in another order: row `i` is stored row `order[i]`; refused
    /// (saying why) unless `order` is a permutation of the rows.
    pub fn with_row_order(mut self, order: Vec<u32>) -> Result<Self, String> {
        let mut seen = vec![false; self.rows];
        let permutation = order.len() == self.rows
            && order.iter().all(|&r| {
                let fresh = seen.get(r as usize).is_some_and(|s| !s);
                if fresh {
                    seen[r as usize] = true;
                }
                fresh
            });
        if !permutation {
            return Err(format!(
                "a row order of {} entries is not a permutation of {} rows",
                order.len(),
                self.rows
            ));
        }
        self.order = Some(order.into());
        Ok(self)
    }

    /// The bytes `rows × cols` values of `format` take, checked against `given` (`usize::MAX`:
    /// anything).
    fn checked_len(
        format: Format,
        rows: usize,
        cols: usize,
        given: usize,
    ) -> Result<usize, String> {
        let row = format.row_bytes(cols).ok_or_else(|| {
            format!(
                "{cols} columns are not whole {}-value blocks of {}",
                format.block(),
                format.name()
            )
        })?;
        let len = row
            .checked_mul(rows)
            .ok_or_else(|| format!("{rows} rows of {row} bytes overflow"))?;
        if given != usize::MAX && given != len {
            return Err(format!(
                "{given} bytes for {rows} rows of {cols} {} values ({row} bytes a row)",
                format.name()
            ));
        }
        Ok(len)
    }

    /// `values` (`rows × cols`, row-major) converted to `format`: 16-bit floats rounded to
    /// nearest even, `Q8_0` as ggml's reference quantiser rounds; `None` for the 4-bit formats
    /// (only read from files) or when `cols` is not whole blocks.
    pub fn quantize(format: Format, rows: usize, cols: usize, values: &[f32]) -> Option<Self> {
        assert_eq!(
            values.len(),
            rows * cols,
            "quantize: values for rows × cols"
        );
        format.row_bytes(cols)?;
        let bytes: Vec<u8> = match format {
            Format::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            Format::Bf16 => values.iter().flat_map(|v| bf16_bits(*v)).collect(),
            Format::Q8_0 => values.chunks_exact(32).flat_map(quantize_q8_0).collect(),
            Format::Q4_0 | Format::Q4_1 => return None,
        };
        Some(Self::new(format, rows, cols, bytes).expect("whole rows"))
    }

    /// How the values are held.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values a row holds (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The bytes held, in the stored order of the rows.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes().len() / self.rows.max(1)
    }

    /// Row `i`'s bytes.
    pub fn row(&self, i: usize) -> &[u8] {
        let n = self.row_bytes();
        let at = self.order.as_ref().map_or(i, |o| o[i] as usize);
        &self.bytes()[at * n..(at + 1) * n]
    }

    /// Whether the rows lie in the stored order (no [`PackedTensor::with_row_order`]).
    pub(super) fn rows_in_stored_order(&self) -> bool {
        self.order.is_none()
    }
}

/// `v` as bfloat16, as ggml rounds it (nearest even; a NaN kept quiet).
pub fn bf16_bits(v: f32) -> [u8; 2] {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return (((bits >> 16) | 64) as u16).to_le_bytes();
    }
    bf16::from_bits(((u64::from(bits) + 0x7fff + u64::from((bits >> 16) & 1)) >> 16) as u16)
        .to_le_bytes()
}

/// One block of 32 values as ggml's reference quantises `Q8_0`: the scale `max|v| / 127` as
/// f16, each value over it rounded half away from zero.
pub fn quantize_q8_0(block: &[f32]) -> [u8; 34] {
    let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let mut out = [0u8; 34];
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(block) {
        *o = (v * id).round() as i8 as u8;
    }
    out
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// `raw` (whole blocks of `format`) as `f32` into `out` (as many values): the reference the
/// kernels are checked against.
///
/// # Panics
/// If `raw` and `out` are not the same number of values.
pub fn dequantize(format: Format, raw: &[u8], out: &mut [f32]) {
    let (block, size) = (format.block(), format.block_bytes());
    assert_eq!(raw.len() / size * block, out.len(), "whole blocks");
    let blocks = raw.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match format {
        Format::F16 => blocks.for_each(|(b, o)| o[0] = half_at(b, 0)),
        Format::Bf16 => blocks.for_each(|(b, o)| o[0] = bf16::from_le_bytes([b[0], b[1]]).into()),
        Format::Q8_0 => blocks.for_each(|(b, o)| {
            let d = half_at(b, 0);
            for (y, q) in o.iter_mut().zip(&b[2..34]) {
                *y = f32::from(*q as i8) * d;
            }
        }),
        Format::Q4_0 => blocks.for_each(|(b, o)| {
            let d = half_at(b, 0);
            for (j, q) in b[2..18].iter().enumerate() {
                o[j] = d * f32::from((q & 0x0F) as i8 - 8);
                o[j + 16] = d * f32::from((q >> 4) as i8 - 8);
            }
        }),
        Format::Q4_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (half_at(b, 0), half_at(b, 2));
            for (j, q) in b[4..20].iter().enumerate() {
                o[j] = d * f32::from(q & 0x0F) + m;
                o[j + 16] = d * f32::from(q >> 4) + m;
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_another_order_read_and_multiply_as_a_reordered_copy() {
        let (rows, cols) = (6, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| (i % 37) as f32 * 0.1 - 1.5)
            .collect();
        let stored = PackedTensor::quantize(Format::Q8_0, rows, cols, &values).unwrap();
        let order = vec![3u32, 0, 5, 1, 4, 2];
        let copy: Vec<u8> = order
            .iter()
            .flat_map(|&r| stored.row(r as usize).to_vec())
            .collect();
        let copy = PackedTensor::new(Format::Q8_0, rows, cols, copy).unwrap();
        let reordered = stored.clone().with_row_order(order).unwrap();
        let (mut a, mut b) = (vec![0.0; 4 * cols], vec![0.0; 4 * cols]);
        reordered.dequantize_rows(1..5, &mut a);
        copy.dequantize_rows(1..5, &mut b);
        assert_eq!(a, b);
        for i in 0..rows {
            assert_eq!(reordered.row(i), copy.row(i), "row {i}");
        }
        for bad in [
            vec![0u32, 1, 2],
            vec![0, 1, 2, 3, 4, 4],
            vec![0, 1, 2, 3, 4, 6],
        ] {
            let refused = stored.clone().with_row_order(bad.clone()).unwrap_err();
            assert!(refused.contains("not a permutation"), "{bad:?}: {refused}");
        }
    }
}
