//! The products of a prompt's prefill through packed weights, alone: SmolLM2-135M's seven
//! projections a block (576 wide, MLP 1536) as `Q4_1` blocks (its GGUF file's format), times
//! 30 blocks, for a prompt of `M` positions — the rate in GFLOP/s beside the same products on
//! `f32` weights, on 1 and 2 threads, the best of 7 rounds.
//!
//! ```sh
//! cargo run --release -p ringtmp-model --example prefill_products [M]
//! ```

use std::sync::Arc;
use std::time::Instant;

use ringtmp_model::packed::{Format, LayerWeights, Matrix, PackedTensor, Store, matrix_forward};

/// `(rows, cols)` of a block's projections: q, k, v, o, gate, up, down.
const SHAPES: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];
const BLOCKS: usize = 30;

/// `Q4_1` blocks with scales and minimums of a trained model's size and nibbles spread over
/// their range (the products' speed does not depend on the values).
fn q4_1(rows: usize, cols: usize, seed: u64) -> PackedTensor {
    let mut bytes = Vec::with_capacity(rows * cols / 32 * 20);
    for b in 0..rows * cols / 32 {
        bytes.extend(half::f16::from_f32(0.004).to_le_bytes());
        bytes.extend(half::f16::from_f32(-0.03).to_le_bytes());
        bytes.extend((0..16).map(|j| ((b * 16 + j) as u64 * 7919 + seed) as u8));
    }
    PackedTensor::new(Format::Q4_1, rows, cols, bytes).expect("whole blocks")
}

fn main() {
    let m: usize = std::env::args()
        .nth(1)
        .map_or(46, |a| a.parse().expect("M"));
    let packed: Vec<PackedTensor> = (0..BLOCKS)
        .flat_map(|b| SHAPES.iter().map(move |&(r, c)| (b, r, c)))
        .map(|(b, r, c)| q4_1(r, c, (b * 7 + r + c) as u64))
        .collect();
    let held: Vec<LayerWeights> = packed
        .iter()
        .map(|t| LayerWeights::from_tensors(vec![Store::Packed(Arc::new(t.clone()))]))
        .collect();
    let dense: Vec<Vec<f32>> = packed
        .iter()
        .map(|t| {
            let mut v = vec![0.0; t.rows() * t.cols()];
            t.dequantize_rows(0..t.rows(), &mut v);
            v
        })
        .collect();
    let flops: usize = packed.iter().map(|t| 2 * m * t.rows() * t.cols()).sum();
    let x: Vec<f32> = (0..m * 1536)
        .map(|i| ((i % 29) as f32 - 14.0) * 0.05)
        .collect();
    let mut y = vec![0.0f32; m * 1536];
    for threads in [1, 2] {
        for kind in ["q4_1", "f32"] {
            let mut best = f64::INFINITY;
            for _ in 0..7 {
                let start = Instant::now();
                for ((t, d), h) in packed.iter().zip(&dense).zip(&held) {
                    let (n, k) = (t.rows(), t.cols());
                    let w = if kind == "f32" {
                        Matrix::dense(d)
                    } else {
                        h.matrix((0, n * k))
                    };
                    matrix_forward(&mut y, m, n, k, &x[..m * k], &w, &[], threads);
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            println!(
                "{kind:>5} weights, {threads} thread(s), {m} positions: {:.1} ms, {:.1} GFLOP/s",
                best * 1e3,
                flops as f64 / best / 1e9
            );
        }
    }
}
