//! A stage held for inference only ([`InferenceStage`]): its layers and their weights, packed
//! or `f32`, which the decoder reads through [`DecodeStage`] as it reads a training stage.

use std::ops::Range;

use std::sync::Arc;

use super::format::{Format, PackedTensor};
use super::weights::{LayerWeights, Params, Store};
use crate::layers::{Layer, LayerKind};

/// Which of `layer`'s tensors (in its `param_tensors` order) an inference stage may hold
/// packed: the weight matrices of Llama blocks and linear layers, and an embedding's token
/// table. Everything else (norms, biases, learned positions, GPT-2's blocks) stays `f32`.
pub fn packable(layer: &Layer) -> Vec<bool> {
    let tensors = layer.param_tensors();
    match &layer.kind {
        LayerKind::LlamaBlock(_) | LayerKind::Linear(_) => {
            tensors.iter().map(|(_, shape)| shape.len() == 2).collect()
        }
        LayerKind::Embedding(_) => (0..tensors.len()).map(|i| i == 0).collect(),
        _ => vec![false; tensors.len()],
    }
}

/// What decoding reads of a stage: its layers and each one's parameters.
pub trait DecodeStage {
    /// The stage's layers, in order.
    fn layers(&self) -> &[Layer];
    /// The model-wide index of the first.
    fn first_layer(&self) -> usize;
    /// Threads the products run on.
    fn threads(&self) -> usize;
    /// The parameters of the stage's `i`-th layer.
    fn layer_params(&self, i: usize) -> Params<'_>;
}

impl DecodeStage for crate::Stage {
    fn layers(&self) -> &[Layer] {
        crate::Stage::layers(self)
    }
    fn first_layer(&self) -> usize {
        crate::Stage::first_layer(self)
    }
    fn threads(&self) -> usize {
        crate::Stage::threads(self)
    }
    fn layer_params(&self, i: usize) -> Params<'_> {
        Params::Flat(self.layer_values(i))
    }
}

/// A stage held for inference only: its layers and their weights, packed or `f32`.
#[derive(Clone, Debug)]
pub struct InferenceStage {
    layers: Vec<Layer>,
    first: usize,
    weights: Vec<LayerWeights>,
    threads: usize,
}

impl InferenceStage {
    /// The stage holding `layers[range]` with `weights`, one per layer.
    ///
    /// # Panics
    /// If the weights are not one per layer, each of the layer's parameter count.
    pub fn new(
        layers: &[Layer],
        range: Range<usize>,
        weights: Vec<LayerWeights>,
        threads: usize,
    ) -> Self {
        let held = &layers[range.clone()];
        assert_eq!(held.len(), weights.len(), "weights for each layer");
        for (l, w) in held.iter().zip(&weights) {
            assert_eq!(
                l.param_count(),
                w.param_count(),
                "layer {}'s weights",
                l.index
            );
        }
        Self {
            layers: held.to_vec(),
            first: range.start,
            weights,
            threads: threads.max(1),
        }
    }

    /// A training stage's parameters held for inference: in `f32` as they are, or with the
    /// [`packable`] matrices converted to `format` (those whose rows are not whole blocks of
    /// it stay `f32`).
    pub fn from_stage(stage: &crate::Stage, format: Option<Format>) -> Self {
        let weights = stage
            .param_ranges()
            .map(|(layer, r)| {
                let values = &stage.params()[r];
                let Some(format) = format else {
                    return LayerWeights::dense(values.to_vec());
                };
                let mut at = 0;
                let tensors = layer
                    .param_tensors()
                    .into_iter()
                    .zip(packable(layer))
                    .map(|((_, shape), pack)| {
                        let len: usize = shape.iter().product();
                        let v = &values[at..at + len];
                        at += len;
                        pack.then(|| PackedTensor::quantize(format, shape[0], shape[1], v))
                            .flatten()
                            .map_or_else(
                                || Store::Dense(v.to_vec()),
                                |t| Store::Packed(Arc::new(t)),
                            )
                    })
                    .collect();
                LayerWeights::from_tensors(tensors)
            })
            .collect();
        Self {
            layers: stage.layers().to_vec(),
            first: stage.first_layer(),
            weights,
            threads: stage.threads(),
        }
    }

    /// The stage whose products over `Q8_0`, `Q4_0` and `Q4_1` blocks take the decoded
    /// vector as `activations` says: `f32` (the blocks dequantised in the loop), or quantised
    /// to 16 or 8 bits and summed in integers (faster where the CPU has AVX-512 VNNI; each
    /// product within half a quantisation step of each of its values of the `f32` one).
    pub fn with_activations(mut self, activations: super::Activations) -> Self {
        for w in &mut self.weights {
            w.set_quantised_activations(activations.precision());
        }
        self
    }

    /// Bytes of weights held (a shared tensor once).
    pub fn bytes(&self) -> usize {
        let mut seen = Vec::new();
        self.weights.iter().map(|w| w.bytes(&mut seen)).sum()
    }

    /// Each layer's weights.
    pub fn weights(&self) -> &[LayerWeights] {
        &self.weights
    }
}

impl DecodeStage for InferenceStage {
    fn layers(&self) -> &[Layer] {
        &self.layers
    }
    fn first_layer(&self) -> usize {
        self.first
    }
    fn threads(&self) -> usize {
        self.threads
    }
    fn layer_params(&self, i: usize) -> Params<'_> {
        Params::Held(&self.weights[i])
    }
}
