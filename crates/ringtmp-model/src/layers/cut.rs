//! Cutting a model's linear layer in two by its output features (a head and a tail, see
//! [`LinearPart`]), so that a pipeline can place the cut between two stages.

use super::{Layer, LayerKind, LinearPart};
use crate::shape::Shape;

/// `layers` with linear layer `at` cut after output feature `split`: a head and a tail in its
/// place, both with its index, input and output ends, and initialisation gain. An error names
/// the layer where it is not linear or the split leaves a part empty.
pub fn cut_linear(layers: &[Layer], at: usize, split: usize) -> crate::Result<Vec<Layer>> {
    let layer = layers.get(at).ok_or_else(|| crate::Error::Config {
        source_name: "cut inside a layer".into(),
        reason: format!("layer {at} does not exist ({} layers)", layers.len()),
    })?;
    let LayerKind::Linear(linear) = &layer.kind else {
        return Err(crate::Error::Shape {
            index: layer.index,
            kind: layer.kind_name(),
            input: layer.input.clone(),
            reason: "only a linear layer can be cut inside".into(),
        });
    };
    if layer.tied_to.is_some() {
        return Err(crate::Error::Shape {
            index: layer.index,
            kind: layer.kind_name(),
            input: layer.input.clone(),
            reason: "a head tied to the embedding cannot be cut inside (its weight is the \
                     embedding's whole table)"
                .into(),
        });
    }
    if !linear.bias {
        return Err(crate::Error::Shape {
            index: layer.index,
            kind: layer.kind_name(),
            input: layer.input.clone(),
            reason: "only a linear layer with a bias can be cut inside".into(),
        });
    }
    if layer.input.as_flat().is_none() {
        return Err(crate::Error::Shape {
            index: layer.index,
            kind: layer.kind_name(),
            input: layer.input.clone(),
            reason: "only a linear layer over a flat input can be cut inside (not one over a \
                     sequence)"
                .into(),
        });
    }
    if split == 0 || split >= linear.out_features {
        return Err(crate::Error::Shape {
            index: layer.index,
            kind: layer.kind_name(),
            input: layer.input.clone(),
            reason: format!(
                "a cut after output feature {split} leaves a part empty (it has {})",
                linear.out_features
            ),
        });
    }
    let part = LinearPart {
        in_features: linear.in_features,
        out_features: linear.out_features,
        split,
    };
    let middle = Shape::flat(linear.in_features + split);
    let head = Layer {
        kind: LayerKind::LinearHead(part.clone()),
        output: middle.clone(),
        ..layer.clone()
    };
    let tail = Layer {
        kind: LayerKind::LinearTail(part),
        input: middle,
        ..layer.clone()
    };
    let mut out = layers[..at].to_vec();
    out.extend([head, tail]);
    out.extend_from_slice(&layers[at + 1..]);
    Ok(out)
}
