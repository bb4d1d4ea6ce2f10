//! Oracle tests of RingTMP: gpipe and 1f1b on 2, 3 and 4 nodes (threads with real loopback links)
//! give the same parameters as the `local` strategy after K steps on the same seed and data, and
//! the master never sends anything but stage-0 activations and logit gradients.

use std::path::Path;

use ringtmp_data::Dataset;
use ringtmp_model::checkpoint;
use ringtmp_model::{LrSchedule, ModelSpec, OptimizerConfig, Shape};
use ringtmp_strategy::ring::plan::partition::StagePlan;
use ringtmp_strategy::ring::run::driver::RingJob;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_strategy::{Defaulted, Origin, ResumePoint, TrainConfig};
use ringtmp_testkit::fixtures::{CONV_MODEL, digits, max_rel_diff};
use ringtmp_testkit::jobs::ring_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::oracle;
use ringtmp_testkit::run;
use ringtmp_transport::sim::test_seed;

const STEPS: u64 = 12;
const BATCH: usize = 24;

fn model() -> ModelSpec {
    ringtmp_testkit::fixtures::model(CONV_MODEL, "ring-test")
}

fn optimizer() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
    }
}

/// The run every test here makes: `STEPS` steps of batch `BATCH` on the digits.
fn config(out: &Path) -> TrainConfig {
    TrainConfig {
        model: model(),
        dataset: "digits".into(),
        wire_dtype: ringtmp_wire::Dtype::F32,
        data_dir: None,
        epochs: 1,
        batch_size: BATCH,
        lr: Defaulted::given(0.05),
        schedule: Defaulted::given(LrSchedule::Cosine),
        warmup_steps: Defaulted::given(2),
        optimizer: optimizer(),
        threads: 1,
        seed: 5,
        target_accuracy: 0.5,
        eval_every: 0,
        out: out.to_path_buf(),
        checkpoint_every: 0,
        keep_checkpoints: None,
        resume: None,
        max_steps: Some(STEPS),
        train_samples: None,
        min_samples: None,
        keep_best: false,
        early_stop: None,
        recv_timeout_secs: 30.0,
        stall_timeout_secs: None,
        clip_grad_norm: None,
        text: None,
        source: None,
        init_from: None,
        momentum: Origin::Given,
        threads_from_machine: false,
    }
}

fn local_params(data: &Dataset, out: &Path) -> Vec<f32> {
    oracle::local_params(&config(out), data)
}

fn job(bounds: &[usize], schedule: Schedule, micro_batches: usize) -> RingJob {
    ring_job(
        &config(Path::new("")),
        &digits(),
        bounds,
        schedule,
        micro_batches,
    )
}

/// Runs the ring on `backend` and returns every stage's parameters concatenated in layer order
/// (the master's sent messages audited on the way).
fn ring_params_on(
    backend: &Backend,
    job: &RingJob,
    data: &Dataset,
    out: &Path,
) -> (Vec<f32>, ringtmp_metrics::Summary) {
    let ran = run::ring_nodes(backend, job, data, out, 6);
    // A failed node's error first: the audit of a run cut short says less.
    for (rank, result) in ran.results.iter().enumerate() {
        if let Err(e) = result {
            panic!("ring node {rank} failed: {e}");
        }
    }
    let audit = ran.audit.clone();
    let (params, summary) = run::ring_params(ran.results);
    audit_master(&audit, job, data, summary.steps);
    (params, summary)
}

/// The ring on real loopback links.
fn ring_params(job: &RingJob, data: &Dataset, out: &Path) -> (Vec<f32>, ringtmp_metrics::Summary) {
    ring_params_on(&Backend::Tcp, job, data, out)
}

/// Every tensor the master sent is stage 0's output (activations or evaluation activations, to
/// rank 1) or the logits' gradient (to the last rank): never raw inputs, never labels.
fn audit_master(
    sent: &[ringtmp_transport::SentRecord],
    job: &RingJob,
    data: &Dataset,
    trained_to: u64,
) {
    use ringtmp_wire::TensorTag;
    // The layers the stages hold (a cut inside a layer sends its input and its head's outputs).
    let layers = job.layers().unwrap();
    let stage0_width = layers[job.partition[0].end - 1].output.numel() as u32;
    let n = job.partition.len() as u32;
    let raw_width = data.train.features() as u32;
    assert_ne!(
        stage0_width, raw_width,
        "test model must make the widths distinguishable"
    );
    let (mut activations, mut gradients) = (0, 0);
    for r in sent {
        match r.tag {
            None => {}
            Some(TensorTag::Activation | TensorTag::Inference) => {
                assert_eq!(
                    (r.to, r.shape[1]),
                    (1, stage0_width),
                    "master sent {:?} {:?} to {}",
                    r.tag,
                    r.shape,
                    r.to
                );
                activations += 1;
            }
            Some(TensorTag::Gradient) => {
                // The logits' gradient, or with the head on the master, the head input's gradient.
                let width = job
                    .head
                    .as_ref()
                    .map_or(layers[layers.len() - 1].output.numel(), |h| {
                        layers[h.start].input.numel()
                    }) as u32;
                assert_eq!(
                    (r.to, r.shape[1]),
                    (n - 1, width),
                    "gradient {:?} to {}",
                    r.shape,
                    r.to
                );
                gradients += 1;
            }
            Some(other) => panic!("master sent a {other:?} tensor"),
        }
        // No payload is a copy of a raw input row or a label vector.
        assert_ne!(r.shape.get(1).copied(), Some(raw_width));
        assert_ne!(
            r.shape.len(),
            1,
            "one-dimensional tensors (label-shaped) never leave the master"
        );
    }
    let steps = (trained_to - job.first_step()) as usize;
    assert!(
        activations >= steps * job.micro_batches && gradients == steps * job.micro_batches,
        "{activations} activations and {gradients} gradients for {steps} steps of {} \
         micro-batches",
        job.micro_batches
    );
}

#[test]
fn gpipe_and_1f1b_equal_local_on_2_3_and_4_nodes() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let oracle = local_params(&data, &tmp.path().join("local"));
    let cases: [(&[usize], usize); 3] = [
        (&[0, 5, 10], 3),
        (&[0, 2, 6, 10], 4),
        (&[0, 1, 5, 8, 10], 6),
    ];
    // One test body on real links and on the simulated network.
    for backend in [Backend::Tcp, Backend::sim(test_seed(1))] {
        for (case, (bounds, micro)) in cases.into_iter().enumerate() {
            for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
                let out = tmp.path().join(format!(
                    "{}-{}-{}",
                    schedule.name(),
                    bounds.len(),
                    backend.name()
                ));
                let mut j = job(bounds, schedule, micro);
                // Deferred weight gradients must not change the result either.
                j.defer_weight_grads = case % 2 == 1;
                let (params, summary) = ring_params_on(&backend, &j, &data, &out);
                let diff = max_rel_diff(&params, &oracle);
                println!(
                    "{} on {} nodes ({}), {micro} micro-batches: max |Δparam| / max |param| = {diff:.2e}",
                    schedule.name(),
                    bounds.len() - 1,
                    backend.name()
                );
                assert!(
                    diff < 1e-4,
                    "{} on {} nodes ({}) differs from local by {diff}",
                    schedule.name(),
                    bounds.len() - 1,
                    backend.name()
                );
                assert_eq!(summary.steps, STEPS);
                assert_eq!(summary.per_node.len(), bounds.len() - 1);
                // Each node holds only its own stage's parameters, and on real links reports
                // the times of exactly its layers (each node's passes took some time); a
                // simulated node's compute is priced, not timed, and reports none.
                for (node, w) in summary.per_node.iter().zip(bounds.windows(2)) {
                    assert_eq!(node.layers, Some((w[0], w[1])));
                    let layers: Vec<usize> = node.layer_seconds.iter().map(|l| l.0).collect();
                    if matches!(backend, Backend::Sim(_)) {
                        assert!(layers.is_empty(), "{node:?}");
                        continue;
                    }
                    assert_eq!(layers, (w[0]..w[1]).collect::<Vec<_>>());
                    let sum = |pass: fn(&(usize, f64, f64)) -> f64| {
                        node.layer_seconds.iter().map(pass).sum::<f64>()
                    };
                    assert!(sum(|l| l.1) > 0.0 && sum(|l| l.2) > 0.0, "{node:?}");
                }
                assert_eq!(
                    summary.per_node.iter().map(|p| p.params).sum::<u64>(),
                    oracle.len() as u64
                );
            }
        }
    }
}

// Cuts inside layers (docs/decisions/edge-emulation.md): a linear layer's head ends one stage and its tail
// starts the next. The ring computes the unsplit model: its final checkpoint, read into the
// whole model, holds local's parameters — on 2 nodes with one cut and on 3 with two, under
// 1f1b and gpipe (with the linear layers' weight gradients deferred, the parts' too), and on 2 with the
// head on the master after the cut, on real links and on the simulated network.
#[test]
fn a_ring_cut_inside_layers_equals_local() {
    use ringtmp_strategy::ring::plan::partition::CutInside;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let oracle = local_params(&data, &tmp.path().join("local"));
    let layers = model().build(&Shape::image(8, 8, 1), 10).unwrap();
    let cases: [(&[CutInside], &[usize], Schedule, bool); 3] = [
        // Layer 7 (48 → 32) after 12 outputs: [conv … head | tail relu linear].
        (
            &[CutInside {
                layer: 7,
                split: 12,
            }],
            &[0, 8, 11],
            Schedule::OneFOneB,
            false,
        ),
        // Layer 4 (96 → 48) after 20 and layer 7 after 12: three stages.
        (
            &[
                CutInside {
                    layer: 4,
                    split: 20,
                },
                CutInside {
                    layer: 7,
                    split: 12,
                },
            ],
            &[0, 5, 9, 12],
            Schedule::Gpipe,
            false,
        ),
        // The same cut, the last linear layer (10 of the cut model) back on the master.
        (
            &[CutInside {
                layer: 7,
                split: 12,
            }],
            &[0, 8, 10],
            Schedule::OneFOneB,
            true,
        ),
    ];
    for backend in [Backend::Tcp, Backend::sim(test_seed(3))] {
        for (k, (cuts, bounds, schedule, head)) in cases.iter().enumerate() {
            let out = tmp.path().join(format!("cut-{k}-{}", backend.name()));
            let mut j = job(bounds, *schedule, 4);
            j.cuts_inside = cuts.to_vec();
            if *head {
                j.head = Some(StagePlan {
                    rank: 0,
                    start: 10,
                    end: 11,
                    predicted_seconds: 0.0,
                    predicted_bytes: 0,
                    predicted_link_seconds: 0.0,
                });
            }
            // Deferred weight gradients, the parts' among the whole linear layers'.
            j.defer_weight_grads = k == 1;
            j.spec.config.checkpoint_every = STEPS;
            j.spec.config.out = out.clone();
            assert_eq!(j.layers().unwrap().len(), layers.len() + cuts.len());
            let (_, summary) = ring_params_on(&backend, &j, &data, &out);
            assert_eq!(summary.steps, STEPS);
            let dir = checkpoint::resolve(&out).unwrap();
            let manifest = checkpoint::read_manifest(&dir).unwrap();
            let mut whole = ringtmp_model::Stage::new(&layers, 0..layers.len(), 1, 1);
            let mut opt = ringtmp_model::Optimizer::new(optimizer(), whole.params().len());
            checkpoint::read_stage(&dir, &manifest, &mut whole, &mut opt).unwrap();
            let diff = max_rel_diff(whole.params(), &oracle);
            println!(
                "{} cut(s) on {} nodes{} ({}): max |Δparam| / max |param| = {diff:.2e}",
                cuts.len(),
                bounds.len() - 1,
                if *head {
                    ", the head on the master"
                } else {
                    ""
                },
                backend.name()
            );
            assert!(diff < 1e-4, "cut ring differs from local by {diff}");
        }
    }
}

#[test]
fn checkpoint_then_resume_equals_uninterrupted_even_on_fewer_nodes() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let oracle = local_params(&data, &tmp.path().join("local"));
    // K = 6 steps on 3 nodes, checkpoint, stop.
    let first_out = tmp.path().join("first");
    let mut first = job(&[0, 2, 6, 10], Schedule::Gpipe, 4);
    first.spec.total_steps = STEPS / 2;
    first.spec.config.checkpoint_every = STEPS / 2;
    first.spec.config.out = first_out.clone();
    ring_params(&first, &data, &first_out);
    let dir = checkpoint::resolve(&first_out).unwrap();
    let manifest = checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(
        (
            manifest.step,
            manifest.files.len(),
            manifest.strategy.as_str()
        ),
        (STEPS / 2, 3, "ring")
    );
    // J = 6 more steps, resumed on 3 nodes with the same partition and on 2 nodes (re-partitioned).
    for bounds in [&[0, 2, 6, 10][..], &[0, 4, 10]] {
        let out = tmp.path().join(format!("resumed-{}", bounds.len() - 1));
        let mut resumed = job(bounds, Schedule::OneFOneB, 4);
        resumed.spec.resume_from = Some(ResumePoint {
            dir: dir.clone(),
            step: STEPS / 2,
        });
        resumed.spec.config.out = out.clone();
        let (params, summary) = ring_params(&resumed, &data, &out);
        let diff = max_rel_diff(&params, &oracle);
        println!(
            "{} + {} steps, resumed on {} nodes: max |Δparam| / max |param| = {diff:.2e}",
            STEPS / 2,
            STEPS / 2,
            bounds.len() - 1
        );
        assert!(
            diff < 1e-4,
            "resumed run differs from uninterrupted local by {diff}"
        );
        assert_eq!(summary.steps, STEPS);
    }
}

#[test]
fn async_pipeline_with_weight_stashing_learns() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut j = job(&[0, 2, 6, 10], Schedule::Async, 4);
    j.spec.total_steps = 120;
    j.spec.schedule_steps = 120;
    j.spec.config.lr = Defaulted::given(0.02);
    j.spec.config.checkpoint_every = 60;
    j.spec.config.out = tmp.path().to_path_buf();
    let (_, summary) = ring_params(&j, &data, tmp.path());
    println!(
        "async, 3 nodes, 120 mini-batches of 4 micro-batches: test accuracy {:.3}",
        summary.final_test_accuracy
    );
    // Async staleness is the schedule's (PipeDream's static 1F1B), so this figure is the same
    // on every run.
    assert!(
        summary.final_test_accuracy > 0.8,
        "{}",
        summary.final_test_accuracy
    );
    assert_eq!(
        checkpoint::read_manifest(&checkpoint::resolve(tmp.path()).unwrap())
            .unwrap()
            .step,
        120
    );
}

/// A window wider than a mini-batch's micro-batches runs the pipeline across mini-batch
/// boundaries; it must still be empty at every evaluation and checkpoint, or their messages
/// would meet training traffic in the ring.
#[test]
fn async_window_wider_than_a_mini_batch_drains_for_evaluations_and_checkpoints() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut j = job(&[0, 2, 6, 10], Schedule::Async, 1);
    j.in_flight = 4;
    j.spec.total_steps = 40;
    j.spec.schedule_steps = 40;
    j.spec.config.lr = Defaulted::given(0.02);
    j.spec.config.checkpoint_every = 10;
    j.spec.config.out = tmp.path().to_path_buf();
    let (_, summary) = ring_params(&j, &data, tmp.path());
    // Evaluations every 6 steps (see `ring_params`) plus the last: 6, 12, …, 36, 40.
    let metrics = std::fs::read_to_string(tmp.path().join("metrics.jsonl")).unwrap();
    let evals: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["event"] == "eval")
        .collect();
    let steps: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![6, 12, 18, 24, 30, 36, 40]);
    for e in &evals {
        let loss = e["test_loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{e}");
    }
    assert_eq!(summary.steps, 40);
    assert_eq!(
        checkpoint::read_manifest(&checkpoint::resolve(tmp.path()).unwrap())
            .unwrap()
            .step,
        40
    );
}

/// The async schedule's weight versions are the schedule's, not the timing's: one job on real
/// links and on simulated networks where one node or another is slow and messages are late by
/// seeded amounts ends with the same parameters, bit for bit.
#[test]
fn async_ring_gives_the_same_parameters_whatever_the_timing() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut j = job(&[0, 2, 6, 10], Schedule::Async, 2);
    j.in_flight = 5;
    j.spec.total_steps = 24;
    j.spec.schedule_steps = 24;
    j.spec.config.lr = Defaulted::given(0.02);
    j.spec.config.checkpoint_every = 0;
    let slow = |seed: u64, rank: u32, speed: f64| {
        let mut cfg = ringtmp_transport::sim::SimConfig::new(test_seed(seed));
        cfg.jitter = std::time::Duration::from_millis(3);
        cfg.compute_jitter = 0.5;
        cfg.node_speed.insert(rank, speed);
        Backend::Sim(cfg)
    };
    let backends = [
        Backend::Tcp,
        slow(31, 1, 0.2),
        slow(32, 2, 0.1),
        slow(33, 0, 0.3),
    ];
    let mut first: Option<Vec<f32>> = None;
    for (i, backend) in backends.iter().enumerate() {
        let out = tmp.path().join(format!("run-{i}"));
        j.spec.config.out = out.clone();
        let (params, summary) = ring_params_on(backend, &j, &data, &out);
        assert_eq!(summary.steps, 24);
        match &first {
            None => first = Some(params),
            Some(first) => assert!(
                first
                    .iter()
                    .zip(&params)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} differs from tcp by {}",
                backend.name(),
                max_rel_diff(&params, first)
            ),
        }
    }
}

/// An early stop on the ring: the master stops after the evaluation that spends the patience,
/// with the run's checkpoint of that step and the best evaluation's marked, under the async
/// schedule (whose pipeline has drained for the evaluation) and a flushed one.
#[test]
fn the_ring_stops_early_and_keeps_the_best_evaluation_s_checkpoint() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    for schedule in [Schedule::Async, Schedule::OneFOneB] {
        let out = tmp.path().join(schedule.name());
        let mut j = job(&[0, 2, 6, 10], schedule, 2);
        j.spec.total_steps = 600;
        j.spec.schedule_steps = 600;
        j.spec.config.lr = Defaulted::given(0.2);
        j.spec.config.eval_every = 10;
        j.spec.config.checkpoint_every = ringtmp_strategy::CHECKPOINT_AT_END;
        j.spec.config.keep_best = true;
        j.spec.config.early_stop = Some(2);
        j.spec.config.out = out.clone();
        let (_, summary) = ring_params(&j, &data, &out);
        assert!(
            summary.steps < 600,
            "{}: ran all 600 steps",
            schedule.name()
        );
        let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let events: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let evals: Vec<(u64, f64)> = events
            .iter()
            .filter(|e| e["event"] == "eval")
            .map(|e| {
                (
                    e["step"].as_u64().unwrap(),
                    e["test_loss"].as_f64().unwrap(),
                )
            })
            .collect();
        let best = evals.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
        assert_eq!(evals.last().unwrap().0, summary.steps);
        let best_dir = checkpoint::resolve_weights(&out).unwrap();
        assert_eq!(checkpoint::read_manifest(&best_dir).unwrap().step, best);
        // Each better evaluation's checkpoint replaced the one before: the best and the last.
        let mut left: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        left.sort();
        assert_eq!(
            left,
            [best, summary.steps].map(checkpoint::checkpoint_dir_name)
        );
        assert_eq!(
            checkpoint::read_manifest(&checkpoint::resolve(&out).unwrap())
                .unwrap()
                .step,
            summary.steps
        );
    }
}

#[test]
fn master_holding_the_head_equals_local_and_keeps_the_logits() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let oracle = local_params(&data, &tmp.path().join("local"));
    for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
        // Layers 0..5 on the master, 5..8 on rank 1, 8..10 (the last linear) back on the master.
        let mut j = job(&[0, 5, 8], schedule, 3);
        j.head = Some(StagePlan {
            rank: 0,
            start: 8,
            end: 10,
            predicted_seconds: 0.0,
            predicted_bytes: 0,
            predicted_link_seconds: 0.0,
        });
        let out = tmp.path().join(format!("head-{}", schedule.name()));
        let (params, summary) = ring_params(&j, &data, &out);
        let diff = max_rel_diff(&params, &oracle);
        println!(
            "{} with the head on the master: max |Δparam| / max |param| = {diff:.2e}",
            schedule.name()
        );
        assert!(diff < 1e-4, "{diff}");
        assert_eq!(
            summary.per_node.iter().map(|p| p.params).sum::<u64>(),
            oracle.len() as u64
        );
    }
}

/// An MLP with LayerNorm, RMSNorm and GELU between its linear layers (the element-wise parts of
/// a transformer block), split over 2 and 3 nodes: the ring computes the unsplit
/// model (1F1B, exact SGD), so its parameters after the run are local's.
const NORM_MODEL: &str = r#"
name = "norm-test"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 24
[[layer]]
type = "layer_norm"
[[layer]]
type = "gelu"
[[layer]]
type = "linear"
out = 16
[[layer]]
type = "rms_norm"
[[layer]]
type = "gelu"
[[layer]]
type = "linear"
out = 10
"#;

#[test]
fn norms_and_gelu_split_over_a_ring_equal_local() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(&tmp.path().join("local"));
    cfg.model = ringtmp_testkit::fixtures::model(NORM_MODEL, "norm-test");
    let oracle = oracle::local_params(&cfg, &data);
    for bounds in [&[0, 3, 8][..], &[0, 2, 5, 8]] {
        let out = tmp.path().join(format!("ring-{}", bounds.len()));
        let job = ring_job(&cfg, &data, bounds, Schedule::OneFOneB, 4);
        let (params, summary) = ring_params_on(&Backend::sim(test_seed(3)), &job, &data, &out);
        let diff = max_rel_diff(&params, &oracle);
        assert!(diff < 1e-4, "{bounds:?}: differs from local by {diff}");
        assert_eq!(summary.steps, STEPS);
    }
}

#[test]
fn regression_with_two_targets_over_a_ring_equals_local() {
    let tmp = tempfile::tempdir().unwrap();
    let data = ringtmp_testkit::fixtures::regression_data(tmp.path());
    assert_eq!((data.classes, data.positions()), (2, 2));
    let mut cfg = config(&tmp.path().join("local"));
    cfg.model = ModelSpec::tabular(4, 2);
    cfg.dataset = "csv".into();
    let oracle = oracle::local_params(&cfg, &data);
    for bounds in [&[0, 3, 6][..], &[0, 2, 4, 6]] {
        let out = tmp.path().join(format!("ring-{}", bounds.len()));
        let job = ring_job(&cfg, &data, bounds, Schedule::OneFOneB, 3);
        let (params, summary) = ring_params_on(&Backend::sim(test_seed(4)), &job, &data, &out);
        let diff = max_rel_diff(&params, &oracle);
        assert!(diff < 1e-4, "{bounds:?}: differs from local by {diff}");
        let regression = summary.regression.expect("a regression summary");
        assert_eq!(regression.targets, vec!["y0", "y1"]);
        assert!(regression.final_test_rmse.is_finite() && regression.final_test_mae > 0.0);
    }
}

#[test]
fn a_gpt_split_over_a_ring_with_adamw_and_clipping_equals_local() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    let adamw = OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_embeddings: false,
    };
    // Adam's update hardly depends on a gradient's scale; SGD's is proportional to it, so a
    // factor that were not the whole model's would show there.
    for (name, optimizer, lr) in [("adamw", adamw, 3e-3), ("sgd", optimizer(), 0.5)] {
        let cfg = TrainConfig {
            model: ringtmp_testkit::fixtures::gpt(data.classes, 16),
            dataset: "text".into(),
            text: Some(text.clone()),
            source: None,
            init_from: None,
            batch_size: 8,
            lr: Defaulted::given(lr),
            optimizer,
            // Low enough that every step clips.
            clip_grad_norm: Some(0.05),
            ..config(&tmp.path().join(format!("local-{name}")))
        };
        let oracle = oracle::local_params(&cfg, &data);
        let initial = {
            let layers = ringtmp_strategy::layers_for(&cfg.model, &data).unwrap();
            ringtmp_model::Stage::new(&layers, 0..layers.len(), cfg.seed, 1)
                .params()
                .to_vec()
        };
        assert!(max_rel_diff(&oracle, &initial) > 1e-3, "{name}: it trains");
        // On loopback links too: there a stage's norm can arrive before the stage it goes to
        // has finished its own last backward.
        for (bounds, schedule, backend) in [
            (
                &[0, 2, 5][..],
                Schedule::OneFOneB,
                Backend::sim(test_seed(4)),
            ),
            (&[0, 1, 3, 5], Schedule::Gpipe, Backend::sim(test_seed(5))),
            (&[0, 1, 3, 5], Schedule::OneFOneB, Backend::Tcp),
        ] {
            let out = tmp
                .path()
                .join(format!("ring-{name}-{}-{schedule:?}", bounds.len()));
            let job = ring_job(&cfg, &data, bounds, schedule, 4);
            let (params, summary) = ring_params_on(&backend, &job, &data, &out);
            let diff = max_rel_diff(&params, &oracle);
            assert!(
                diff < 1e-4,
                "{name} {bounds:?}: differs from local by {diff}"
            );
            assert_eq!(summary.steps, STEPS);
        }
    }
}

/// A GPT whose head is tied to its token embedding, the master holding both: the one matrix
/// takes one update from the sum of both gradients, so the flushed schedules equal `local`'s
/// tied model (with SGD, a missing or doubled share would show in the table), and `async`
/// keeps the head's copy equal to the table.
#[test]
fn a_tied_gpt_with_the_master_holding_the_head_equals_local() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    let cfg = TrainConfig {
        model: ringtmp_testkit::fixtures::tied_gpt(data.classes, 16),
        dataset: "text".into(),
        text: Some(text.clone()),
        source: None,
        init_from: None,
        batch_size: 8,
        lr: Defaulted::given(0.5),
        clip_grad_norm: Some(0.05),
        ..config(&tmp.path().join("local"))
    };
    let oracle = oracle::local_params(&cfg, &data);
    let layers = ringtmp_strategy::layers_for(&cfg.model, &data).unwrap();
    let table = data.classes * 16;
    let head_weight = {
        let stage = ringtmp_model::Stage::new(&layers, 0..layers.len(), cfg.seed, 1);
        stage.param_ranges().last().unwrap().1.start
    };
    assert_eq!(oracle[..table], oracle[head_weight..head_weight + table]);
    let head = StagePlan {
        rank: 0,
        start: 4,
        end: 5,
        predicted_seconds: 0.0,
        predicted_bytes: 0,
        predicted_link_seconds: 0.0,
    };
    for (schedule, backend) in [
        (Schedule::Gpipe, Backend::sim(test_seed(6))),
        (Schedule::OneFOneB, Backend::Tcp),
        (Schedule::Async, Backend::sim(test_seed(7))),
    ] {
        let mut job = ring_job(&cfg, &data, &[0, 2, 4], schedule, 4);
        job.head = Some(head.clone());
        if schedule == Schedule::Async {
            // Clipping by the global norm needs a flushed schedule (the planner refuses both).
            job.spec.config.clip_grad_norm = None;
        }
        let out = tmp.path().join(format!("tied-{}", schedule.name()));
        let (params, summary) = ring_params_on(&backend, &job, &data, &out);
        assert_eq!(summary.steps, STEPS);
        assert_eq!(
            params[..table],
            params[head_weight..head_weight + table],
            "{}: the head's copy is the table",
            schedule.name()
        );
        if schedule != Schedule::Async {
            let diff = max_rel_diff(&params, &oracle);
            assert!(
                diff < 1e-4,
                "{}: differs from local by {diff}",
                schedule.name()
            );
        }
    }
}
