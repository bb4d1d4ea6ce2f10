//! Per-sample tensor shapes.
//!
//! Activations are stored row-major with the batch as the outermost dimension. Images are
//! channels-last (`[height, width, channels]`, i.e. NHWC for a batch): convolution then becomes
//! one GEMM whose output is already in the layout the next layer reads, with no transposes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The shape of one sample (the batch dimension is not part of it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// A flat vector of `n` features.
    pub fn flat(n: usize) -> Self {
        Self(vec![n])
    }

    /// An image `[height, width, channels]`.
    pub fn image(height: usize, width: usize, channels: usize) -> Self {
        Self(vec![height, width, channels])
    }

    /// Number of values in one sample.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// `(height, width, channels)` if this is an image shape.
    pub fn as_image(&self) -> Option<(usize, usize, usize)> {
        match self.0[..] {
            [h, w, c] => Some((h, w, c)),
            _ => None,
        }
    }

    /// The feature count if this is a flat shape.
    pub fn as_flat(&self) -> Option<usize> {
        match self.0[..] {
            [n] => Some(n),
            _ => None,
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}
