//! RoPE against `transformers`' Llama rotary embedding (`benches/reference/rope_golden.py`):
//! the frequencies (default, linear and Llama 3 scaling) and the rotated queries, at positions
//! near the start and far out.

use ringtmp_model::layers::rope::{Rope, RopeScaling};

#[test]
fn frequencies_and_rotations_are_transformers() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/reference/rope/rope.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let (heads, head_dim) = (
        golden["heads"].as_u64().unwrap() as usize,
        golden["head_dim"].as_u64().unwrap() as usize,
    );
    let positions: Vec<usize> = golden["positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap() as usize)
        .collect();
    // transformers' q is [batch 1, heads, seq, head_dim]; ours is rows of [heads, head_dim].
    let q = floats(&golden["q"]);
    let to_rows = |v: &[f32]| -> Vec<f32> {
        let seq = positions.len();
        let mut out = vec![0.0; v.len()];
        for h in 0..heads {
            for s in 0..seq {
                for i in 0..head_dim {
                    out[(s * heads + h) * head_dim + i] = v[(h * seq + s) * head_dim + i];
                }
            }
        }
        out
    };
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let scaling = match case["rope_scaling"]["rope_type"].as_str() {
            None => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: case["rope_scaling"]["factor"].as_f64().unwrap(),
            }),
            Some(_) => {
                let s = &case["rope_scaling"];
                Some(RopeScaling::Llama3 {
                    factor: s["factor"].as_f64().unwrap(),
                    low_freq_factor: s["low_freq_factor"].as_f64().unwrap(),
                    high_freq_factor: s["high_freq_factor"].as_f64().unwrap(),
                    original_max_position_embeddings: s["original_max_position_embeddings"]
                        .as_f64()
                        .unwrap(),
                })
            }
        };
        let rope = Rope::new(
            head_dim,
            case["rope_theta"].as_f64().unwrap(),
            scaling.as_ref(),
        );
        for (ours, theirs) in rope.inv_freq.iter().zip(floats(&case["inv_freq"])) {
            assert!(
                (ours - theirs).abs() <= 2e-6 * theirs.abs(),
                "{name}: frequency {ours} vs {theirs}"
            );
        }
        let mut x = to_rows(&q);
        rope.apply(&mut x, &positions, false);
        let expected = to_rows(&floats(&case["rotated"]));
        let worst = x
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("{name}: largest difference from transformers {worst:.2e}");
        // Measured: 2.4e-7 at most, positions up to 70,000 included (f32 angles and their
        // sines as torch's).
        assert!(worst < 1e-5, "{name}: {worst}");
    }
}
