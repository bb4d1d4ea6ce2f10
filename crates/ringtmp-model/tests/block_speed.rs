//! How fast the transformer block trains, forward and backward, at `gpt-cpu`'s dimensions
//! (context 64, width 128, 4 heads, batch 12) and `gpt-small`'s (256, 384, 6; batch 4), on 1
//! and 2 threads: the best of 5 runs. A measurement, not a check (ignored by default):
//!
//! ```sh
//! cargo test --release -p ringtmp-model --test block_speed -- --ignored --nocapture
//! python3 benches/reference/block_speed.py    # PyTorch's block, the same dimensions
//! ```

use ringtmp_model::layers::{Aux, Pass};
use ringtmp_model::spec::build_layer;
use ringtmp_model::{LayerSpec, Shape};

#[test]
#[ignore]
fn block_speed() {
    // (positions, width, heads, samples)
    for (t, c, h, n) in [(64usize, 128usize, 4usize, 12usize), (256, 384, 6, 4)] {
        let layer = build_layer(
            0,
            &LayerSpec::Block {
                heads: h,
                mlp_ratio: 4,
            },
            &Shape(vec![t, c]),
        )
        .unwrap();
        let mut params = vec![0.0; layer.param_count()];
        layer.init(&mut params, 1);
        let x: Vec<f32> = (0..n * t * c)
            .map(|i| ((i % 97) as f32 / 97.0) - 0.5)
            .collect();
        let dy = x.clone();
        let (mut y, mut aux, mut dx, mut scratch) =
            (Vec::new(), Aux::default(), Vec::new(), Vec::new());
        let mut grads = vec![0.0; params.len()];
        for threads in [1, 2] {
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                layer.forward(&params, &x, n, &mut y, &mut aux, &Pass::eval(), threads);
                layer.backward(
                    &params,
                    &mut grads,
                    false,
                    &x,
                    &y,
                    &aux,
                    &dy,
                    n,
                    Some(&mut dx),
                    &mut scratch,
                    threads,
                );
                best = best.min(t0.elapsed().as_secs_f64());
            }
            println!(
                "T={t} C={c} H={h} n={n} threads={threads}: {:.2} ms per fwd+bwd, {:.0} tokens/s",
                best * 1e3,
                (n * t) as f64 / best
            );
        }
    }
}
