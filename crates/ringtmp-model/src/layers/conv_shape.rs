//! A convolution's geometry: what the im2col path of `conv2d` and the direct kernels of
//! `conv_direct` both read. Its passes are `conv2d`'s.

use serde::{Deserialize, Serialize};

/// Convolution geometry (square kernel, equal stride and zero padding on both axes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Conv2d {
    /// Input height.
    pub in_height: usize,
    /// Input width.
    pub in_width: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels (filters).
    pub out_channels: usize,
    /// Kernel side.
    pub kernel: usize,
    /// Stride on both axes.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    /// Output height.
    pub out_height: usize,
    /// Output width.
    pub out_width: usize,
}

impl Conv2d {
    /// Values in one column row: `kernel² · in_channels`.
    pub fn fan_in(&self) -> usize {
        self.kernel * self.kernel * self.in_channels
    }

    /// Number of weights.
    pub fn weight_len(&self) -> usize {
        self.out_channels * self.fan_in()
    }

    /// Weights plus biases.
    pub fn param_count(&self) -> usize {
        self.weight_len() + self.out_channels
    }
}
