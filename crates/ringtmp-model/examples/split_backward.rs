//! Measures a ring stage's step with the backward fused (`Stage::backward_and_step`: each layer's
//! input gradient, weight gradient and update in turn) against the split one
//! (`Stage::backward_sending`: the input gradients first, then the weight gradients and
//! updates), alternating step by step so that a noisy machine slows both alike. The stage is
//! `mlp-deep`'s second one on two nodes: four 1024×1024 linear layers with ReLUs and the 10-way
//! output layer, 64 rows, SGD with momentum 0.8.
//!
//! ```sh
//! taskset -c 1 cargo run --release -p ringtmp-model --example split_backward -- [STEPS]
//! ```
//! Prints the median and lower quartile of a step (forward + backward + update) in ms for each.

use std::time::Instant;

use ringtmp_model::{Layer, ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage};

const ROWS: usize = 64;
const WARMUP: u64 = 20;

fn main() {
    let steps: u64 = std::env::args()
        .nth(1)
        .map_or(400, |s| s.parse().expect("STEPS"));
    let mut spec = String::from("name = \"mlp-deep-tail\"\n");
    for _ in 0..4 {
        spec.push_str("[[layer]]\ntype = \"linear\"\nout = 1024\n[[layer]]\ntype = \"relu\"\n");
    }
    spec.push_str("[[layer]]\ntype = \"linear\"\nout = 10\n");
    let layers: Vec<Layer> = ModelSpec::from_toml(&spec, "split_backward")
        .expect("spec")
        .build(&Shape::flat(1024), 10)
        .expect("layers");
    let config = OptimizerConfig::Sgd {
        momentum: 0.8,
        weight_decay: 0.0,
    };
    let mut runs: Vec<(Stage, Optimizer)> = (0..2)
        .map(|_| {
            let mut stage = Stage::new(&layers, 0..layers.len(), 1, 1);
            stage.set_input_grad(true);
            let optimizer = Optimizer::new(config.clone(), stage.params().len());
            (stage, optimizer)
        })
        .collect();
    let x: Vec<f32> = (0..ROWS * 1024).map(|i| (i % 17) as f32 * 0.01).collect();
    let dy = vec![0.001f32; ROWS * 10];
    let pass = Pass {
        train: true,
        seed: 1,
        step: 0,
        row_offset: 0,
    };
    let mut times = [Vec::new(), Vec::new()];
    for step in 0..WARMUP + steps {
        for (k, (stage, optimizer)) in runs.iter_mut().enumerate() {
            let started = Instant::now();
            stage.forward(step, &x, ROWS, &pass).expect("forward");
            if k == 0 {
                stage
                    .backward_and_step(step, &dy, optimizer, 1e-4, &mut || {})
                    .expect("backward");
            } else {
                let step_with = Some((&mut *optimizer, 1e-4));
                stage
                    .backward_sending(step, &dy, step_with, &mut || {}, &mut |_| {})
                    .expect("backward");
            }
            if step >= WARMUP {
                times[k].push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    for (name, mut t) in ["fused", "split"].into_iter().zip(times) {
        t.sort_by(f64::total_cmp);
        println!(
            "{name}: median {:.3} ms, lower quartile {:.3} ms a step",
            t[t.len() / 2],
            t[t.len() / 4]
        );
    }
}
