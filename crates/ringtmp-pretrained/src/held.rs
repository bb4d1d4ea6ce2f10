//! A pretrained model's weights held for inference in fewer bytes than `f32`: each stage's
//! matrices as the file stores them — bf16 or f16 from a Hugging Face directory, `Q8_0`,
//! `Q4_0`, `Q4_1`, f16 or bf16 blocks from a GGUF file — the decoder's kernels dequantising
//! them as they multiply (`ringtmp_model::packed`), or converted on load to the format
//! `--weights-dtype` names.
//!
//! Invariants: only the matrices [`packable`] names are packed (norms, biases and learned
//! positions stay `f32`); a tensor in a format without a kernel (f32, `Q5_*`, the K-quants)
//! is held `f32` unless a format was asked for, so by default no value changes from what
//! [`Pretrained::load`] reads; a GGUF's interleaved q/k rows are put back in Hugging Face's
//! order whatever the format; a tied head in the stage of its embedding shares its table.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use ringtmp_model::Layer;
use ringtmp_model::packed::{Format, InferenceStage, LayerWeights, PackedTensor, Store, packable};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::gguf::TensorType;
use crate::model::{Pretrained, PretrainedError, Source, Stored, deinterleave};

/// How a generating stage holds its matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsDtype {
    /// As the file stores them where a kernel reads that format, else `f32`.
    #[default]
    File,
    /// `f32`, every format dequantised on load (what training holds).
    F32,
    /// bfloat16 (exact from a bf16 file, rounded to nearest even otherwise).
    Bf16,
    /// ggml's 8-bit blocks (exact from a `Q8_0` file, quantised as ggml does otherwise).
    Q8_0,
}

impl WeightsDtype {
    /// The names `--weights-dtype` takes.
    pub const NAMES: &'static str = "file, f32, bf16, q8_0";

    /// The dtype `name` names.
    pub fn parse(name: &str) -> Result<Self, String> {
        Ok(match name {
            "file" => Self::File,
            "f32" => Self::F32,
            "bf16" => Self::Bf16,
            "q8_0" => Self::Q8_0,
            other => {
                return Err(format!("--weights-dtype {other:?}: one of {}", Self::NAMES));
            }
        })
    }

    /// The format every packable matrix is converted to, if one is asked for.
    pub fn format(self) -> Option<Format> {
        match self {
            Self::File | Self::F32 => None,
            Self::Bf16 => Some(Format::Bf16),
            Self::Q8_0 => Some(Format::Q8_0),
        }
    }
}

impl std::str::FromStr for WeightsDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

/// The format a kernel reads a GGUF tensor type in, if one does.
fn gguf_format(kind: TensorType) -> Option<Format> {
    Some(match kind {
        TensorType::F16 => Format::F16,
        TensorType::Bf16 => Format::Bf16,
        TensorType::Q8_0 => Format::Q8_0,
        TensorType::Q4_0 => Format::Q4_0,
        TensorType::Q4_1 => Format::Q4_1,
        _ => return None,
    })
}

impl Pretrained {
    /// A stage holding `layers[range]` for inference, its matrices held as `dtype` says, on
    /// `threads` threads.
    pub fn inference_stage(
        &self,
        layers: &[Layer],
        range: Range<usize>,
        threads: usize,
        dtype: WeightsDtype,
    ) -> Result<InferenceStage, PretrainedError> {
        let mut shared: HashMap<String, Arc<PackedTensor>> = HashMap::new();
        let mut weights = Vec::with_capacity(range.len());
        for position in range.clone() {
            let layer = &layers[position];
            let stored = self.stored(layers.len(), position, layer)?;
            let mut tensors = Vec::new();
            for (((_, shape), stored), pack) in layer
                .param_tensors()
                .into_iter()
                .zip(stored)
                .zip(packable(layer))
            {
                let store = if pack && dtype != WeightsDtype::F32 && !stored.transposed {
                    self.held(&stored, &shape, dtype, &mut shared)?
                } else {
                    let mut values = vec![0.0f32; shape.iter().product()];
                    self.read_into(&stored, &shape, &mut values)?;
                    Store::Dense(values)
                };
                tensors.push(store);
            }
            weights.push(LayerWeights::from_tensors(tensors));
        }
        Ok(InferenceStage::new(layers, range, weights, threads))
    }

    /// The bytes each of `layers` takes held as `dtype` says (a tied head: its table's bytes
    /// again, as a node other than the embedding's maps them), without reading any weight:
    /// what a split over nodes balances.
    pub fn held_bytes(
        &self,
        layers: &[Layer],
        dtype: WeightsDtype,
    ) -> Result<Vec<u64>, PretrainedError> {
        let mut out = Vec::with_capacity(layers.len());
        for (position, layer) in layers.iter().enumerate() {
            let stored = self.stored(layers.len(), position, layer)?;
            let mut bytes = 0u64;
            for (((_, shape), stored), pack) in layer
                .param_tensors()
                .into_iter()
                .zip(stored)
                .zip(packable(layer))
            {
                let values: usize = shape.iter().product();
                let held = if !pack || dtype == WeightsDtype::F32 || stored.transposed {
                    None
                } else {
                    self.held_format(&stored, shape[1], dtype)?
                };
                bytes += held
                    .and_then(|f| f.row_bytes(shape[1]))
                    .map_or(4 * values as u64, |row| (row * shape[0]) as u64);
            }
            out.push(bytes);
        }
        Ok(out)
    }

    /// Whether the model's head, tied to its embedding, is held as `dtype` says as a view of
    /// the same mapped bytes as the table (so a process holding both holds them once): the
    /// table in a format a kernel reads, held as stored.
    pub fn head_reads_mapped_table(
        &self,
        layers: &[Layer],
        dtype: WeightsDtype,
    ) -> Result<bool, PretrainedError> {
        let (Some(head), Some(embedding)) = (layers.last(), layers.first()) else {
            return Ok(false);
        };
        if head.tied_to.is_none() || dtype == WeightsDtype::F32 {
            return Ok(false);
        }
        let Some(table) = self.stored(layers.len(), 0, embedding)?.into_iter().next() else {
            return Ok(false);
        };
        let cols = embedding.param_tensors()[0].1[1];
        let raw = self.raw_format(&table)?;
        Ok(raw.is_some() && raw == self.held_format(&table, cols, dtype)?)
    }

    /// The format the packable matrix `stored` (rows of `cols` values) is held in as `dtype`
    /// says: the file's where a kernel reads it and no other is asked for, the one asked for
    /// where it can be made (not the 4-bit formats, which are only read; whole blocks), else
    /// `None` (f32).
    fn held_format(
        &self,
        stored: &Stored,
        cols: usize,
        dtype: WeightsDtype,
    ) -> Result<Option<Format>, PretrainedError> {
        let raw = self.raw_format(stored)?;
        let Some(want) = dtype.format().or(raw) else {
            return Ok(None);
        };
        let made = raw == Some(want) || !matches!(want, Format::Q4_0 | Format::Q4_1);
        Ok((made && want.row_bytes(cols).is_some()).then_some(want))
    }

    /// The format `stored` is stored in, when a kernel reads it as stored.
    fn raw_format(&self, stored: &Stored) -> Result<Option<Format>, PretrainedError> {
        Ok(match &self.source {
            Source::Gguf(g) => gguf_format(g.tensor(&stored.name)?.kind),
            Source::Hf(h) => match h.raw(&stored.name)?.0 {
                Dtype::BF16 => Some(Format::Bf16),
                Dtype::F16 => Some(Format::F16),
                _ => None,
            },
        })
    }

    /// The mapped file holding `stored` and where its bytes start.
    fn shared_bytes(
        &self,
        stored: &Stored,
    ) -> Result<(ringtmp_model::packed::SharedBytes, usize), PretrainedError> {
        Ok(match &self.source {
            Source::Gguf(g) => g.shared(g.tensor(&stored.name)?),
            Source::Hf(h) => h.shared(&stored.name)?,
        })
    }

    /// One packable matrix of shape `[rows, cols]`, held as `dtype` says.
    fn held(
        &self,
        stored: &Stored,
        shape: &[usize],
        dtype: WeightsDtype,
        shared: &mut HashMap<String, Arc<PackedTensor>>,
    ) -> Result<Store, PretrainedError> {
        self.checked_shape(stored, shape)?;
        if let Some(t) = shared.get(&stored.name) {
            return Ok(Store::Packed(t.clone()));
        }
        let (rows, cols) = (shape[0], shape[1]);
        let raw = self.raw_format(stored)?;
        let want = self.held_format(stored, cols, dtype)?;
        let tensor = match (raw, want) {
            (Some(format), Some(want)) if format == want => {
                let bad = |what| self.model_error(format!("tensor {}: {what}", stored.name));
                // Read where the file lies: its mapped pages are the tensor's memory;
                // llama.cpp's interleaved q/k rows read in Hugging Face's order.
                let (owner, start) = self.shared_bytes(stored)?;
                let view = PackedTensor::view(format, rows, cols, owner, start).map_err(bad)?;
                match stored.interleaved_heads {
                    Some(heads) => view
                        .with_row_order(hf_row_order(heads, rows))
                        .map_err(bad)?,
                    None => view,
                }
            }
            (_, want) => {
                let mut values = vec![0.0f32; rows * cols];
                self.read_into(stored, shape, &mut values)?;
                match want.and_then(|f| PackedTensor::quantize(f, rows, cols, &values)) {
                    Some(t) => t,
                    None => return Ok(Store::Dense(values)),
                }
            }
        };
        let tensor = Arc::new(tensor);
        shared.insert(stored.name.clone(), tensor.clone());
        Ok(Store::Packed(tensor))
    }
}

/// For each of Hugging Face's `rows` rows (`heads` heads), the llama.cpp row it is stored as
/// (its query and key rows interleaved within each head).
fn hf_row_order(heads: usize, rows: usize) -> Vec<u32> {
    let mut order: Vec<f32> = (0..rows).map(|r| r as f32).collect();
    deinterleave(&mut order, heads, rows);
    order.into_iter().map(|r| r as u32).collect()
}
