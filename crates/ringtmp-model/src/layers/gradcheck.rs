//! Finite-difference and closed-form checks of every layer's backward pass.
//!
//! The objective is `L = Σ y ⊙ r` for a fixed random `r`, so `dL/dy = r` and the analytic
//! gradients come from one backward call. The layers compute in f32; the objective is summed in
//! f64 and the central difference uses a step chosen per layer: layers that are linear in the
//! perturbed value (linear, conv in both weights and inputs) have no truncation error, so a large
//! step makes rounding negligible; piecewise-linear layers (ReLU, max-pool) use inputs kept away
//! from their kinks and ties.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Aux, Layer, Pass};
use crate::shape::Shape;
use crate::spec::{LayerSpec, build_layer};

fn layer(spec: LayerSpec, input: Shape) -> Layer {
    let mut l = build_layer(0, &spec, &input).expect("valid test layer");
    l.init_gain = 2.0;
    l
}

struct Case {
    layer: Layer,
    params: Vec<f32>,
    x: Vec<f32>,
    r: Vec<f32>,
    n: usize,
}

impl Case {
    fn new(layer: Layer, n: usize, seed: u64, x_gen: impl Fn(&mut ChaCha8Rng) -> f32) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut params = vec![0.0; layer.param_count()];
        layer.init(&mut params, seed);
        // Non-zero biases so they are exercised too.
        for p in params.iter_mut().filter(|p| **p == 0.0) {
            *p = rng.random::<f32>() - 0.5;
        }
        let x = (0..n * layer.input.numel())
            .map(|_| x_gen(&mut rng))
            .collect();
        let r = (0..n * layer.output.numel())
            .map(|_| rng.random::<f32>() * 2.0 - 1.0)
            .collect();
        Self {
            layer,
            params,
            x,
            r,
            n,
        }
    }

    fn objective(&self, params: &[f32], x: &[f32]) -> f64 {
        let (mut y, mut aux) = (Vec::new(), Aux::default());
        let pass = Pass {
            train: true,
            seed: 7,
            step: 3,
            row_offset: 0,
        };
        self.layer
            .forward(params, x, self.n, &mut y, &mut aux, &pass, 1);
        y.iter()
            .zip(&self.r)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum()
    }

    fn analytic(&self) -> (Vec<f32>, Vec<f32>) {
        let (mut y, mut aux) = (Vec::new(), Aux::default());
        let pass = Pass {
            train: true,
            seed: 7,
            step: 3,
            row_offset: 0,
        };
        self.layer
            .forward(&self.params, &self.x, self.n, &mut y, &mut aux, &pass, 1);
        let mut grads = vec![f32::NAN; self.params.len()];
        let mut dx = Vec::new();
        let mut scratch = Vec::new();
        self.layer.backward(
            &self.params,
            &mut grads,
            false,
            &self.x,
            &y,
            &aux,
            &self.r,
            self.n,
            Some(&mut dx),
            &mut scratch,
            1,
        );
        (grads, dx)
    }

    /// Checks every parameter and input gradient against central differences with step `h`.
    fn check(&self, h: f32, tol: f64) {
        self.check_inputs(h, tol, true);
    }

    /// [`Case::check`], the inputs too when `inputs` (not for token ids, which have none).
    fn check_inputs(&self, h: f32, tol: f64, inputs: bool) {
        let (grads, dx) = self.analytic();
        let mut worst = 0.0f64;
        for i in 0..self.params.len() {
            let (mut plus, mut minus) = (self.params.clone(), self.params.clone());
            plus[i] += h;
            minus[i] -= h;
            let fd = (self.objective(&plus, &self.x) - self.objective(&minus, &self.x))
                / (2.0 * f64::from(h));
            let err = (fd - f64::from(grads[i])).abs() / fd.abs().max(1.0);
            worst = worst.max(err);
            assert!(
                err < tol,
                "{} param {i}: analytic {} vs numeric {fd}",
                self.layer.kind_name(),
                grads[i]
            );
        }
        for i in (0..self.x.len()).filter(|_| inputs) {
            let (mut plus, mut minus) = (self.x.clone(), self.x.clone());
            plus[i] += h;
            minus[i] -= h;
            let fd = (self.objective(&self.params, &plus) - self.objective(&self.params, &minus))
                / (2.0 * f64::from(h));
            let err = (fd - f64::from(dx[i])).abs() / fd.abs().max(1.0);
            worst = worst.max(err);
            assert!(
                err < tol,
                "{} input {i}: analytic {} vs numeric {fd}",
                self.layer.kind_name(),
                dx[i]
            );
        }
        println!(
            "{}: worst relative error {worst:.2e}",
            self.layer.kind_name()
        );
    }
}

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    rng.random::<f32>() * 2.0 - 1.0
}

/// Values at least 0.05 away from zero, so ReLU's kink is never crossed by the step.
fn away_from_zero(rng: &mut ChaCha8Rng) -> f32 {
    let v = 0.05 + rng.random::<f32>();
    if rng.random::<bool>() { v } else { -v }
}

#[test]
fn linear_gradients_match_finite_differences() {
    let l = layer(LayerSpec::Linear { out: 5, bias: true }, Shape::flat(7));
    Case::new(l, 3, 1, normal).check(0.25, 1e-4);
}

#[test]
fn a_linear_layer_over_a_sequence_runs_on_every_position() {
    // Three positions of 7 features to 5: the same weights at every position.
    let l = layer(LayerSpec::Linear { out: 5, bias: true }, Shape(vec![3, 7]));
    assert_eq!(l.output, Shape(vec![3, 5]));
    assert_eq!(l.param_count(), 5 * 7 + 5);
    assert_eq!(l.rows_for(2), 6);
    Case::new(l, 2, 1, normal).check(0.25, 1e-4);
    let e = super::cut_linear(
        &[layer(
            LayerSpec::Linear { out: 5, bias: true },
            Shape(vec![3, 7]),
        )],
        0,
        2,
    )
    .unwrap_err();
    assert!(e.to_string().contains("over a flat input"), "{e}");
}

#[test]
fn a_cut_linear_layers_head_and_tail_gradients_match_finite_differences() {
    let whole = layer(LayerSpec::Linear { out: 5, bias: true }, Shape::flat(7));
    for split in [1, 2, 4] {
        let cut = super::cut_linear(std::slice::from_ref(&whole), 0, split).unwrap();
        for part in cut {
            Case::new(part, 3, 1, normal).check(0.25, 1e-4);
        }
    }
}

#[test]
fn conv2d_gradients_match_finite_differences_with_stride_and_padding() {
    for (stride, padding) in [(1, 0), (2, 0), (2, 1), (1, 2)] {
        let l = layer(
            LayerSpec::Conv2d {
                out_channels: 3,
                kernel: 3,
                stride,
                padding,
            },
            Shape::image(5, 6, 2),
        );
        Case::new(l, 2, 2, normal).check(0.25, 1e-4);
    }
}

#[test]
fn norm_gradients_match_finite_differences_per_row_of_the_last_dimension() {
    // Two samples of three rows of 8: statistics per row, γ and β shared by every row.
    for spec in [
        LayerSpec::LayerNorm { eps: 1e-5 },
        LayerSpec::RmsNorm { eps: 1e-6 },
    ] {
        let l = layer(spec, Shape(vec![3, 8]));
        let mut case = Case::new(l, 2, 5, normal);
        // γ away from 1, so the check sees it scale.
        for (i, p) in case.params.iter_mut().take(8).enumerate() {
            *p = 0.5 + 0.1 * i as f32;
        }
        case.check(1e-2, 2e-3);
    }
}

#[test]
fn norms_normalise_each_row_as_pytorch_does() {
    let l = layer(LayerSpec::LayerNorm { eps: 1e-5 }, Shape(vec![2, 4]));
    let mut params = vec![0.0; 8];
    l.init(&mut params, 0);
    assert_eq!(params, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    let x = [1.0, 2.0, 3.0, 4.0, -2.0, 0.0, 2.0, 4.0];
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    l.forward(&params, &x, 1, &mut y, &mut aux, &Pass::eval(), 1);
    // torch.nn.functional.layer_norm([1, 2, 3, 4], [4]) = ±1.3416, ±0.4472.
    let expected = [-1.341_636, -0.447_212, 0.447_212, 1.341_636];
    for (a, b) in y[..4]
        .iter()
        .zip(expected)
        .chain(y[4..].iter().zip(expected))
    {
        assert!((a - b).abs() < 1e-5, "{y:?}");
    }
    let rms = layer(LayerSpec::RmsNorm { eps: 1e-5 }, Shape::flat(2));
    let mut params = vec![0.0; 2];
    rms.init(&mut params, 0);
    rms.forward(&params, &[3.0, 4.0], 1, &mut y, &mut aux, &Pass::eval(), 1);
    // rms = sqrt((9 + 16) / 2): [3, 4] / 3.5355.
    assert!(
        (y[0] - 0.848_528).abs() < 1e-5 && (y[1] - 1.131_371).abs() < 1e-5,
        "{y:?}"
    );
    assert_eq!(
        rms.param_tensors(),
        [("layers.0.weight".to_string(), vec![2])]
    );
}

#[test]
fn gelu_gradients_match_finite_differences_and_its_values_pytorchs() {
    let l = layer(LayerSpec::Gelu, Shape::flat(11));
    Case::new(l, 3, 6, |rng| (rng.random::<f32>() - 0.5) * 6.0).check(1e-2, 1e-3);
    let mut y = [0.0; 3];
    super::gelu_forward(&[-1.0, 0.5, 2.0], &mut y);
    // torch.nn.functional.gelu(x, approximate="tanh").
    for (a, b) in y.iter().zip([-0.158_808, 0.345_714, 1.954_598]) {
        assert!((a - b).abs() < 1e-5, "{y:?}");
    }
}

#[test]
fn causal_self_attention_gradients_match_finite_differences() {
    // Two samples of 5 positions of width 8 in 2 heads (d = 4); small weights keep the
    // softmax away from saturation, where a finite difference would say little.
    for heads in [1, 2] {
        let mut l = layer(LayerSpec::CausalSelfAttention { heads }, Shape(vec![5, 8]));
        l.init_gain = 1.0;
        let case = Case::new(l, 2, 8 + heads as u64, normal);
        case.check(1e-2, 2e-3);
    }
}

#[test]
fn attention_is_causal_and_the_same_on_any_thread_count() {
    let l = layer(
        LayerSpec::CausalSelfAttention { heads: 2 },
        Shape(vec![6, 8]),
    );
    let case = Case::new(l, 3, 11, normal);
    let run = |x: &[f32], threads: usize| {
        let (mut y, mut aux) = (Vec::new(), Aux::default());
        case.layer
            .forward(&case.params, x, 3, &mut y, &mut aux, &Pass::eval(), threads);
        y
    };
    let y = run(&case.x, 1);
    assert_eq!(y, run(&case.x, 4), "threads change nothing");
    // A change at position 4 of sample 1 moves that sample's positions 4 and 5 only.
    let mut x = case.x.clone();
    x[6 * 8 + 4 * 8 + 3] += 0.5;
    let moved = run(&x, 1);
    for (i, (a, b)) in y.iter().zip(&moved).enumerate() {
        let (sample, position) = (i / 48, i / 8 % 6);
        let may_move = sample == 1 && position >= 4;
        assert!(
            may_move || a == b,
            "value {i} (sample {sample}, position {position}) moved"
        );
    }
    assert!(y[48 + 4 * 8..48 + 6 * 8] != moved[48 + 4 * 8..48 + 6 * 8]);
    let names: Vec<String> = case
        .layer
        .param_tensors()
        .into_iter()
        .map(|t| t.0)
        .collect();
    assert_eq!(
        names,
        [
            "layers.0.c_attn.weight",
            "layers.0.c_attn.bias",
            "layers.0.c_proj.weight",
            "layers.0.c_proj.bias"
        ]
    );
}

#[test]
fn embedding_gradients_match_finite_differences_and_sum_over_repeated_tokens() {
    // Two samples of 6 token ids from a vocabulary of 5 (so ids repeat): their rows of `wte`
    // gather every position's gradient, `wpe`'s rows every sample's.
    let l = layer(
        LayerSpec::Embedding {
            vocab: 5,
            width: 3,
            positions: true,
        },
        Shape::flat(6),
    );
    let case = Case::new(l, 2, 12, |rng| (rng.random::<u32>() % 5) as f32);
    case.check_inputs(0.25, 1e-4, false);
    let (_, dx) = case.analytic();
    assert!(dx.iter().all(|&d| d == 0.0), "ids have no gradient");
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    case.layer.forward(
        &case.params,
        &[2.0, 0.0, 2.0, 4.0, 1.0, 3.0],
        1,
        &mut y,
        &mut aux,
        &Pass::eval(),
        1,
    );
    // Position 2's output: token 2's row plus position 2's row.
    let (wte, wpe) = case.params.split_at(15);
    for e in 0..3 {
        assert_eq!(y[2 * 3 + e], wte[2 * 3 + e] + wpe[2 * 3 + e]);
    }
}

#[test]
fn transformer_block_gradients_match_finite_differences() {
    // Two samples of 4 positions of width 8, 2 heads, an MLP of 16: every parameter of both
    // norms, the attention and the MLP, and every input, through both residuals.
    let mut l = layer(
        LayerSpec::Block {
            heads: 2,
            mlp_ratio: 2,
        },
        Shape(vec![4, 8]),
    );
    l.init_gain = 1.0;
    let mut case = Case::new(l, 2, 21, normal);
    // The projections' weights (GPT-2's 0.02) ten times larger, so that the MLP and the
    // attention are not hidden behind the residuals; γ stays 1, the biases and β random.
    for p in case.params.iter_mut().filter(|p| p.abs() < 0.1) {
        *p *= 10.0;
    }
    case.check(1e-2, 2e-3);
    let names = case.layer.param_tensors();
    assert_eq!(names.len(), 12);
    assert_eq!(
        names[8],
        ("layers.0.mlp.c_fc.weight".to_string(), vec![16, 8])
    );
    let total: usize = names.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(total, case.layer.param_count());
}

/// A Llama-family block of 4 positions of width 8 with 4 query heads over `kv_heads`
/// key/value heads of 4 values, an MLP of 12.
fn llama_block(kv_heads: usize, qkv_bias: bool, qk_norm: bool) -> Layer {
    use crate::layers::rope::RopeScaling;
    let mut l = layer(
        LayerSpec::LlamaBlock {
            heads: 4,
            kv_heads,
            head_dim: 4,
            hidden: 12,
            rope_theta: 10_000.0,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 2.0,
            }),
            eps: 1e-6,
            qkv_bias,
            qk_norm,
        },
        Shape(vec![4, 8]),
    );
    l.init_gain = 1.0;
    l
}

#[test]
fn llama_block_gradients_match_finite_differences() {
    // Grouped-query (2 key/value heads for 4), multi-query with Qwen 2's biases, and Qwen 3's
    // q/k norms: every parameter and every input, through RoPE, both residuals and SwiGLU.
    for (kv_heads, qkv_bias, qk_norm) in [(2, false, false), (1, true, false), (4, false, true)] {
        let mut case = Case::new(llama_block(kv_heads, qkv_bias, qk_norm), 2, 23, normal);
        // The projections (0.02) twenty times larger, so attention and the MLP are not hidden
        // behind the residuals; the gains kept near 1, away from it.
        for p in case.params.iter_mut() {
            if p.abs() < 0.1 {
                *p *= 20.0;
            } else if *p == 1.0 {
                *p = 0.8;
            }
        }
        case.check(1e-2, 3e-3);
        let total: usize = case
            .layer
            .param_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(total, case.layer.param_count());
    }
}

#[test]
fn a_llama_blocks_positions_are_causal_and_its_decode_its_forward() {
    let mut case = Case::new(llama_block(2, true, true), 1, 29, normal);
    for p in case.params.iter_mut().filter(|p| p.abs() < 0.1) {
        *p *= 20.0;
    }
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    let x = case.x.clone();
    case.layer
        .forward(&case.params, &x, 1, &mut y, &mut aux, &Pass::eval(), 1);
    // Changing the last position changes no earlier output.
    let mut later = x.clone();
    later[3 * 8] += 1.0;
    let (mut y2, mut aux2) = (Vec::new(), Aux::default());
    case.layer.forward(
        &case.params,
        &later,
        1,
        &mut y2,
        &mut aux2,
        &Pass::eval(),
        1,
    );
    assert_eq!(y[..3 * 8], y2[..3 * 8]);
    assert_ne!(y[3 * 8..], y2[3 * 8..]);
    // Decoding one position and then three gives the forward's rows.
    let crate::LayerKind::LlamaBlock(b) = &case.layer.kind else {
        unreachable!()
    };
    let mut cache = super::KeyValues::default();
    let (mut out, mut scratch) = (vec![0.0; 4 * 8], Vec::new());
    b.decode(
        crate::packed::Params::Flat(&case.params),
        &x[..8],
        1,
        0,
        &mut cache,
        &mut out[..8],
        &mut scratch,
        1,
    );
    b.decode(
        crate::packed::Params::Flat(&case.params),
        &x[8..],
        3,
        1,
        &mut cache,
        &mut out[8..],
        &mut scratch,
        1,
    );
    for (a, b) in out.iter().zip(&y) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn relu_gradients_match_finite_differences() {
    let l = layer(LayerSpec::Relu, Shape::flat(11));
    Case::new(l, 3, 3, away_from_zero).check(0.01, 1e-4);
}

#[test]
fn max_pool_gradients_match_finite_differences() {
    for stride in [None, Some(1)] {
        let l = layer(
            LayerSpec::MaxPool2d { kernel: 2, stride },
            Shape::image(4, 5, 3),
        );
        // Distinct values spaced well apart: no ties, and a small step never changes a winner.
        let case = Case::new(l, 2, 4, normal);
        let mut c = case;
        for (i, v) in c.x.iter_mut().enumerate() {
            *v = ((i * 7919) % 97) as f32 * 0.1;
        }
        c.check(0.01, 1e-4);
    }
}

#[test]
fn dropout_gradients_match_finite_differences_and_mask_is_scaled() {
    let l = layer(LayerSpec::Dropout { p: 0.5 }, Shape::flat(64));
    let case = Case::new(l, 4, 5, normal);
    case.check(0.25, 1e-4);
    let (_, dx) = case.analytic();
    let kept = dx.iter().filter(|v| **v != 0.0).count();
    assert!((64..192).contains(&kept), "kept {kept} of 256 at p = 0.5");
    for (d, r) in dx.iter().zip(&case.r) {
        assert!(*d == 0.0 || (d - 2.0 * r).abs() < 1e-6);
    }
}

#[test]
fn flatten_passes_gradients_through() {
    let l = layer(LayerSpec::Flatten, Shape::image(2, 3, 2));
    Case::new(l, 2, 6, normal).check(0.25, 1e-5);
}

#[test]
fn linear_closed_form() {
    // W = [[1, 2], [3, 4], [5, 6]], b = [0.5, -0.5, 1], x = [1, -1] → y = [-0.5, -1.5, 0].
    let l = layer(LayerSpec::Linear { out: 3, bias: true }, Shape::flat(2));
    let p = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, -0.5, 1.0];
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    l.forward(&p, &[1.0, -1.0], 1, &mut y, &mut aux, &Pass::eval(), 1);
    assert_eq!(y, [-0.5, -1.5, 0.0]);
    let (mut g, mut dx, mut s) = (vec![0.0; 9], Vec::new(), Vec::new());
    l.backward(
        &p,
        &mut g,
        false,
        &[1.0, -1.0],
        &y,
        &aux,
        &[1.0, 0.0, 2.0],
        1,
        Some(&mut dx),
        &mut s,
        1,
    );
    assert_eq!(g, [1.0, -1.0, 0.0, 0.0, 2.0, -2.0, 1.0, 0.0, 2.0]);
    assert_eq!(dx, [11.0, 14.0]);
}

#[test]
fn conv2d_closed_form_box_filter() {
    // A 2×2 all-ones kernel over a 3×3 image of 1..9 sums each window.
    let l = layer(
        LayerSpec::Conv2d {
            out_channels: 1,
            kernel: 2,
            stride: 1,
            padding: 0,
        },
        Shape::image(3, 3, 1),
    );
    let p = [1.0, 1.0, 1.0, 1.0, 0.0];
    let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    l.forward(&p, &x, 1, &mut y, &mut aux, &Pass::eval(), 1);
    assert_eq!(y, [12.0, 16.0, 24.0, 28.0]);
    let (mut g, mut dx, mut s) = (vec![0.0; 5], Vec::new(), Vec::new());
    l.backward(
        &p,
        &mut g,
        false,
        &x,
        &y,
        &aux,
        &[1.0; 4],
        1,
        Some(&mut dx),
        &mut s,
        1,
    );
    // Each input pixel's gradient counts the windows that contain it.
    assert_eq!(dx, [1.0, 2.0, 1.0, 2.0, 4.0, 2.0, 1.0, 2.0, 1.0]);
    assert_eq!(g, [12.0, 16.0, 24.0, 28.0, 4.0]);
}

#[test]
fn max_pool_closed_form_routes_gradient_to_the_maximum() {
    let l = layer(
        LayerSpec::MaxPool2d {
            kernel: 2,
            stride: None,
        },
        Shape::image(2, 4, 1),
    );
    let x = [1.0, 5.0, 2.0, 0.0, 3.0, 4.0, 8.0, 7.0];
    let (mut y, mut aux) = (Vec::new(), Aux::default());
    l.forward(&[], &x, 1, &mut y, &mut aux, &Pass::eval(), 1);
    assert_eq!(y, [5.0, 8.0]);
    let (mut dx, mut s) = (Vec::new(), Vec::new());
    l.backward(
        &[],
        &mut [],
        false,
        &x,
        &y,
        &aux,
        &[1.0, 2.0],
        1,
        Some(&mut dx),
        &mut s,
        1,
    );
    assert_eq!(dx, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]);
}

#[test]
fn initialisation_depends_only_on_seed_and_layer_index() {
    let l = layer(
        LayerSpec::Linear {
            out: 64,
            bias: true,
        },
        Shape::flat(100),
    );
    let (mut a, mut b) = (vec![0.0; l.param_count()], vec![0.0; l.param_count()]);
    l.init(&mut a, 9);
    l.init(&mut b, 9);
    assert_eq!(a, b);
    let mean = a[..6400].iter().map(|v| f64::from(*v)).sum::<f64>() / 6400.0;
    let var = a[..6400]
        .iter()
        .map(|v| (f64::from(*v) - mean).powi(2))
        .sum::<f64>()
        / 6400.0;
    // The helper sets He's gain: std = sqrt(2/100).
    assert!(
        mean.abs() < 0.01 && (var.sqrt() - 0.02f64.sqrt()).abs() < 0.01,
        "mean {mean} std {}",
        var.sqrt()
    );
    assert!(a[6400..].iter().all(|v| *v == 0.0), "biases start at zero");
}
