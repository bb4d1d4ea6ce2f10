//! What a forward pass is for and what it leaves for the backward: the types every layer's
//! passes share, and the seed mixing that keys their randomness.

/// Per-micro-batch side data a layer's backward needs (beyond its input and output).
#[derive(Debug, Default)]
pub struct Aux {
    /// Float side data: the scaled keep-mask (dropout).
    pub values: Vec<f32>,
    /// Integer side data: argmax positions (max-pooling).
    pub indices: Vec<u32>,
}

/// What a forward pass is for; identifies the randomness a layer (dropout) may use.
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    /// Training (stash for backward, dropout active) or evaluation.
    pub train: bool,
    /// Run seed; with `step` and the sample's row it keys the dropout mask.
    pub seed: u64,
    /// Optimizer step this forward belongs to.
    pub step: u64,
    /// Position of this micro-batch's first row in its mini-batch, so that a sample gets the same
    /// dropout mask however the mini-batch is split into micro-batches.
    pub row_offset: usize,
}

impl Pass {
    /// An evaluation pass (no dropout, nothing stashed).
    pub fn eval() -> Self {
        Self {
            train: false,
            seed: 0,
            step: 0,
            row_offset: 0,
        }
    }
}

/// SplitMix64-style mixing of a seed with a stream number; used for every derived seed so that
/// streams are independent and reproducible.
pub fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed
        ^ stream
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
