//! End-to-end tests of the `local` strategy on the bundled scikit-learn digits (small and fast):
//! learning, the output contract, and exact checkpoint/resume.

use std::path::{Path, PathBuf};

use ringtmp_model::checkpoint::{self, Manifest};
use ringtmp_model::{LrSchedule, ModelSpec, Optimizer, OptimizerConfig, Shape, Stage};
use ringtmp_strategy::{Defaulted, Origin, TrainConfig, train_local};

const MODEL: &str = r#"
name = "digits-test"
[[layer]]
type = "conv2d"
out_channels = 8
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
out = 64
[[layer]]
type = "relu"
[[layer]]
type = "dropout"
p = 0.1
[[layer]]
type = "linear"
out = 10
"#;

use ringtmp_testkit::fixtures::digits;
use ringtmp_testkit::oracle::checkpoint_params as final_params;

fn config(out: &Path, optimizer: OptimizerConfig) -> TrainConfig {
    TrainConfig {
        model: ModelSpec::from_toml(MODEL, "digits-test").unwrap(),
        dataset: "digits".into(),
        wire_dtype: ringtmp_wire::Dtype::F32,
        data_dir: None,
        epochs: 3,
        batch_size: 32,
        lr: Defaulted::given(if matches!(optimizer, OptimizerConfig::Adam { .. }) {
            0.002
        } else {
            0.05
        }),
        schedule: Defaulted::given(LrSchedule::Cosine),
        warmup_steps: Defaulted::given(3),
        optimizer,
        threads: 2,
        seed: 3,
        target_accuracy: 0.8,
        eval_every: 20,
        out: out.to_path_buf(),
        checkpoint_every: 0,
        keep_checkpoints: None,
        resume: None,
        max_steps: None,
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

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
    }
}

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

#[test]
fn regression_learns_both_targets_and_reports_errors_in_their_units() {
    let tmp = tempfile::tempdir().unwrap();
    let data = ringtmp_testkit::fixtures::regression_data(tmp.path());
    let mut cfg = config(&tmp.path().join("run"), adam());
    cfg.model = ModelSpec::tabular(4, 2);
    cfg.epochs = 30;
    cfg.lr = Defaulted::given(0.005);
    cfg.eval_every = 0;
    let s = train_local(&cfg, &data, &mut |_| {}).unwrap();
    let r = s.regression.expect("a regression summary");
    // Both targets are smooth functions of the inputs: a small MLP explains most of them.
    assert!(r.final_test_r2 > 0.95, "R² {}", r.final_test_r2);
    assert_eq!(s.final_test_accuracy, r.final_test_r2);
    // Two targets are scored in standard deviations: RMSE² is the standardised test loss.
    assert!((r.final_test_rmse.powi(2) - r.final_test_loss).abs() < 1e-9);
    assert!(r.final_test_mae <= r.final_test_rmse && r.best_test_rmse <= r.final_test_rmse);
    let events = std::fs::read_to_string(tmp.path().join("run/metrics.jsonl")).unwrap();
    assert!(events.contains("\"test_rmse\"") && events.contains("\"test_r2\""));
}

#[test]
fn one_target_is_scored_in_its_own_units() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("one.csv");
    // y = 1000 · x + 5000: a standard deviation of about 290 in the target's units.
    let mut text = String::from("x,y\n");
    for i in 0..400 {
        let x = f64::from((i * 37) % 400) / 400.0;
        text.push_str(&format!("{x},{}\n", 1000.0 * x + 5000.0));
    }
    std::fs::write(&path, text).unwrap();
    let mut source = ringtmp_data::DataSource::new("csv", vec![path]);
    source.label = Some("y".into());
    let data = ringtmp_data::load_source(&source).unwrap();
    assert_eq!(
        data.task,
        ringtmp_data::Task::Regress,
        "y ≥ 1024 is a quantity"
    );
    let std = data.recipe.target_standardisation[0].1;
    assert!((250.0..330.0).contains(&std), "{std}");
    let mut cfg = config(&tmp.path().join("run"), adam());
    cfg.model = ModelSpec::tabular(1, 1);
    cfg.epochs = 2;
    cfg.eval_every = 0;
    let s = train_local(&cfg, &data, &mut |_| {}).unwrap();
    let r = s.regression.unwrap();
    let rmse_in_deviations = r.final_test_loss.sqrt();
    assert!(
        (r.final_test_rmse - rmse_in_deviations * f64::from(std)).abs() < 1e-6 * r.final_test_rmse,
        "{} vs {rmse_in_deviations} × {std}",
        r.final_test_rmse
    );
}

/// Parameters stored in the newest checkpoint under `out`.
#[test]
fn local_training_learns_digits_and_writes_the_output_contract() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), sgd());
    let s = train_local(&cfg, &data, &mut |_| {}).unwrap();
    println!(
        "digits: final accuracy {:.3}, {:.0} samples/s",
        s.final_test_accuracy, s.samples_per_second
    );
    assert!(
        s.final_test_accuracy > 0.85,
        "accuracy {}",
        s.final_test_accuracy
    );
    assert_eq!(s.steps, 3 * (1500 / 32));
    assert!(s.time_to_target_seconds.is_some() && s.steps_to_target.is_some());
    let node = &s.per_node[0];
    assert!(node.peak_rss_bytes > 0 && node.cpu_seconds > 0.0 && node.compute_seconds > 0.0);
    assert_eq!(node.param_bytes, node.params * 4);
    // Every layer's times, in order; the passes of the layers with parameters took some.
    let layers: Vec<usize> = node.layer_seconds.iter().map(|l| l.0).collect();
    assert_eq!(layers, (0..cfg.model.layers.len()).collect::<Vec<_>>());
    assert!(node.layer_seconds.iter().any(|l| l.1 > 0.0 && l.2 > 0.0));

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "local");
    assert_eq!(summary["steps"], s.steps);
    let events: Vec<serde_json::Value> = std::fs::read_to_string(tmp.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let count = |kind: &str| events.iter().filter(|e| e["event"] == kind).count();
    assert_eq!(count("step") as u64, s.steps);
    assert_eq!(count("start"), 1);
    assert_eq!(count("end"), 1);
    assert!(count("eval") >= 3);
}

#[test]
fn resume_after_k_steps_equals_uninterrupted_training() {
    let data = digits();
    for optimizer in [sgd(), adam()] {
        let (k, j) = (30u64, 25u64);
        let whole_dir = tempfile::tempdir().unwrap();
        let mut whole = config(whole_dir.path(), optimizer.clone());
        whole.max_steps = Some(k + j);
        whole.checkpoint_every = k + j;
        train_local(&whole, &data, &mut |_| {}).unwrap();

        let split_dir = tempfile::tempdir().unwrap();
        let mut first = config(split_dir.path(), optimizer.clone());
        first.max_steps = Some(k);
        first.checkpoint_every = k;
        train_local(&first, &data, &mut |_| {}).unwrap();
        let mut second = first.clone();
        second.max_steps = Some(k + j);
        second.checkpoint_every = k + j;
        second.resume = Some(split_dir.path().to_path_buf());
        let s = train_local(&second, &data, &mut |_| {}).unwrap();
        assert_eq!(s.steps, k + j);
        // Its record is the whole run's — every sample, and the training and wall
        // time of both attempts — not the part after the resume.
        let log = std::fs::read_to_string(split_dir.path().join("metrics.jsonl")).unwrap();
        let last_of_first = log
            .lines()
            .find(|l| l.contains("\"event\":\"step\"") && l.contains(&format!("\"step\":{k},")))
            .unwrap();
        let first_seconds =
            serde_json::from_str::<serde_json::Value>(last_of_first).unwrap()["train_seconds"]
                .as_f64()
                .unwrap();
        assert_eq!(s.samples, (k + j) * first.batch_size as u64, "{s:?}");
        assert!(s.train_seconds > first_seconds, "{s:?}");
        assert!(s.wall_seconds >= s.train_seconds, "{s:?}");

        let a = final_params(whole_dir.path(), &whole, &data);
        let b = final_params(split_dir.path(), &second, &data);
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        println!(
            "{optimizer:?}: {k}+{j} steps vs {} steps: max |Δparam| = {diff:e}",
            k + j
        );
        assert!(a == b, "resumed training must be bit-identical");
        // The step events of the resumed run continue the log of the first.
        let log = std::fs::read_to_string(split_dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(
            log.lines()
                .filter(|l| l.contains("\"event\":\"step\""))
                .count() as u64,
            k + j
        );
    }
}

#[test]
fn checkpoint_with_wrong_hash_or_other_settings_is_refused() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), sgd());
    cfg.max_steps = Some(5);
    cfg.checkpoint_every = 5;
    train_local(&cfg, &data, &mut |_| {}).unwrap();
    let ckpt: PathBuf = checkpoint::resolve(tmp.path()).unwrap();

    let mut other = cfg.clone();
    other.out = tmp.path().join("resumed");
    other.resume = Some(ckpt.clone());
    other.batch_size = 16;
    let err = train_local(&other, &data, &mut |_| {}).unwrap_err();
    assert!(
        err.to_string().contains("batch size 32") && err.is_usage(),
        "{err}"
    );

    // Flip one byte of the stage file: the hash check refuses it before anything is loaded.
    let file = ckpt.join("stage-0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let mut resume = cfg.clone();
    resume.out = tmp.path().join("resumed2");
    resume.resume = Some(ckpt.clone());
    let err = train_local(&resume, &data, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("stage-0.safetensors") && err.contains("SHA-256"),
        "{err}"
    );
}

#[test]
fn checkpoint_loads_into_any_partition_of_the_model() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), sgd());
    cfg.max_steps = Some(4);
    cfg.checkpoint_every = 4;
    train_local(&cfg, &data, &mut |_| {}).unwrap();
    let whole = final_params(tmp.path(), &cfg, &data);
    let dir = checkpoint::resolve(tmp.path()).unwrap();
    let manifest: Manifest = checkpoint::read_manifest(&dir).unwrap();
    let layers = cfg.model.build(&Shape::image(8, 8, 1), 10).unwrap();
    let mut parts = Vec::new();
    for range in [0..3, 3..6, 6..layers.len()] {
        let mut stage = Stage::new(&layers, range, 0, 1);
        let mut opt = Optimizer::new(cfg.optimizer.clone(), stage.params().len());
        checkpoint::read_stage(&dir, &manifest, &mut stage, &mut opt).unwrap();
        parts.extend_from_slice(stage.params());
    }
    assert_eq!(parts, whole);
}

// A checkpoint whose writing fails leaves no directory behind (the previous one stays
// the newest), and --keep-checkpoints keeps only the newest N.
#[test]
fn r10_failed_checkpoints_leave_nothing_and_old_ones_are_pruned() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), sgd());
    cfg.max_steps = Some(8);
    cfg.checkpoint_every = 2;
    cfg.keep_checkpoints = Some(2);
    // Step 6's stage file cannot be written: a directory stands where it should go.
    let blocked = tmp.path().join("checkpoints/step-000000006");
    std::fs::create_dir_all(blocked.join("stage-0.safetensors")).unwrap();
    let err = train_local(&cfg, &data, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("stage-0.safetensors"), "{err}");
    assert!(
        !blocked.exists(),
        "the failed checkpoint's directory is removed"
    );
    assert_eq!(step_dirs(tmp.path()), ["step-000000002", "step-000000004"]);
    assert_eq!(
        checkpoint::resolve(tmp.path()).unwrap(),
        tmp.path().join("checkpoints/step-000000004")
    );
    // With the obstacle gone the run completes, keeping the two newest.
    let mut again = cfg.clone();
    again.out = tmp.path().join("second");
    train_local(&again, &data, &mut |_| {}).unwrap();
    assert_eq!(step_dirs(&again.out), ["step-000000006", "step-000000008"]);
}

/// The checkpoint directories of the run in `out`, in order.
fn step_dirs(out: &Path) -> Vec<String> {
    let mut dirs: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    dirs.sort();
    dirs
}

/// The steps of `metrics.jsonl`'s evaluation with the lowest loss, and of its checkpoints.
fn lowest_loss_and_checkpoints(out: &Path) -> (u64, Vec<u64>) {
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let events: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut lowest = (f64::INFINITY, 0);
    for e in events.iter().filter(|e| e["event"] == "eval") {
        let loss = e["test_loss"].as_f64().unwrap();
        if loss < lowest.0 {
            lowest = (loss, e["step"].as_u64().unwrap());
        }
    }
    let checkpoints = events
        .iter()
        .filter(|e| e["event"] == "checkpoint")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    (lowest.1, checkpoints)
}

/// An early-stopped run ends once its validation loss has not fallen for `--early-stop`
/// evaluations, with a checkpoint of its last step; the checkpoint of its lowest validation
/// loss is marked `best`, spared by `--keep-checkpoints` and what its weights resolve to.
#[test]
fn early_stop_ends_the_run_and_keeps_the_best_evaluation_s_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut cfg = config(&out, sgd());
    cfg.epochs = 60;
    cfg.schedule = Defaulted::given(LrSchedule::Constant);
    cfg.lr = Defaulted::given(0.1);
    cfg.eval_every = 10;
    cfg.checkpoint_every = ringtmp_strategy::CHECKPOINT_AT_END;
    cfg.keep_checkpoints = Some(1);
    cfg.keep_best = true;
    cfg.early_stop = Some(2);
    let data = digits();
    let total = cfg.schedule_steps((data.train.len() / cfg.batch_size) as u64, cfg.batch_size);
    let summary = train_local(&cfg, &data, &mut |_| {}).unwrap();
    assert!(summary.steps < total, "{} of {total} steps", summary.steps);
    let (best, checkpoints) = lowest_loss_and_checkpoints(&out);
    assert!(
        best < summary.steps,
        "the best is {best}, the run ended at {}",
        summary.steps
    );
    assert!(checkpoints.contains(&best) && checkpoints.last() == Some(&summary.steps));
    let root = out.join("checkpoints");
    let best_dir = root.join(checkpoint::checkpoint_dir_name(best));
    assert_eq!(checkpoint::resolve_weights(&out).unwrap(), best_dir);
    assert_eq!(
        checkpoint::resolve(&out).unwrap(),
        root.join(checkpoint::checkpoint_dir_name(summary.steps)),
        "resuming goes on from the last"
    );
    assert_eq!(
        ringtmp_testkit::fixtures::step_dirs(&out),
        [best, summary.steps].map(checkpoint::checkpoint_dir_name),
        "one newest and the best"
    );
}
