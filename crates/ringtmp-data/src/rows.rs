//! Fixed-size examples stored as rows of one dtype (images, tables, arrays), with their labels,
//! normalised per channel only when a batch gathers them.
//!
//! A [`Rows`] is a view: the shared [`RowData`] (bytes in memory or memory-mapped from the file,
//! never copied per split) and, optionally, the storage rows it takes in order. A training split
//! and the validation split held out of the same file share one `RowData`.
//!
//! Invariants: `bytes.len() == rows · features · dtype.size()`; every label is in range (checked
//! by the readers, which know the file and row to name); `affine` has one `(a, b)` per
//! normalisation channel, and value `j` of a row (in the model's order) belongs to channel
//! `j % channels` (channels-last, as the model's images are).

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// How one value is stored (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// Bytes, as pixels are.
    U8,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl Dtype {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// Where the row bytes live.
#[derive(Debug)]
pub(crate) enum Bytes {
    /// Read (and decoded) into memory.
    Owned(Vec<u8>),
    /// A range of a memory-mapped file: pages are read when a batch touches them, so a dataset
    /// larger than memory streams, and a worker reads only its shard's rows.
    Mapped {
        map: memmap2::Mmap,
        range: Range<usize>,
    },
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Mapped { map, range } => &map[range.clone()],
        }
    }
}

/// What an example asks the model to produce.
#[derive(Clone, Debug, PartialEq)]
pub enum Labels {
    /// One class index per row.
    Classes(Vec<u32>),
    /// `width` real targets per row (regression), row-major.
    Targets {
        /// The targets.
        values: Vec<f32>,
        /// Targets per row.
        width: usize,
    },
}

impl Labels {
    /// Rows labelled.
    pub fn len(&self) -> usize {
        match self {
            Labels::Classes(c) => c.len(),
            Labels::Targets { values, width } => values.len() / (*width).max(1),
        }
    }

    /// Whether no row is labelled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Labels per row.
    pub fn width(&self) -> usize {
        match self {
            Labels::Classes(_) => 1,
            Labels::Targets { width, .. } => *width,
        }
    }
}

/// The rows of one file (or of a set of files read together) and their labels.
#[derive(Debug)]
pub struct RowData {
    pub(crate) bytes: Bytes,
    pub(crate) dtype: Dtype,
    /// Values per row, in the model's (channels-last) order.
    pub(crate) features: usize,
    /// Position in the stored row of the model's value `j` (a channels-first file read
    /// channels-last); `None`: the stored order is the model's.
    pub(crate) order: Option<Vec<u32>>,
    pub(crate) labels: Labels,
}

impl RowData {
    /// Rows held in memory.
    pub fn owned(bytes: Vec<u8>, dtype: Dtype, features: usize, labels: Labels) -> Self {
        debug_assert_eq!(bytes.len(), labels.len() * features * dtype.size());
        Self {
            bytes: Bytes::Owned(bytes),
            dtype,
            features,
            order: None,
            labels,
        }
    }

    /// Rows in `range` of a memory-mapped file, stored in `order` (see [`RowData::order`]).
    pub(crate) fn mapped(
        map: memmap2::Mmap,
        range: Range<usize>,
        dtype: Dtype,
        features: usize,
        order: Option<Vec<u32>>,
        labels: Labels,
    ) -> Self {
        debug_assert_eq!(range.len(), labels.len() * features * dtype.size());
        Self {
            bytes: Bytes::Mapped { map, range },
            dtype,
            features,
            order,
            labels,
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Whether the bytes are memory-mapped rather than read into memory.
    pub fn is_mapped(&self) -> bool {
        matches!(self.bytes, Bytes::Mapped { .. })
    }

    /// Appends row `row`'s raw values (not normalised), in the model's order, to `out`.
    pub(crate) fn raw_row(&self, row: usize, out: &mut Vec<f32>) {
        let size = self.dtype.size();
        let stride = self.features * size;
        let bytes = &self.bytes.as_slice()[row * stride..(row + 1) * stride];
        let value = |k: usize| -> f32 {
            let b = &bytes[k * size..(k + 1) * size];
            match self.dtype {
                Dtype::U8 => f32::from(b[0]),
                Dtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            }
        };
        match &self.order {
            None => match self.dtype {
                // The common case, without the per-value match.
                Dtype::U8 => out.extend(bytes.iter().map(|&p| f32::from(p))),
                Dtype::F32 => out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
                Dtype::F16 => out.extend((0..self.features).map(value)),
            },
            Some(order) => out.extend(order.iter().map(|&k| value(k as usize))),
        }
    }
}

/// Per-channel normalisation: `x = (v · scale − mean[c]) / std[c]`, `v` the stored value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Normalisation {
    /// Factor applied to stored values first (1/255 for bytes, as torchvision's `ToTensor`).
    pub scale: f32,
    /// Mean of each channel, in scaled units.
    pub mean: Vec<f32>,
    /// Standard deviation of each channel, in scaled units (never 0: a constant channel keeps 1).
    pub std: Vec<f32>,
}

impl Normalisation {
    /// The identity after `scale`.
    pub fn identity(scale: f32, channels: usize) -> Self {
        Self {
            scale,
            mean: vec![0.0; channels],
            std: vec![1.0; channels],
        }
    }

    /// Channels normalised.
    pub fn channels(&self) -> usize {
        self.mean.len()
    }

    /// The statistics of `rows`' channels, in `scale`d units. Accumulates in `f64` over every row
    /// (a pass over the data, as torchvision users make it once by hand).
    pub fn measure(rows: &Rows, scale: f32, channels: usize) -> Self {
        let mut sum = vec![0f64; channels];
        let mut sq = vec![0f64; channels];
        let mut row = Vec::with_capacity(rows.features());
        for i in 0..rows.len() {
            row.clear();
            rows.data.raw_row(rows.storage_row(i), &mut row);
            for (j, &v) in row.iter().enumerate() {
                let v = f64::from(v) * f64::from(scale);
                sum[j % channels] += v;
                sq[j % channels] += v * v;
            }
        }
        let per_channel = (rows.len() * rows.features() / channels.max(1)).max(1) as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / per_channel).collect();
        let std = sq
            .iter()
            .zip(&mean)
            .map(|(q, m)| {
                let var = (q / per_channel - m * m).max(0.0);
                // A constant channel (an image's border, a column of one value) stays unscaled.
                if var.sqrt() < 1e-6 {
                    1.0
                } else {
                    var.sqrt() as f32
                }
            })
            .collect();
        Self {
            scale,
            mean: mean.iter().map(|&m| m as f32).collect(),
            std,
        }
    }

    /// `(a, b)` per channel with `x = v · a + b`.
    pub(crate) fn affine(&self) -> Vec<(f32, f32)> {
        self.mean
            .iter()
            .zip(&self.std)
            .map(|(&m, &s)| (self.scale / s, -m / s))
            .collect()
    }
}

/// A split's view of [`RowData`]: which rows, in what order, normalised how.
#[derive(Clone, Debug)]
pub struct Rows {
    pub(crate) data: Arc<RowData>,
    /// Storage row of example `i`; `None`: example `i` is row `i`.
    pub(crate) index: Option<Arc<Vec<u32>>>,
    affine: Arc<Vec<(f32, f32)>>,
    norm: Normalisation,
    /// Regression: each target's `(mean, std)`; a gathered target is `(t − mean) / std`.
    targets: Option<Arc<Vec<(f32, f32)>>>,
}

impl Rows {
    /// Every row of `data`, or those of `index` in its order, normalised by `norm`.
    pub fn new(data: Arc<RowData>, index: Option<Vec<u32>>, norm: Normalisation) -> Self {
        debug_assert!(
            index
                .as_ref()
                .is_none_or(|ix| ix.iter().all(|&r| (r as usize) < data.len()))
        );
        Self {
            data,
            index: index.map(Arc::new),
            affine: Arc::new(norm.affine()),
            norm,
            targets: None,
        }
    }

    /// The same rows with regression targets standardised by `(mean, std)` per target.
    pub fn with_target_standardisation(mut self, stats: Vec<(f32, f32)>) -> Self {
        debug_assert_eq!(stats.len(), self.positions());
        self.targets = Some(Arc::new(stats));
        self
    }

    /// Regression: each target's mean and standard deviation over these rows (a constant
    /// target keeps a deviation of 1); `None` for class labels.
    pub fn measure_targets(&self) -> Option<Vec<(f32, f32)>> {
        let Labels::Targets { values, width } = &self.data.labels else {
            return None;
        };
        let n = self.len().max(1) as f64;
        Some(
            (0..*width)
                .map(|j| {
                    let column =
                        (0..self.len()).map(|i| f64::from(values[self.storage_row(i) * width + j]));
                    let (s, q) = column.fold((0.0, 0.0), |(s, q), t| (s + t, q + t * t));
                    let mean = s / n;
                    let std = (q / n - mean * mean).max(0.0).sqrt();
                    (mean as f32, if std < 1e-12 { 1.0 } else { std as f32 })
                })
                .collect(),
        )
    }

    /// Regression: the standardisation applied to the targets.
    pub fn target_standardisation(&self) -> Option<&[(f32, f32)]> {
        self.targets.as_deref().map(Vec::as_slice)
    }

    /// The same rows normalised by `norm` instead.
    pub fn with_normalisation(mut self, norm: Normalisation) -> Self {
        self.affine = Arc::new(norm.affine());
        self.norm = norm;
        self
    }

    /// The normalisation applied.
    pub fn normalisation(&self) -> &Normalisation {
        &self.norm
    }

    /// Examples in this view.
    pub fn len(&self) -> usize {
        self.index.as_ref().map_or(self.data.len(), |ix| ix.len())
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values per example.
    pub fn features(&self) -> usize {
        self.data.features
    }

    /// Labels per example.
    pub fn positions(&self) -> usize {
        self.data.labels.width()
    }

    /// Whether the rows are memory-mapped from their file (streamed) rather than held in memory.
    pub fn is_mapped(&self) -> bool {
        self.data.is_mapped()
    }

    /// The labels (all storage rows).
    pub fn labels(&self) -> &Labels {
        &self.data.labels
    }

    /// Target `j`'s value as the model is trained on it.
    fn standardised(&self, j: usize, t: f32) -> f32 {
        match &self.targets {
            Some(stats) => (t - stats[j].0) / stats[j].1,
            None => t,
        }
    }

    /// Regression: the variance of this view's targets (as trained on: standardised) about their
    /// mean, pooled over every target (the denominator of R²); `None` for class labels.
    pub fn target_variance(&self) -> Option<f64> {
        let Labels::Targets { values, width } = &self.data.labels else {
            return None;
        };
        let mut sum = vec![0f64; *width];
        let mut sq = vec![0f64; *width];
        for i in 0..self.len() {
            let row = self.storage_row(i);
            for (j, &t) in values[row * width..(row + 1) * width].iter().enumerate() {
                let t = f64::from(self.standardised(j, t));
                sum[j] += t;
                sq[j] += t * t;
            }
        }
        let n = self.len().max(1) as f64;
        let total: f64 = sum
            .iter()
            .zip(&sq)
            .map(|(s, q)| q / n - (s / n).powi(2))
            .sum();
        Some((total / *width as f64).max(0.0))
    }

    fn storage_row(&self, i: usize) -> usize {
        self.index.as_ref().map_or(i, |ix| ix[i] as usize)
    }

    /// Writes the normalised inputs of `indices` into `x` and their labels into `y` (a target as
    /// its `f32` bit pattern: one label type travels through every strategy).
    pub fn gather(&self, indices: &[u32], x: &mut Vec<f32>, y: &mut Vec<u32>) {
        x.clear();
        y.clear();
        let channels = self.affine.len();
        for &i in indices {
            let row = self.storage_row(i as usize);
            let start = x.len();
            self.data.raw_row(row, x);
            if channels == 1 {
                let (a, b) = self.affine[0];
                x[start..].iter_mut().for_each(|v| *v = *v * a + b);
            } else {
                for (j, v) in x[start..].iter_mut().enumerate() {
                    let (a, b) = self.affine[j % channels];
                    *v = *v * a + b;
                }
            }
            match &self.data.labels {
                Labels::Classes(c) => y.push(c[row]),
                Labels::Targets { values, width } => y.extend(
                    values[row * width..(row + 1) * width]
                        .iter()
                        .enumerate()
                        .map(|(j, &t)| self.standardised(j, t).to_bits()),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Arc<RowData> {
        // Three rows of two channels (HWC [1, 2, 2]): channel 0 = 0, 2, 4, …; channel 1 = 10, …
        let values: Vec<f32> = vec![
            0.0, 10.0, 2.0, 12.0, //
            4.0, 14.0, 6.0, 16.0, //
            8.0, 18.0, 10.0, 20.0,
        ];
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Arc::new(RowData::owned(
            bytes,
            Dtype::F32,
            4,
            Labels::Classes(vec![0, 1, 2]),
        ))
    }

    #[test]
    fn measured_channels_normalise_to_zero_mean_unit_variance() {
        let data = table();
        let all = Rows::new(data.clone(), None, Normalisation::identity(1.0, 2));
        let norm = Normalisation::measure(&all, 1.0, 2);
        assert_eq!(norm.mean, vec![5.0, 15.0]);
        let rows = all.with_normalisation(norm);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        rows.gather(&[0, 1, 2], &mut x, &mut y);
        for c in 0..2 {
            let ch: Vec<f32> = x.iter().skip(c).step_by(2).copied().collect();
            let mean = ch.iter().sum::<f32>() / 6.0;
            let var = ch.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / 6.0;
            assert!(mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5, "{c}: {ch:?}");
        }
        assert_eq!(y, vec![0, 1, 2]);
    }

    #[test]
    fn an_index_selects_and_orders_storage_rows() {
        let rows = Rows::new(table(), Some(vec![2, 0]), Normalisation::identity(1.0, 1));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        rows.gather(&[0, 1], &mut x, &mut y);
        assert_eq!(y, vec![2, 0]);
        assert_eq!(&x[..4], &[8.0, 18.0, 10.0, 20.0]);
        assert_eq!(rows.len(), 2);
    }

    #[test]
    fn targets_travel_as_their_bit_patterns() {
        let data = Arc::new(RowData::owned(
            vec![1, 2, 3, 4],
            Dtype::U8,
            2,
            Labels::Targets {
                values: vec![0.5, -1.5, 2.0, 3.25],
                width: 2,
            },
        ));
        let rows = Rows::new(data, None, Normalisation::identity(1.0, 1));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        rows.gather(&[1], &mut x, &mut y);
        assert_eq!(x, vec![3.0, 4.0]);
        assert_eq!(
            y.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(),
            vec![2.0, 3.25]
        );
    }

    #[test]
    fn an_order_reads_channels_first_rows_channels_last() {
        // CHW [2, 1, 2]: channel 0 = (1, 2), channel 1 = (3, 4) → HWC = 1, 3, 2, 4.
        let mut data = RowData::owned(vec![1, 2, 3, 4], Dtype::U8, 4, Labels::Classes(vec![0]));
        data.order = Some(vec![0, 2, 1, 3]);
        let rows = Rows::new(Arc::new(data), None, Normalisation::identity(1.0, 1));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        rows.gather(&[0], &mut x, &mut y);
        assert_eq!(x, vec![1.0, 3.0, 2.0, 4.0]);
    }
}
