//! Measures a linear layer's weight gradient and optimizer update two ways, interleaved so that
//! a noisy machine slows both alike: the whole gradient written, then updated
//! (`Optimizer::update_range`), against gradient blocks updated while in cache
//! (`Optimizer::update_blocks`, what `Stage::backward_and_step` does for linear layers).
//!
//! ```sh
//! cargo run --release -p ringtmp-model --example weight_grad_blocks -- [THREADS] [into] [ROWS]
//! ```
//! `into` writes the update into a second buffer, as a ring node does while a micro-batch in
//! flight holds the current weights; `ROWS` is the block height (default: the layer's own).
//! Eight 1024×1024 layers, batch 64, SGD with momentum; prints milliseconds per layer.

use std::time::Instant;

use ringtmp_model::kernels::{Op, matmul, matmul_tn_rows};
use ringtmp_model::{Optimizer, OptimizerConfig};

const LAYERS: usize = 8;
const OUT: usize = 1024;
const IN: usize = 1024;
const BATCH: usize = 64;
const ROUNDS: usize = 60;
const WARMUP: usize = 5;

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map_or(1, |s| s.parse().expect("THREADS"));
    let into = args.next().is_some_and(|s| s == "into");
    let rows: usize = args.next().map_or(64, |s| s.parse().expect("ROWS"));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("thread pool");
    let len = OUT * IN;
    let mut params: Vec<Vec<f32>> = (0..LAYERS)
        .map(|l| (0..len).map(|i| ((i * 7 + l) % 13) as f32 * 1e-3).collect())
        .collect();
    let mut next = params.clone();
    let mut grads = vec![vec![0.0f32; len]; LAYERS];
    let x: Vec<f32> = (0..BATCH * IN).map(|i| (i % 17) as f32 * 0.01).collect();
    let dy: Vec<f32> = (0..BATCH * OUT).map(|i| (i % 19) as f32 * 0.001).collect();
    let config = OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut optimizer = Optimizer::new(config, len * LAYERS);
    let (mut whole, mut blocks) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let step = optimizer.begin_step(1e-3);
        let started = Instant::now();
        for l in 0..LAYERS {
            matmul(
                &mut grads[l],
                OUT,
                IN,
                BATCH,
                &dy,
                Op::T,
                &x,
                Op::N,
                false,
                threads,
            );
            let (from, to) = if into {
                (Some(params[l].as_slice()), &mut next[l])
            } else {
                (None, &mut params[l])
            };
            optimizer.update_range(&step, l * len, from, to, &grads[l], threads);
        }
        let whole_seconds = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for l in 0..LAYERS {
            let gradient = |r: std::ops::Range<usize>, out: &mut [f32]| {
                matmul_tn_rows(
                    out,
                    r.start / IN..r.end / IN,
                    OUT,
                    IN,
                    BATCH,
                    &dy,
                    &x,
                    false,
                )
            };
            let (from, to) = if into {
                (Some(params[l].as_slice()), &mut next[l])
            } else {
                (None, &mut params[l])
            };
            optimizer.update_blocks(&step, l * len, from, to, rows * IN, threads, gradient);
        }
        if round >= WARMUP {
            whole.push(whole_seconds);
            blocks.push(started.elapsed().as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] * 1e3 / LAYERS as f64
    };
    let (whole, blocks) = (median(&mut whole), median(&mut blocks));
    println!(
        "{threads} thread(s), {}, blocks of {rows} rows: whole gradient then update {whole:.3} \
         ms a layer, by blocks {blocks:.3} ms ({:.2}×)",
        if into {
            "into a new version"
        } else {
            "in place"
        },
        whole / blocks
    );
}
