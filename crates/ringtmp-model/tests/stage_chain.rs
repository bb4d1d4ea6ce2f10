//! Oracle test for stages: a model split into 2, 3 and 4 stages and chained by hand, with several
//! micro-batches in flight and their backwards in scrambled order, gives the same outputs, input
//! gradients and parameter gradients as the unsplit model on the whole mini-batch.

use ringtmp_model::{
    Layer, LayerSpec, ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage, loss,
};

const MODEL: &str = r#"
name = "chain-test"
[[layer]]
type = "conv2d"
out_channels = 4
kernel = 3
padding = 1
[[layer]]
type = "relu"
[[layer]]
type = "max_pool2d"
kernel = 2
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 32
[[layer]]
type = "relu"
[[layer]]
type = "dropout"
p = 0.3
[[layer]]
type = "linear"
out = 16
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 10
"#;

const SEED: u64 = 11;
const ROWS: usize = 12;
const MICRO: usize = 3;

fn layers() -> Vec<Layer> {
    build(MODEL)
}

/// A model spec's layers for 8×8 one-channel inputs and 10 classes.
fn build(spec: &str) -> Vec<Layer> {
    ModelSpec::from_toml(spec, "stage-chain")
        .unwrap()
        .build(&Shape::image(8, 8, 1), 10)
        .unwrap()
}

/// Linear layers wide enough to be updated in several blocks (see the step-in-backward test).
fn wide_layers() -> Vec<Layer> {
    let spec = r#"
name = "wide"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 1100
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 300
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 10
"#;
    build(spec)
}

fn data() -> (Vec<f32>, Vec<u32>) {
    let x = (0..ROWS * 64)
        .map(|i| ((i * 7919 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let labels = (0..ROWS).map(|i| (i * 7 % 10) as u32).collect();
    (x, labels)
}

struct Result {
    logits: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<f32>,
}

fn unsplit() -> Result {
    let layers = layers();
    let mut model = Stage::new(&layers, 0..layers.len(), SEED, 1);
    model.set_input_grad(true);
    let (x, labels) = data();
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 5,
        row_offset: 0,
    };
    let logits = model.forward(0, &x, ROWS, &pass).unwrap().to_vec();
    let mut dlogits = vec![0.0; logits.len()];
    loss::softmax_cross_entropy(&logits, &labels, 10, 1.0 / ROWS as f32, &mut dlogits).unwrap();
    let dx = model.backward(0, &dlogits).unwrap().unwrap().to_vec();
    Result {
        logits,
        dx,
        grads: model.grads().to_vec(),
    }
}

fn chained(bounds: &[usize]) -> Result {
    chained_with(bounds, false)
}

fn chained_with(bounds: &[usize], defer: bool) -> Result {
    chained_on(&layers(), bounds, defer)
}

fn chained_on(layers: &[Layer], bounds: &[usize], defer: bool) -> Result {
    let mut stages: Vec<Stage> = bounds
        .windows(2)
        .map(|w| Stage::new(layers, w[0]..w[1], SEED, 2))
        .collect();
    stages[0].set_input_grad(true);
    for s in stages.iter_mut() {
        s.set_deferred_weight_grads(defer);
    }
    let (x, labels) = data();
    let rows = ROWS / MICRO;
    let mut logits = vec![];
    let mut dlogits_per_mb = vec![];
    // All forwards first (every micro-batch in flight on every stage at once).
    for mb in 0..MICRO {
        let pass = Pass {
            train: true,
            seed: SEED,
            step: 5,
            row_offset: mb * rows,
        };
        let mut act = x[mb * rows * 64..(mb + 1) * rows * 64].to_vec();
        for stage in stages.iter_mut() {
            act = stage
                .forward(mb as u64, &act, rows, &pass)
                .unwrap()
                .to_vec();
        }
        let mut d = vec![0.0; act.len()];
        let l = &labels[mb * rows..(mb + 1) * rows];
        loss::softmax_cross_entropy(&act, l, 10, 1.0 / ROWS as f32, &mut d).unwrap();
        logits.extend_from_slice(&act);
        dlogits_per_mb.push(d);
    }
    for stage in &stages {
        assert_eq!(stage.in_flight(), MICRO);
    }
    // Backwards in a scrambled order: 2, 0, 1.
    let mut dx = vec![0.0; ROWS * 64];
    for mb in [2usize, 0, 1] {
        let mut grad = dlogits_per_mb[mb].clone();
        for stage in stages.iter_mut().rev() {
            grad = stage.backward(mb as u64, &grad).unwrap().unwrap().to_vec();
        }
        dx[mb * rows * 64..(mb + 1) * rows * 64].copy_from_slice(&grad);
    }
    let grads = stages.iter_mut().flat_map(|s| s.grads().to_vec()).collect();
    Result { logits, dx, grads }
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0.0f64, |m, v| m.max(f64::from(v.abs())))
        .max(1e-12);
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn chained_stages_equal_the_unsplit_model() {
    let oracle = unsplit();
    let n = layers().len();
    for bounds in [vec![0, 4, n], vec![0, 2, 7, n], vec![0, 1, 5, 8, n]] {
        let got = chained(&bounds);
        let d_logits = max_rel_diff(&got.logits, &oracle.logits);
        let d_dx = max_rel_diff(&got.dx, &oracle.dx);
        let d_grads = max_rel_diff(&got.grads, &oracle.grads);
        println!(
            "{} stages {bounds:?}: max |Δ|/max|ref| logits {d_logits:.1e}, input grads {d_dx:.1e}, param grads {d_grads:.1e}",
            bounds.len() - 1
        );
        assert!(
            d_logits < 1e-5 && d_dx < 1e-5 && d_grads < 1e-5,
            "stages {bounds:?} differ"
        );
    }
}

#[test]
fn partitioned_stages_start_bit_identical_to_the_whole_model() {
    let layers = layers();
    let whole = Stage::new(&layers, 0..layers.len(), SEED, 1);
    let parts: Vec<f32> = [0..3, 3..6, 6..layers.len()]
        .into_iter()
        .flat_map(|r| Stage::new(&layers, r, SEED, 1).params().to_vec())
        .collect();
    assert_eq!(whole.params(), &parts[..]);
}

#[test]
fn backward_of_unknown_micro_batch_is_an_error_and_changes_nothing() {
    let layers = layers();
    let mut stage = Stage::new(&layers, 0..layers.len(), SEED, 1);
    let (x, _) = data();
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 0,
        row_offset: 0,
    };
    stage.forward(1, &x, ROWS, &pass).unwrap();
    let err = stage.backward(9, &vec![0.0; ROWS * 10]).unwrap_err();
    assert!(err.to_string().contains("micro-batch 9"), "{err}");
    let err = stage.backward(1, &[0.0; 3]).unwrap_err();
    assert!(
        err.to_string().contains("expected 120 values, got 3"),
        "{err}"
    );
    assert_eq!(
        stage.in_flight(),
        1,
        "failed calls leave the stash as it was"
    );
    assert!(
        stage.forward(1, &x, ROWS, &pass).is_err(),
        "an id already in flight is refused"
    );
}

#[test]
fn whole_model_gradient_matches_finite_differences_of_the_loss() {
    let layers = layers();
    let mut model = Stage::new(&layers, 0..layers.len(), SEED, 1);
    let (x, labels) = data();
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 1,
        row_offset: 0,
    };
    let loss_at = |model: &mut Stage| -> f64 {
        let logits = model.forward(99, &x, ROWS, &pass).unwrap().to_vec();
        model.clear_in_flight();
        let mut d = vec![0.0; logits.len()];
        loss::softmax_cross_entropy(&logits, &labels, 10, 1.0, &mut d)
            .unwrap()
            .loss_sum
            / ROWS as f64
    };
    let logits = model.forward(0, &x, ROWS, &pass).unwrap().to_vec();
    let mut d = vec![0.0; logits.len()];
    loss::softmax_cross_entropy(&logits, &labels, 10, 1.0 / ROWS as f32, &mut d).unwrap();
    model.backward(0, &d).unwrap();
    let grads = model.grads().to_vec();
    // Sample parameters across every layer. ReLU and max-pool make the loss piecewise smooth: a
    // central difference whose step crosses a kink is wrong, so a parameter counts only when the
    // differences at h and h/2 agree (no kink within h); most do.
    let fd_at = |model: &mut Stage, i: usize, h: f32| {
        let orig = model.params()[i];
        model.params_mut()[i] = orig + h;
        let up = loss_at(model);
        model.params_mut()[i] = orig - h;
        let down = loss_at(model);
        model.params_mut()[i] = orig;
        (up - down) / (2.0 * f64::from(h))
    };
    let (mut worst, mut checked) = (0.0f64, 0);
    for i in (0..grads.len()).step_by(17) {
        let (fd, fd_half) = (fd_at(&mut model, i, 4e-3), fd_at(&mut model, i, 2e-3));
        if (fd - fd_half).abs() > 1e-4 {
            continue;
        }
        checked += 1;
        let err = (fd - f64::from(grads[i])).abs();
        worst = worst.max(err);
        assert!(err < 2e-4, "param {i}: analytic {} numeric {fd}", grads[i]);
    }
    assert!(
        checked * 10 > grads.len() / 17 * 9,
        "only {checked} smooth parameters checked"
    );
    println!("whole model: {checked} parameters, worst absolute gradient error {worst:.2e}");
}

#[test]
fn weight_stashing_backward_uses_the_forward_weights() {
    // PipeDream: a micro-batch's backward must see the weights its forward saw, even after the
    // stage stepped in between.
    let layers = layers();
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 0,
        row_offset: 0,
    };
    let dy = vec![0.05f32; ROWS * 10];
    let opt_cfg = ringtmp_model::OptimizerConfig::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    // Reference: forward and backward with no step in between.
    let mut plain = Stage::new(&layers, 4..layers.len(), SEED, 1);
    plain.set_input_grad(true);
    let x4: Vec<f32> = vec![0.3; ROWS * plain.input_len()];
    plain.forward(0, &x4, ROWS, &pass).unwrap();
    let want = plain.backward(0, &dy).unwrap().unwrap().to_vec();
    // Stashed: forward mb 0, forward mb 1, backward mb 1 and step, then backward mb 0.
    let mut stashed = Stage::new(&layers, 4..layers.len(), SEED, 1);
    stashed.set_input_grad(true);
    stashed.set_weight_stashing(true);
    let mut opt = ringtmp_model::Optimizer::new(opt_cfg.clone(), stashed.params().len());
    stashed.forward(0, &x4, ROWS, &pass).unwrap();
    stashed.forward(1, &x4, ROWS, &pass).unwrap();
    stashed.backward(1, &dy).unwrap();
    stashed.step(&mut opt, 0.5);
    assert_eq!(
        stashed.weight_versions(),
        2,
        "mb 0 keeps the old weights alive"
    );
    let got = stashed.backward(0, &dy).unwrap().unwrap().to_vec();
    assert_eq!(got, want, "backward of mb 0 used its forward's weights");
    assert_eq!(
        stashed.weight_versions(),
        1,
        "the old version is freed after its last backward"
    );
    // Without stashing the same sequence sees the new weights and differs.
    let mut unstashed = Stage::new(&layers, 4..layers.len(), SEED, 1);
    unstashed.set_input_grad(true);
    let mut opt = ringtmp_model::Optimizer::new(opt_cfg, unstashed.params().len());
    unstashed.forward(0, &x4, ROWS, &pass).unwrap();
    unstashed.forward(1, &x4, ROWS, &pass).unwrap();
    unstashed.backward(1, &dy).unwrap();
    unstashed.step(&mut opt, 0.5);
    assert_ne!(unstashed.backward(0, &dy).unwrap().unwrap().to_vec(), want);
}

#[test]
fn deferred_weight_gradients_equal_the_unsplit_model() {
    let oracle = unsplit();
    let n = layers().len();
    for bounds in [vec![0, 4, n], vec![0, 1, 5, 8, n]] {
        let got = chained_with(&bounds, true);
        let d = max_rel_diff(&got.grads, &oracle.grads);
        println!("deferred, stages {bounds:?}: max |Δ|/max|ref| param grads {d:.1e}");
        assert!(d < 1e-5 && max_rel_diff(&got.dx, &oracle.dx) < 1e-5);
    }
    // Cut inside layers 4 (after 12 of 32 outputs) and 7 (after 6 of 16): the parts defer
    // their weight gradients too (one GEMM over the mini-batch's rows of `x` and their own
    // output gradient), against the same stages without deferral, heads ending stages.
    let cut = {
        let once = ringtmp_model::layers::cut_linear(&layers(), 7, 6).unwrap();
        ringtmp_model::layers::cut_linear(&once, 4, 12).unwrap()
    };
    let n = cut.len();
    for bounds in [vec![0, 5, 9, n], vec![0, n]] {
        let plain = chained_on(&cut, &bounds, false);
        let got = chained_on(&cut, &bounds, true);
        let d = max_rel_diff(&got.grads, &plain.grads);
        println!("deferred, cut, stages {bounds:?}: max |Δ|/max|ref| param grads {d:.1e}");
        assert!(d < 1e-5 && max_rel_diff(&got.dx, &plain.dx) < 1e-5, "{d}");
        assert_eq!(got.logits, plain.logits);
    }
}

// Within one stage a conv → ReLU → max-pool runs fused (the ReLU and the pool applied to each
// group of the conv's output while in cache, the pool's gradient scattered into each group's in
// the backward, neither the conv's nor the ReLU's output ever kept), and a conv → ReLU whose pool
// is in the next stage fuses the ReLU alone. Cut apart, the layers run one by one. Every way
// gives the same bits — outputs, input gradients, parameter gradients — at one and two threads,
// for the GEMM path (padding) and the direct kernels (none) with several groups, with pooling
// windows apart and overlapping; and the fused stages keep less.
#[test]
fn fused_conv_relu_and_pool_equal_the_layers_apart_bit_for_bit() {
    const FUSED: &str = r#"
name = "fused-test"
[[layer]]
type = "conv2d"
out_channels = 6
kernel = KERNEL
padding = PADDING
[[layer]]
type = "relu"
[[layer]]
type = "max_pool2d"
kernel = POOL
stride = 2
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 10
"#;
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 0,
        row_offset: 0,
    };
    let rows = 40;
    // (kernel, padding): im2col + GEMM in groups of 12 samples; the direct kernels.
    for (kernel, padding) in [(5, 2), (3, 0)] {
        for pool in [2, 3] {
            let toml = FUSED
                .replace("KERNEL", &kernel.to_string())
                .replace("PADDING", &padding.to_string())
                .replace("POOL", &pool.to_string());
            let layers = ModelSpec::from_toml(&toml, "fused-test")
                .unwrap()
                .build(&Shape::image(12, 12, 3), 10)
                .unwrap();
            // Every fifth sample blank: its windows pool to zero (the biases start at zero),
            // so the pooled gradient is masked there.
            let x: Vec<f32> = (0..rows * 12 * 12 * 3)
                .map(|i| match i / (12 * 12 * 3) % 5 {
                    0 => 0.0,
                    _ => ((i * 7919 % 101) as f32 / 50.0) - 1.0,
                })
                .collect();
            for threads in [1, 2] {
                let what = format!("kernel {kernel}, padding {padding}, pool {pool}, {threads}t");
                let stages = |cuts: &[usize]| -> Vec<Stage> {
                    cuts.windows(2)
                        .map(|w| {
                            let mut stage = Stage::new(&layers, w[0]..w[1], SEED, threads);
                            stage.set_input_grad(true);
                            stage
                        })
                        .collect()
                };
                let mut ways = [stages(&[0, 3]), stages(&[0, 2, 3]), stages(&[0, 1, 2, 3])];
                let mut outputs = Vec::new();
                let mut inputs = Vec::new();
                for way in &mut ways {
                    let mut h = x.clone();
                    let mut acts = Vec::new();
                    for stage in way.iter_mut() {
                        h = stage.forward(0, &h, rows, &pass).unwrap().to_vec();
                        acts.push(h.clone());
                    }
                    outputs.push(h);
                    inputs.push(acts);
                }
                let y = &outputs[0];
                let zeros = y.iter().filter(|v| **v == 0.0).count();
                assert!(zeros > 0 && zeros < y.len(), "{what}: pooled zeros {zeros}");
                for (k, other) in outputs.iter().enumerate().skip(1) {
                    assert_eq!(bits(y), bits(other), "{what}: outputs, way {k}");
                }
                // Kept per way: the input, the pooled output and its indices (u32), plus, by
                // the layers each cut makes visible, the conv's and the ReLU's outputs.
                let conv_out = inputs[2][0].len() * 4;
                let kept: Vec<usize> = ways
                    .iter()
                    .map(|w| w.iter().map(Stage::stash_bytes).sum())
                    .collect();
                assert_eq!(kept[1], kept[0] + 2 * conv_out, "{what}: relu fused alone");
                assert_eq!(kept[2], kept[0] + 4 * conv_out, "{what}: nothing fused");

                let dy: Vec<f32> = (0..y.len())
                    .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let mut input_grads = Vec::new();
                for way in &mut ways {
                    let mut g = dy.clone();
                    for stage in way.iter_mut().rev() {
                        g = stage.backward(0, &g).unwrap().unwrap().to_vec();
                    }
                    input_grads.push(g);
                }
                for k in 1..3 {
                    assert_eq!(
                        bits(&input_grads[0]),
                        bits(&input_grads[k]),
                        "{what}: input gradients, way {k}"
                    );
                    assert_eq!(
                        bits(ways[0][0].grads()),
                        bits(ways[k][0].grads()),
                        "{what}: parameter gradients, way {k}"
                    );
                }
            }
        }
    }
}

// The step taken inside the backward (each layer updated right after its own backward) equals
// the backward followed by the step, bit for bit: parameters, optimizer state (seen through the
// next steps), input gradients and outputs, for SGD with momentum and Adam, at one and two
// threads, with and without weight stashing — with stashing, a micro-batch kept in flight
// across each step holds the current version, so the update goes to the next one, and that
// micro-batch's backward then reads the version its forward used.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one comparison over every layer kind and optimizer"
)]
fn a_step_inside_the_backward_equals_backward_then_step_bit_for_bit() {
    use ringtmp_model::{Optimizer, OptimizerConfig};
    let (x, labels) = data();
    // The chain-test model's linear layers are one block of `Optimizer::update_blocks` each;
    // the wide one's are two (1,100 rows of 64 inputs: 1,024 + 76) and five (300 rows of 1,100:
    // 4 × 64 + 44), so blocks, their tails and threads sharing them are all exercised.
    // The wide model with two layers cut inside (`cut_linear`): its parts take the same fused
    // update and split backward as whole linear layers, on their gathered operands — the 1100→300
    // layer after 128 outputs (a tail of 172 rows: three blocks), the 64→1100 after 1,024.
    let cut = {
        let wide = wide_layers();
        let once = ringtmp_model::layers::cut_linear(&wide, 3, 128).unwrap();
        ringtmp_model::layers::cut_linear(&once, 1, 1024).unwrap()
    };
    for layers in [layers(), wide_layers(), cut] {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let configs = [
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 1e-3,
            },
            OptimizerConfig::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-3,
            },
        ];
        let half = ROWS / 2 * 64;
        for config in configs {
            for threads in [1, 2] {
                for stashing in [false, true] {
                    let what = format!("{config:?}, {threads} thread(s), stashing {stashing}");
                    // 0: the step inside the backward; 1: backward, then step; 2: both split,
                    // the input gradient handed out before the weights (`backward_sending`).
                    let mut stages = [0, 1, 2].map(|_| {
                        let mut stage = Stage::new(&layers, 0..layers.len(), SEED, threads);
                        stage.set_input_grad(true);
                        stage.set_weight_stashing(stashing);
                        stage
                    });
                    let mut optimizers =
                        [0, 1, 2].map(|_| Optimizer::new(config.clone(), stages[0].params().len()));
                    for step in 0..6u64 {
                        let mut input_grads = Vec::new();
                        for (k, (stage, optimizer)) in
                            stages.iter_mut().zip(&mut optimizers).enumerate()
                        {
                            let pass = |row_offset| Pass {
                                train: true,
                                seed: SEED,
                                step,
                                row_offset,
                            };
                            // Two micro-batches of half the rows; with stashing the second of the
                            // previous step is still in flight (its backward comes now).
                            let mut grads = Vec::new();
                            for (half_index, id) in [(0, 10 * step), (1, 10 * step + 1)] {
                                let rows = &x[half_index * half..(half_index + 1) * half];
                                let logits = stage
                                    .forward(id, rows, ROWS / 2, &pass(half_index * ROWS / 2))
                                    .unwrap()
                                    .to_vec();
                                let labels = &labels[half_index * ROWS / 2..][..ROWS / 2];
                                let mut d = vec![0.0; logits.len()];
                                let scale = 1.0 / ROWS as f32;
                                loss::softmax_cross_entropy(&logits, labels, 10, scale, &mut d)
                                    .unwrap();
                                grads.push(d);
                            }
                            // With stashing, by step: 0 — the step closes with a micro-batch on
                            // the current version, and one more is forwarded and held across it
                            // (the update goes to the next version); 1 — the step closes with the
                            // micro-batch held back last step (on the previous version) while a new
                            // one holds the current version; 2 — it closes with the held-back one
                            // and nothing holds the current version (the update goes in place).
                            let held = |step: u64| 10 * step + 2;
                            let lr = 0.05 / (step + 1) as f32;
                            // A backward without the step, as variant `k` makes it.
                            let backward = |stage: &mut Stage, id: u64, dy: &[f32]| {
                                if k < 2 {
                                    return stage.backward(id, dy).unwrap().unwrap().to_vec();
                                }
                                let mut sent = Vec::new();
                                let send = &mut |dx: &[f32]| sent.push(dx.to_vec());
                                stage
                                    .backward_sending(id, dy, None, &mut || {}, send)
                                    .unwrap();
                                assert_eq!(sent.len(), 1, "{what}: one input gradient sent");
                                sent.pop().unwrap()
                            };
                            let dx0 = backward(stage, 10 * step, &grads[0]);
                            let (closing, closing_dy) = match (stashing, step % 3) {
                                (true, 1 | 2) if step > 0 => {
                                    backward(stage, 10 * step + 1, &grads[1]);
                                    (held(step - 1), vec![0.01; 10 * ROWS / 2])
                                }
                                _ => {
                                    if stashing && step > 0 && (step - 1) % 3 != 2 {
                                        let d = vec![0.01; 10 * ROWS / 2];
                                        backward(stage, held(step - 1), &d);
                                    }
                                    (10 * step + 1, grads[1].clone())
                                }
                            };
                            if stashing && step % 3 != 2 {
                                let rows = &x[..half];
                                stage.forward(held(step), rows, ROWS / 2, &pass(0)).unwrap();
                            }
                            let dx1 = if k == 0 {
                                let dx = stage.backward_and_step(
                                    closing,
                                    &closing_dy,
                                    optimizer,
                                    lr,
                                    &mut || {},
                                );
                                dx.unwrap().unwrap().to_vec()
                            } else if k == 1 {
                                let dx = stage.backward(closing, &closing_dy).unwrap();
                                let dx = dx.unwrap().to_vec();
                                stage.step(optimizer, lr);
                                dx
                            } else {
                                let mut sent = Vec::new();
                                let send = &mut |dx: &[f32]| sent.push(dx.to_vec());
                                let step = Some((&mut *optimizer, lr));
                                stage
                                    .backward_sending(closing, &closing_dy, step, &mut || {}, send)
                                    .unwrap();
                                assert_eq!(sent.len(), 1, "{what}: one input gradient sent");
                                sent.pop().unwrap()
                            };
                            input_grads.push((dx0, dx1));
                        }
                        for k in [1, 2] {
                            assert_eq!(
                                bits(stages[0].params()),
                                bits(stages[k].params()),
                                "{what}: parameters after step {step}, variant {k}"
                            );
                            assert_eq!(
                                (bits(&input_grads[0].0), bits(&input_grads[0].1)),
                                (bits(&input_grads[k].0), bits(&input_grads[k].1)),
                                "{what}: input gradients at step {step}, variant {k}"
                            );
                            assert_eq!(
                                stages[0].weight_versions(),
                                stages[k].weight_versions(),
                                "{what}: weight versions, variant {k}"
                            );
                        }
                    }
                    let outputs = stages
                        .each_mut()
                        .map(|s| s.infer(&x, ROWS).unwrap().to_vec());
                    assert_eq!(bits(&outputs[0]), bits(&outputs[1]), "{what}: outputs");
                    assert_eq!(bits(&outputs[0]), bits(&outputs[2]), "{what}: outputs");
                    assert_ne!(
                        bits(&outputs[0]),
                        bits(
                            Stage::new(&layers, 0..layers.len(), SEED, 1)
                                .infer(&x, ROWS)
                                .unwrap()
                        ),
                        "{what}: the steps changed the model"
                    );
                }
            }
        }
    }
}

// A step inside the backward gives its caller a word between every two layers, as the plain
// backward does, and also within a linear layer: after its input gradient and between parts of
// its update (the master of a ring answers a returning micro-batch's loss there instead of
// after the whole layer). The wide model: 5 gaps between its 6 layers; an input gradient in each
// of its 3 linear layers (the stage's own input gradient is on); the 1100→300 layer's 330,000
// weights are updated in two parts (262,144 at most each), so one word between them.
#[test]
fn a_step_inside_the_backward_gives_way_within_large_layers() {
    use ringtmp_model::{Optimizer, OptimizerConfig};
    let (x, _) = data();
    let layers = wide_layers();
    let mut stage = Stage::new(&layers, 0..layers.len(), SEED, 1);
    stage.set_input_grad(true);
    let mut optimizer = Optimizer::new(
        OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        },
        stage.params().len(),
    );
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 0,
        row_offset: 0,
    };
    let dy = vec![0.01; ROWS * 10];
    let mut words = [0usize; 2];
    for (k, words) in words.iter_mut().enumerate() {
        stage.forward(k as u64, &x, ROWS, &pass).unwrap();
        let between = &mut || *words += 1;
        if k == 0 {
            stage.backward_with(0, &dy, between).unwrap();
        } else {
            stage
                .backward_and_step(1, &dy, &mut optimizer, 0.1, between)
                .unwrap();
        }
    }
    assert_eq!(words, [5, 5 + 3 + 1]);
}

// A split backward hands out the stage's input gradient before any linear layer's weight
// gradient or update: counted in the words it gives its caller. The wide model (flatten, 1100,
// relu, 300, relu, 10): with the step, the chain of input gradients gives the 5 gaps between
// its layers and a word after each of the 3 linear layers' input gradients, then the input
// gradient goes out, then the weights: a gap before each of the 2 lower linear layers and one
// between the two parts of the 1100→300 layer's update. Without the step: the 5 gaps, the send,
// 2 gaps. The gradient sent is the one the backward returns whole.
#[test]
fn a_split_backward_sends_the_input_gradient_before_the_weights() {
    use ringtmp_model::{Optimizer, OptimizerConfig};
    use std::cell::Cell;
    let (x, _) = data();
    let layers = wide_layers();
    let new_stage = || {
        let mut stage = Stage::new(&layers, 0..layers.len(), SEED, 1);
        stage.set_input_grad(true);
        stage
    };
    let config = OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let pass = Pass {
        train: true,
        seed: SEED,
        step: 0,
        row_offset: 0,
    };
    let dy = vec![0.01; ROWS * 10];
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for with_step in [true, false] {
        let mut whole = new_stage();
        let mut optimizer = Optimizer::new(config.clone(), whole.params().len());
        whole.forward(0, &x, ROWS, &pass).unwrap();
        let expected = match with_step {
            true => whole.backward_and_step(0, &dy, &mut optimizer, 0.1, &mut || {}),
            false => whole.backward(0, &dy),
        };
        let expected = bits(expected.unwrap().unwrap());

        let mut split = new_stage();
        let mut optimizer = Optimizer::new(config.clone(), split.params().len());
        split.forward(0, &x, ROWS, &pass).unwrap();
        let words = Cell::new(0usize);
        let mut sent = Vec::new();
        let step = with_step.then_some((&mut optimizer, 0.1));
        ringtmp_meter::take();
        let mut metered_before_send = None;
        split
            .backward_sending(
                0,
                &dy,
                step,
                &mut || words.set(words.get() + 1),
                &mut |dx| {
                    sent.push((words.get(), bits(dx)));
                    metered_before_send = Some(ringtmp_meter::take());
                },
            )
            .unwrap();
        // The work recorded for the simulator's clock, in the order it ran: the linear layers'
        // (1, 3, 5) input gradients and the other layers' backwards before the send, the linear
        // layers' weight gradients after it.
        let (before_send, after_send) = (metered_before_send.unwrap(), ringtmp_meter::take());
        let r = ROWS as u64;
        assert_eq!(
            before_send.backward_rows,
            [r, 0, r, 0, r],
            "step {with_step}"
        );
        assert_eq!(
            before_send.input_grad_rows,
            [0, r, 0, r, 0, r],
            "step {with_step}"
        );
        assert!(before_send.weight_grad_rows.iter().all(|n| *n == 0));
        assert_eq!(
            after_send.weight_grad_rows,
            [0, r, 0, r, 0, r],
            "step {with_step}"
        );
        assert!(
            after_send
                .backward_rows
                .iter()
                .chain(&after_send.input_grad_rows)
                .all(|n| *n == 0)
        );
        let (before, after) = if with_step { (8, 3) } else { (5, 2) };
        assert_eq!(sent.len(), 1, "step {with_step}: one input gradient");
        assert_eq!(
            (sent[0].0, words.get() - sent[0].0),
            (before, after),
            "step {with_step}: words before and after the input gradient went out"
        );
        assert_eq!(sent[0].1, expected, "step {with_step}: the input gradient");
        assert_eq!(
            bits(split.params()),
            bits(whole.params()),
            "step {with_step}"
        );
        assert_eq!(bits(split.grads()), bits(whole.grads()), "step {with_step}");
    }
}

/// A small GPT as a chain: token ids `[8]` → embedding (vocabulary 11, width 8) → a transformer
/// block → LayerNorm → a linear layer over every position (the LM head, `[8, 11]`), with a label
/// per position.
fn gpt_layers() -> Vec<Layer> {
    let specs = [
        LayerSpec::Embedding {
            vocab: 11,
            width: 8,
            positions: true,
        },
        LayerSpec::Block {
            heads: 2,
            mlp_ratio: 2,
        },
        LayerSpec::LayerNorm {
            eps: ringtmp_model::layers::NORM_EPS,
        },
        LayerSpec::Linear {
            out: 11,
            bias: true,
        },
    ];
    let mut shape = Shape::flat(8);
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let l = ringtmp_model::spec::build_layer(i, s, &shape).unwrap();
            shape = l.output.clone();
            l
        })
        .collect()
}

/// Whether and how a GPT run steps after each micro-batch's backward.
#[derive(Clone, Copy, PartialEq)]
enum Step {
    /// No step: the run's gradients.
    None,
    /// SGD inside the backward (`Stage::backward_and_step`).
    Inside,
    /// SGD after the backward.
    After,
}

/// The GPT's logits and, without steps, its parameter gradients for `ROWS` sequences (with
/// steps, its parameters after them), as one stage or as stages split at `bounds`
/// (micro-batches of `ROWS / MICRO`, backwards in a scrambled order), the linear layers' weight
/// gradients deferred to one GEMM or not.
fn gpt_run(bounds: &[usize], defer: bool, step: Step) -> (Vec<f32>, Vec<f32>) {
    let layers = gpt_layers();
    let mut stages: Vec<Stage> = bounds
        .windows(2)
        .map(|w| Stage::new(&layers, w[0]..w[1], SEED, 2))
        .collect();
    for s in stages.iter_mut() {
        s.set_deferred_weight_grads(defer);
    }
    let ids: Vec<f32> = (0..ROWS * 8)
        .map(|i| ((i * 7 + i / 8) % 11) as f32)
        .collect();
    let labels: Vec<u32> = (0..ROWS * 8).map(|i| ((i * 5 + 3) % 11) as u32).collect();
    let rows = ROWS / MICRO;
    let (mut logits, mut dlogits) = (Vec::new(), Vec::new());
    for mb in 0..MICRO {
        let pass = Pass {
            train: true,
            seed: SEED,
            step: 5,
            row_offset: mb * rows,
        };
        let mut act = ids[mb * rows * 8..(mb + 1) * rows * 8].to_vec();
        for stage in stages.iter_mut() {
            act = stage
                .forward(mb as u64, &act, rows, &pass)
                .unwrap()
                .to_vec();
        }
        let mut d = vec![0.0; act.len()];
        let l = &labels[mb * rows * 8..(mb + 1) * rows * 8];
        loss::softmax_cross_entropy(&act, l, 11, 1.0 / (ROWS * 8) as f32, &mut d).unwrap();
        logits.extend_from_slice(&act);
        dlogits.push(d);
    }
    let mut optimizers: Vec<Optimizer> = stages
        .iter()
        .map(|s| {
            Optimizer::new(
                OptimizerConfig::Sgd {
                    momentum: 0.0,
                    weight_decay: 0.0,
                },
                s.params().len(),
            )
        })
        .collect();
    for mb in [2usize, 0, 1] {
        let mut grad = dlogits[mb].clone();
        for (k, stage) in stages.iter_mut().enumerate().rev() {
            grad = match step {
                Step::None => stage
                    .backward(mb as u64, &grad)
                    .unwrap()
                    .map(<[f32]>::to_vec),
                Step::Inside => stage
                    .backward_and_step(mb as u64, &grad, &mut optimizers[k], 0.1, &mut || {})
                    .unwrap()
                    .map(<[f32]>::to_vec),
                Step::After => {
                    let dx = stage
                        .backward(mb as u64, &grad)
                        .unwrap()
                        .map(<[f32]>::to_vec);
                    stage.step(&mut optimizers[k], 0.1);
                    dx
                }
            }
            .unwrap_or_default();
        }
    }
    let out = if step != Step::None {
        stages.iter().flat_map(|s| s.params().to_vec()).collect()
    } else {
        stages.iter_mut().flat_map(|s| s.grads().to_vec()).collect()
    };
    (logits, out)
}

#[test]
fn a_gpt_split_into_stages_equals_the_unsplit_one() {
    let (logits, grads) = gpt_run(&[0, 4], false, Step::None);
    assert_eq!(
        logits.len(),
        ROWS * 8 * 11,
        "a logit per position and token"
    );
    for (bounds, defer) in [
        (&[0, 2, 4][..], false),
        (&[0, 1, 3, 4], false),
        (&[0, 2, 4], true),
        (&[0, 4], true),
    ] {
        let (l, g) = gpt_run(bounds, defer, Step::None);
        let (dl, dg) = (max_rel_diff(&l, &logits), max_rel_diff(&g, &grads));
        assert!(
            dl < 1e-5 && dg < 1e-5,
            "{bounds:?} deferred {defer}: logits {dl:.1e}, gradients {dg:.1e}"
        );
    }
    // The step inside the backward (the head's weight gradient made by blocks, over every
    // position) equals backward then step, bit for bit.
    for bounds in [&[0, 4][..], &[0, 2, 4]] {
        let (_, inside) = gpt_run(bounds, false, Step::Inside);
        let (_, after) = gpt_run(bounds, false, Step::After);
        assert_eq!(inside, after, "{bounds:?}");
    }
}
