//! The transformer block against PyTorch's: nanoGPT's `Block` (GELU in its tanh form) run by
//! `benches/reference/block_parity.py`, whose outputs, input gradient and parameter gradients are
//! kept in `tests/golden/block_torch.json`. Both sides make the same inputs and parameters from a
//! formula (the sine of the index in f64, rounded to f32), in GPT-2's tensor order and layouts
//! (a linear weight `[out, in]`, the attention's `qkv` as queries, keys, values side by side).

use ringtmp_model::layers::{Aux, Pass};
use ringtmp_model::spec::build_layer;
use ringtmp_model::{LayerSpec, Shape};

fn values(count: usize, salt: f64, scale: f64, offset: f64) -> Vec<f32> {
    (0..count)
        .map(|i| ((i as f64 * 0.37 + salt).sin() * scale + offset) as f32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// The largest difference relative to the largest magnitude of `want`. Here every tensor agrees
/// to 6e-7; with other values a bias gradient, a sum over every row with cancellation (the keys'
/// bias gradient is zero in exact arithmetic: softmax ignores a shift of all scores), was seen at
/// 3e-5 of its tensor's largest value: hence 1e-4.
fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn the_transformer_block_computes_what_pytorch_computes() {
    let golden: serde_json::Value = serde_json::from_str(include_str!("golden/block_torch.json"))
        .expect("the golden file parses");
    let n = golden["samples"].as_u64().unwrap() as usize;
    let (t, c) = (
        golden["seq"].as_u64().unwrap() as usize,
        golden["width"].as_u64().unwrap() as usize,
    );
    let spec = LayerSpec::Block {
        heads: golden["heads"].as_u64().unwrap() as usize,
        mlp_ratio: golden["mlp_ratio"].as_u64().unwrap() as usize,
    };
    let layer = build_layer(0, &spec, &Shape(vec![t, c])).unwrap();
    // The parameters, tensor by tensor in the layer's order, as the script makes them.
    let mut params = Vec::new();
    for (k, (name, shape)) in layer.param_tensors().iter().enumerate() {
        let count: usize = shape.iter().product();
        let is_gamma = name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight");
        let (scale, offset) = match () {
            _ if is_gamma => (0.1, 1.0),
            _ if name.ends_with(".weight") => (0.3, 0.0),
            _ => (0.1, 0.0),
        };
        params.extend(values(count, 1.0 + k as f64, scale, offset));
    }
    assert_eq!(params.len(), layer.param_count());
    let x = values(n * t * c, 0.5, 1.0, 0.0);
    let r = values(n * t * c, 5.0, 1.0, 0.0);
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    layer.forward(&params, &x, n, &mut y, &mut aux, &Pass::eval(), 2);
    let mut grads = vec![0.0; params.len()];
    let (mut dx, mut scratch) = (Vec::new(), Vec::new());
    layer.backward(
        &params,
        &mut grads,
        false,
        &x,
        &y,
        &aux,
        &r,
        n,
        Some(&mut dx),
        &mut scratch,
        2,
    );
    let worst = |what: &str, got: &[f32], want: &[f32]| {
        let d = rel_diff(got, want);
        println!("{what}: {d:.2e}");
        assert!(d < 1e-4, "{what} differs from PyTorch's by {d:.2e}");
    };
    worst("output", &y, &floats(&golden["y"]));
    worst("input gradient", &dx, &floats(&golden["dx"]));
    let mut at = 0;
    for (name, shape) in layer.param_tensors() {
        let count: usize = shape.iter().product();
        let key = name.trim_start_matches("layers.0.");
        worst(key, &grads[at..at + count], &floats(&golden["grads"][key]));
        at += count;
    }
}
