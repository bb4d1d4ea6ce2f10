//! One layer's weights held for inference ([`LayerWeights`]) and the products over them: the
//! layer's code asks for a vector or a matrix by the span it would read from the flat layout
//! ([`Params`]), so training's flat `f32` parameters and held weights share one code path.
//!
//! Invariants: a span asked as a vector lies inside one `f32` piece; a span asked as a matrix
//! is whole packed pieces and parts of `f32` ones; a packed piece may be shared (a tied head
//! and its embedding, `Arc`) and is counted once where bytes are summed.

use std::ops::Range;
use std::sync::Arc;

use super::dot::dot_rows;
use super::format::PackedTensor;
use super::panel::{self, Positions};
use super::quantised::{Precision, QuantisedX, dot_rows_int8, takes_int8};
use crate::kernels::{linear_forward, set_len};

/// How a tensor of a layer is held.
#[derive(Clone, Debug)]
pub enum Store {
    /// As `f32`.
    Dense(Vec<f32>),
    /// Packed (shared where a tied head reads its embedding's table).
    Packed(Arc<PackedTensor>),
}

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::Dense(v) => v.len(),
            Store::Packed(t) => t.rows() * t.cols(),
        }
    }
}

#[derive(Clone, Debug)]
struct Piece {
    /// Where the piece starts in the layer's flat layout.
    offset: usize,
    store: Store,
}

/// One layer's weights, tensor by tensor in its flat layout's order.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pieces: Vec<Piece>,
    len: usize,
    /// How products over its 8- and 4-bit blocks quantise the vector (`None`: they do not).
    quantised: Option<Precision>,
}

impl LayerWeights {
    /// A layer held in `f32`, its flat layout as a stage holds it.
    pub fn dense(values: Vec<f32>) -> Self {
        let len = values.len();
        Self {
            pieces: vec![Piece {
                offset: 0,
                store: Store::Dense(values),
            }],
            len,
            quantised: None,
        }
    }

    /// A layer from its tensors in `param_tensors` order (adjacent `f32` ones joined).
    pub fn from_tensors(tensors: Vec<Store>) -> Self {
        let mut pieces: Vec<Piece> = Vec::new();
        let mut len = 0;
        for store in tensors {
            let n = store.len();
            match (pieces.last_mut(), store) {
                (
                    Some(Piece {
                        store: Store::Dense(prev),
                        ..
                    }),
                    Store::Dense(values),
                ) => prev.extend_from_slice(&values),
                (_, store) => pieces.push(Piece { offset: len, store }),
            }
            len += n;
        }
        Self {
            pieces,
            len,
            quantised: None,
        }
    }

    /// How products over the layer's `Q8_0`, `Q4_0` and `Q4_1` blocks quantise the vector
    /// to sum in integers (`None`: they dequantise the blocks and sum in `f32`).
    pub fn set_quantised_activations(&mut self, precision: Option<Precision>) {
        self.quantised = precision;
    }

    /// Values the flat layout holds.
    pub fn param_count(&self) -> usize {
        self.len
    }

    /// The whole layer as `f32`, when nothing of it is packed.
    pub fn flat(&self) -> Option<&[f32]> {
        match &self.pieces[..] {
            [
                Piece {
                    store: Store::Dense(v),
                    ..
                },
            ] => Some(v),
            [] => Some(&[]),
            _ => None,
        }
    }

    /// The packed tensor starting at `offset`, if one does.
    pub fn packed_at(&self, offset: usize) -> Option<&Arc<PackedTensor>> {
        self.pieces.iter().find_map(|p| match &p.store {
            Store::Packed(t) if p.offset == offset => Some(t),
            _ => None,
        })
    }

    /// Bytes held, packed pieces in `seen` (by address) not counted again and added to it.
    pub(super) fn bytes(&self, seen: &mut Vec<*const PackedTensor>) -> usize {
        self.pieces
            .iter()
            .map(|p| match &p.store {
                Store::Dense(v) => 4 * v.len(),
                Store::Packed(t) if !seen.contains(&Arc::as_ptr(t)) => {
                    seen.push(Arc::as_ptr(t));
                    t.bytes().len()
                }
                Store::Packed(_) => 0,
            })
            .sum()
    }

    /// The values at `span` (`(offset, len)` of the flat layout), which lie in one `f32` piece.
    ///
    /// # Panics
    /// If they do not (the loader holds vectors in `f32`).
    pub fn vector(&self, (offset, len): (usize, usize)) -> &[f32] {
        if len == 0 {
            return &[];
        }
        for p in &self.pieces {
            if let Store::Dense(v) = &p.store
                && offset >= p.offset
                && offset + len <= p.offset + v.len()
            {
                return &v[offset - p.offset..offset - p.offset + len];
            }
        }
        panic!(
            "values {offset}..{} of a layer are not held as f32",
            offset + len
        )
    }

    /// The matrix at `span`, piece by piece.
    ///
    /// # Panics
    /// If a packed piece lies partly inside it.
    pub fn matrix(&self, (offset, len): (usize, usize)) -> Matrix<'_> {
        let end = offset + len;
        let mut segments = Vec::with_capacity(2);
        for p in &self.pieces {
            let (a, b) = (p.offset, p.offset + p.store.len());
            if b <= offset || a >= end {
                continue;
            }
            match &p.store {
                Store::Dense(v) => {
                    segments.push(Segment::Dense(&v[offset.max(a) - a..end.min(b) - a]));
                }
                Store::Packed(t) => {
                    assert!(
                        a >= offset && b <= end,
                        "a packed tensor at {a}..{b} lies partly in {offset}..{end}"
                    );
                    segments.push(Segment::Packed(t));
                }
            }
        }
        Matrix {
            segments,
            quantised: self.quantised,
        }
    }
}

/// A piece of a matrix: consecutive rows, held one way.
#[derive(Clone, Copy, Debug)]
pub enum Segment<'a> {
    /// Rows of `f32` values.
    Dense(&'a [f32]),
    /// A packed tensor's rows.
    Packed(&'a PackedTensor),
}

/// A weight matrix (`[out, in]`, row-major as PyTorch's `Linear` keeps it) as segments of rows.
#[derive(Clone, Debug)]
pub struct Matrix<'a> {
    segments: Vec<Segment<'a>>,
    /// How products of one vector quantise it for the blocks that take it.
    quantised: Option<Precision>,
}

impl<'a> Matrix<'a> {
    /// The matrix of the flat values `w`.
    pub fn dense(w: &'a [f32]) -> Self {
        Self {
            segments: vec![Segment::Dense(w)],
            quantised: None,
        }
    }

    /// Row `i` (of `cols` values) as `f32` into `out`.
    pub fn row(&self, mut i: usize, cols: usize, out: &mut [f32]) {
        for s in &self.segments {
            let rows = Self::rows_of(s, cols);
            if i < rows {
                match s {
                    Segment::Dense(w) => out.copy_from_slice(&w[i * cols..(i + 1) * cols]),
                    Segment::Packed(t) => t.dequantize_row(i, out),
                }
                return;
            }
            i -= rows;
        }
        panic!("row past the matrix's end");
    }

    /// The rows (`cols` values each) of each segment.
    fn rows_of(segment: &Segment<'_>, cols: usize) -> usize {
        match segment {
            Segment::Dense(w) => w.len() / cols.max(1),
            Segment::Packed(t) => t.rows(),
        }
    }
}

/// One layer's parameters as the layer's code reads them: the flat layout a [`crate::Stage`]
/// holds, or held weights.
#[derive(Clone, Copy, Debug)]
pub enum Params<'a> {
    /// A training stage's layer: its flat `f32` values.
    Flat(&'a [f32]),
    /// An inference stage's layer.
    Held(&'a LayerWeights),
}

impl<'a> Params<'a> {
    /// The values at `span` of the flat layout.
    pub fn vector(self, span: (usize, usize)) -> &'a [f32] {
        match self {
            Params::Flat(p) => &p[span.0..span.0 + span.1],
            Params::Held(w) => w.vector(span),
        }
    }

    /// The matrix at `span` of the flat layout.
    pub fn matrix(self, span: (usize, usize)) -> Matrix<'a> {
        match self {
            Params::Flat(p) => Matrix::dense(&p[span.0..span.0 + span.1]),
            Params::Held(w) => w.matrix(span),
        }
    }

    /// The whole flat layout, when nothing is packed.
    pub fn flat(self) -> Option<&'a [f32]> {
        match self {
            Params::Flat(p) => Some(p),
            Params::Held(w) => w.flat(),
        }
    }
}

/// Positions of decoding up to which a packed product runs row by row (each row reads every
/// weight); more rows dequantise the matrix once, a slice of rows at a time, for the GEMM.
const FEW_PACKED_ROWS: usize = 2;

/// `y = x·Wᵀ + bias` (`x`: `[m, k]`, `W`: `[n, k]`, `y`: `[m, n]`; `bias` empty for none), `W`
/// held as `w`'s segments. An all-`f32` matrix takes [`linear_forward`] as training does.
#[allow(clippy::too_many_arguments)]
pub fn matrix_forward(
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    w: &Matrix<'_>,
    bias: &[f32],
    threads: usize,
) {
    if let [Segment::Dense(w)] = w.segments[..] {
        linear_forward(y, m, n, k, x, w, bias, threads);
        return;
    }
    assert_eq!(
        w.segments
            .iter()
            .map(|s| Matrix::rows_of(s, k))
            .sum::<usize>(),
        n,
        "matrix_forward: rows of the segments"
    );
    if m <= FEW_PACKED_ROWS {
        for (x, y) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)).take(m) {
            matvec(&w.segments, k, x, y, threads, w.quantised);
        }
    } else {
        dequantised_gemm(y, m, n, k, x, &w.segments, threads);
    }
    if !bias.is_empty() {
        for row in y[..m * n].chunks_exact_mut(n) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
}

/// Output features a thread takes at least (fewer, and splitting costs more than it gains).
const MIN_ROWS_PER_TASK: usize = 64;

/// `y = W·x` over the segments, the output features split over `threads` (spinning workers:
/// a token runs hundreds of these back to back); with `quantised`, `x` quantised once for the
/// segments whose blocks take it.
fn matvec(
    segments: &[Segment<'_>],
    k: usize,
    x: &[f32],
    y: &mut [f32],
    threads: usize,
    quantised: Option<Precision>,
) {
    thread_local! {
        static QUANTISED: std::cell::RefCell<QuantisedX> = Default::default();
    }
    let precision = quantised.filter(|_| {
        k.is_multiple_of(32)
            && segments
                .iter()
                .any(|s| matches!(s, Segment::Packed(t) if takes_int8(t.format())))
    });
    QUANTISED.with_borrow_mut(|qx| {
        if let Some(precision) = precision {
            qx.quantise(x, precision);
        }
        let qx = precision.is_some().then_some(&*qx);
        let n = y.len();
        let parts = threads.min(n / MIN_ROWS_PER_TASK).max(1);
        if parts == 1 {
            rows_product(segments, k, 0..n, x, qx, y);
            return;
        }
        let size = n.div_ceil(parts).next_multiple_of(16);
        let out = SharedOut(y.as_mut_ptr());
        super::pool::run(parts, &|part| {
            let rows = (part * size).min(n)..((part + 1) * size).min(n);
            // SAFETY: the parts' row ranges are disjoint and inside `y`, which outlives the run.
            let y = unsafe { std::slice::from_raw_parts_mut(out.at(rows.start), rows.len()) };
            rows_product(segments, k, rows, x, qx, y);
        });
    });
}

/// `y`'s address, shared by the parts that write disjoint ranges of it.
struct SharedOut(*mut f32);
// SAFETY: each part writes its own range (see `matvec`).
unsafe impl Sync for SharedOut {}
impl SharedOut {
    fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: `i` is inside the slice the pointer came from (callers' ranges).
        unsafe { self.0.add(i) }
    }
}

/// `y[i - rows.start] = W[i] · x` for the output features `rows`, across segments (`qx`: `x`
/// quantised, for the packed segments that take it).
fn rows_product(
    segments: &[Segment<'_>],
    k: usize,
    rows: Range<usize>,
    x: &[f32],
    qx: Option<&QuantisedX>,
    y: &mut [f32],
) {
    let mut first = 0;
    for s in segments {
        let count = Matrix::rows_of(s, k);
        let (a, b) = (rows.start.max(first), rows.end.min(first + count));
        if a < b {
            let out = &mut y[a - rows.start..b - rows.start];
            match s {
                Segment::Packed(t) => match qx {
                    Some(qx) if takes_int8(t.format()) => dot_rows_int8(t, a - first, qx, out),
                    _ => dot_rows(t, a - first, x, out),
                },
                Segment::Dense(w) => {
                    for (i, o) in (a - first..b - first).zip(out) {
                        *o = dense_dot(&w[i * k..(i + 1) * k], x);
                    }
                }
            }
        }
        first += count;
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn dense_dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let whole = w.len() / 16 * 16;
    for (w, x) in w[..whole].chunks_exact(16).zip(x[..whole].chunks_exact(16)) {
        for ((a, w), x) in acc.iter_mut().zip(w).zip(x) {
            *a += w * x;
        }
    }
    let tail: f32 = w[whole..].iter().zip(&x[whole..]).map(|(w, x)| w * x).sum();
    acc.iter().sum::<f32>() + tail
}

std::thread_local! {
    /// A worker's widened slice of rows and its products, reused across calls.
    static SLICE: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// The positions of a many-row product, transposed for [`panel::product`].
    static POSITIONS: std::cell::RefCell<Positions> = std::cell::RefCell::default();
}

/// Bytes of `f32` rows a worker widens before multiplying them: small enough to stay in its
/// L2 cache between the two, large enough to share out (48 rows at least).
const SLICE_BYTES: usize = 192 * 1024;

/// Rows of width `k` in a worker's slice: whole tiles of 48, at least one.
fn slice_rows(k: usize) -> usize {
    (SLICE_BYTES / (4 * k.max(1)) / 48).max(1) * 48
}

/// `y = x·Wᵀ` for many rows. The packed segments' rows are cut in slices that the workers
/// take in turn as they finish (one run for them all: a fused q/k/v projection is three),
/// each widening its slice to `f32` and multiplying it with every position
/// ([`panel::product`]) while it is still in cache, writing its columns of `y`; an `f32`
/// segment is multiplied whole.
fn dequantised_gemm(
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    segments: &[Segment<'_>],
    threads: usize,
) {
    let size = slice_rows(k);
    // The packed segments' slices: the tensor, its rows, and where its columns start in `y`.
    let mut slices: Vec<(&PackedTensor, Range<usize>, usize)> = Vec::new();
    let mut first = 0;
    for s in segments {
        let count = Matrix::rows_of(s, k);
        match s {
            Segment::Dense(v) => SLICE.with_borrow_mut(|(_, t)| {
                set_len(t, m * count);
                linear_forward(t, m, count, k, x, v, &[], threads);
                for (y, t) in y.chunks_exact_mut(n).zip(t.chunks_exact(count)) {
                    y[first..first + count].copy_from_slice(t);
                }
            }),
            Segment::Packed(p) => slices.extend(
                (0..count)
                    .step_by(size)
                    .map(|a| (*p, a..(a + size).min(count), first)),
            ),
        }
        first += count;
    }
    if slices.is_empty() {
        return;
    }
    POSITIONS.with_borrow_mut(|positions| {
        positions.set(x, m, k);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let out = SharedOut(y.as_mut_ptr());
        let parts = threads.min(slices.len()).max(1);
        super::pool::run(parts, &|_| {
            SLICE.with_borrow_mut(|(w, t)| {
                while let Some((p, rows, first)) =
                    slices.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                {
                    let height = rows.len();
                    set_len(w, height * k);
                    p.dequantize_rows(rows.clone(), w);
                    set_len(t, height * m);
                    panel::product(t, w, height, positions);
                    for (j, t) in t.chunks_exact(height).enumerate() {
                        // SAFETY: row `j`'s columns `first + rows` of `y` (`m × n`) are this
                        // slice's alone; `y` outlives the run.
                        let y = unsafe {
                            std::slice::from_raw_parts_mut(
                                out.at(j * n + first + rows.start),
                                height,
                            )
                        };
                        y.copy_from_slice(t);
                    }
                }
            });
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::Format;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i + seed) * 7919 % 997) as f32 / 997.0 - 0.5)
            .collect()
    }

    /// A matrix of a Q8_0 piece, an f32 piece and a bf16 piece gives the product of its
    /// dequantised rows, row by row and through the GEMM, with the bias added.
    #[test]
    fn a_matrix_of_mixed_pieces_multiplies_as_its_dequantised_rows() {
        let (k, rows) = (64, [40usize, 8, 24]);
        let n: usize = rows.iter().sum();
        let tensors = vec![
            Store::Packed(Arc::new(
                PackedTensor::quantize(Format::Q8_0, rows[0], k, &values(rows[0] * k, 1)).unwrap(),
            )),
            Store::Dense(values(rows[1] * k, 2)),
            Store::Packed(Arc::new(
                PackedTensor::quantize(Format::Bf16, rows[2], k, &values(rows[2] * k, 3)).unwrap(),
            )),
            Store::Dense(values(n, 4)),
        ];
        let layer = LayerWeights::from_tensors(tensors);
        let mut dense = vec![0.0f32; n * k];
        match &layer.pieces[0].store {
            Store::Packed(t) => t.dequantize_rows(0..rows[0], &mut dense[..rows[0] * k]),
            Store::Dense(_) => unreachable!(),
        }
        dense[rows[0] * k..(rows[0] + rows[1]) * k].copy_from_slice(&values(rows[1] * k, 2));
        match &layer.pieces[2].store {
            Store::Packed(t) => t.dequantize_rows(0..rows[2], &mut dense[(n - rows[2]) * k..]),
            Store::Dense(_) => unreachable!(),
        }
        let bias = layer.vector((n * k, n)).to_vec();
        for m in [1, 2, 5] {
            let x = values(m * k, 5);
            let mut want = vec![0.0f32; m * n];
            linear_forward(&mut want, m, n, k, &x, &dense, &bias, 1);
            for threads in [1, 2] {
                let mut got = vec![0.0f32; m * n];
                let w = layer.matrix((0, n * k));
                matrix_forward(&mut got, m, n, k, &x, &w, &bias, threads);
                let worst = want
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst < 1e-4, "{m} rows on {threads} threads: {worst}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "not held as f32")]
    fn a_vector_inside_a_packed_piece_is_a_bug() {
        let t = PackedTensor::quantize(Format::Bf16, 2, 4, &[0.5; 8]).unwrap();
        let layer = LayerWeights::from_tensors(vec![Store::Packed(Arc::new(t))]);
        layer.vector((0, 4));
    }
}
