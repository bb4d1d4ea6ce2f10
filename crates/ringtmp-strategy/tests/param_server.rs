//! Parameter-server oracle and learning tests on real loopback links (threads as nodes): BSP with
//! W workers of batch b equals `local` with batch W·b on the same example order; every
//! consistency model learns the digits.

use std::path::Path;

use ringtmp_data::Dataset;
use ringtmp_model::checkpoint;
use ringtmp_model::{LrSchedule, ModelSpec, Optimizer, OptimizerConfig, Shape, Stage};
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::param_server::driver::PsJob;
use ringtmp_strategy::{Defaulted, Origin, ResumePoint, TrainConfig};
use ringtmp_testkit::fixtures::{MLP_MODEL, digits, max_rel_diff};
use ringtmp_testkit::jobs::ps_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::oracle;
use ringtmp_testkit::run::{self, PsNode};

const WORKERS: usize = 3;
const SERVERS: usize = 2;
const WORKER_BATCH: usize = 8;
const STEPS: u64 = 15;

fn model() -> ModelSpec {
    ringtmp_testkit::fixtures::model(MLP_MODEL, "ps-test")
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
    }
}

/// `steps` global iterations of W × b examples on the digits (the oracle's configuration too).
fn config(steps: u64, out: &Path) -> TrainConfig {
    TrainConfig {
        model: model(),
        dataset: "digits".into(),
        wire_dtype: ringtmp_wire::Dtype::F32,
        data_dir: None,
        epochs: 1,
        batch_size: WORKER_BATCH * WORKERS,
        lr: Defaulted::given(0.05),
        schedule: Defaulted::given(LrSchedule::Constant),
        warmup_steps: Defaulted::given(0),
        optimizer: sgd(),
        threads: 1,
        seed: 9,
        target_accuracy: 0.5,
        eval_every: 0,
        out: out.to_path_buf(),
        checkpoint_every: 0,
        keep_checkpoints: None,
        resume: None,
        max_steps: Some(steps),
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

fn job(consistency: Consistency, steps: u64) -> PsJob {
    ps_job(
        &config(steps, Path::new("")),
        &digits(),
        SERVERS,
        WORKERS,
        consistency,
    )
}

/// `local` with batch W·b for `STEPS` steps; its final parameters.
fn local_params(data: &Dataset, out: &Path) -> Vec<f32> {
    oracle::local_params(&config(STEPS, out), data)
}

/// Runs servers and workers on loopback; returns the servers' shards concatenated, each worker's
/// test accuracy on its final replica, and the servers' staleness histograms.
fn run(job: &PsJob, data: &Dataset, speeds: &[f64]) -> (Vec<f32>, Vec<f64>, Vec<Vec<u64>>) {
    let (mut params, mut accuracies, mut staleness) = (Vec::new(), Vec::new(), Vec::new());
    for node in run::ps_nodes(&Backend::Tcp, job, data, speeds).results {
        match node.unwrap_or_else(|e| panic!("{e}")) {
            PsNode::Server(server) => {
                params.extend(server.params);
                staleness.push(server.staleness);
            }
            PsNode::Worker(_, acc) => accuracies.push(acc),
        }
    }
    (params, accuracies, staleness)
}

#[test]
fn bsp_with_w_workers_equals_local_with_w_times_the_batch() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let oracle = local_params(&data, &tmp.path().join("local"));
    let (params, _, staleness) = run(&job(Consistency::Bsp, STEPS), &data, &[]);
    let diff = max_rel_diff(&params, &oracle);
    println!(
        "bsp, {WORKERS} workers × {WORKER_BATCH} vs local batch {}: max |Δparam| / max |param| = {diff:.2e}",
        WORKERS * WORKER_BATCH
    );
    assert!(diff < 1e-4, "{diff}");
    for h in staleness {
        assert_eq!(h.len(), 1, "bsp never lets a worker start ahead: {h:?}");
    }
}

/// A stale (ASP) push is one optimizer step at the iteration's rate ÷ W, not a gradient scaled
/// by 1/W (a no-op for Adam, which normalises it away): with one worker every push is a whole
/// iteration, so one ASP worker's Adam run is `local`'s Adam run at the same rate.
#[test]
fn one_asp_worker_under_adam_equals_local() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(STEPS, &tmp.path().join("local"));
    cfg.batch_size = WORKER_BATCH;
    cfg.lr = Defaulted::given(0.002);
    cfg.optimizer = OptimizerConfig::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let oracle = oracle::local_params(&cfg, &data);
    let job = ps_job(&cfg, &data, 1, 1, Consistency::Asp);
    let (params, _, _) = run(&job, &data, &[]);
    let diff = max_rel_diff(&params, &oracle);
    assert!(
        diff < 1e-4,
        "one ASP worker's Adam differs from local's by {diff}"
    );
}

/// A BSP server sums an iteration's gradients in worker order, not arrival order: runs whose
/// pushes arrive in different orders (here a different worker is slowed each time) end with
/// bit-identical parameters.
#[test]
fn bsp_does_not_depend_on_the_order_pushes_arrive_in() {
    let data = digits();
    let job = job(Consistency::Bsp, 8);
    let (first, _, _) = run(&job, &data, &[0.3, 1.0, 1.0]);
    let (second, _, _) = run(&job, &data, &[1.0, 1.0, 0.3]);
    assert!(
        first == second,
        "max difference {:.2e}",
        max_rel_diff(&first, &second)
    );
}

/// Servers checkpoint their shards; a run resumed from them — here on another number of
/// servers, so every shard boundary moves — continues BSP exactly: bit-identical parameters.
#[test]
fn bsp_checkpoint_then_resume_on_another_server_count_equals_uninterrupted() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let (uninterrupted, _, _) = run(&job(Consistency::Bsp, STEPS), &data, &[]);

    let mut first = job(Consistency::Bsp, 6);
    first.spec.config.checkpoint_every = 6;
    first.spec.config.out = tmp.path().to_path_buf();
    run(&first, &data, &[]);
    let dir = checkpoint::resolve(tmp.path()).unwrap();
    let manifest = checkpoint::read_manifest(&dir).unwrap();
    assert_eq!((manifest.step, manifest.files.len()), (6, SERVERS));
    assert_eq!(manifest.strategy, "ps");

    let mut rest = job(Consistency::Bsp, STEPS);
    rest.servers = 1;
    rest.spec.resume_from = Some(ResumePoint {
        dir: dir.clone(),
        step: manifest.step,
    });
    let (resumed, _, _) = run(&rest, &data, &[]);
    let diff = max_rel_diff(&resumed, &uninterrupted);
    println!(
        "bsp: 6 iterations on {SERVERS} servers + checkpoint + {} on 1 server vs {STEPS} uninterrupted: {diff:.2e}",
        STEPS - 6
    );
    assert!(resumed == uninterrupted, "{diff}");

    // The shards' checkpoint loads into a whole model too (any strategy can resume from it).
    let layers = model().build(&Shape::image(8, 8, 1), 10).unwrap();
    let mut stage = Stage::new(&layers, 0..layers.len(), 0, 1);
    let mut opt = Optimizer::new(sgd(), stage.params().len());
    checkpoint::read_stage(&dir, &manifest, &mut stage, &mut opt).unwrap();
    assert_eq!(opt.steps(), 6);
}

#[test]
fn every_consistency_model_learns_with_a_straggler() {
    let data = digits();
    for c in [
        Consistency::Bsp,
        Consistency::Ssp { staleness: 2 },
        Consistency::Asp,
        Consistency::Dssp { lower: 1, upper: 4 },
    ] {
        let (_, accuracies, staleness) = run(&job(c, 60), &data, &[1.0, 1.0, 0.5]);
        let worst = accuracies.iter().copied().fold(1.0, f64::min);
        let most_ahead = staleness
            .iter()
            .map(|h| h.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        println!(
            "{}: worst worker accuracy {worst:.3}, most iterations ahead {most_ahead}",
            c.name()
        );
        // Random guessing is 0.1; asynchronous runs vary with timing (0.82–0.88 seen here).
        assert!(worst > 0.7, "{}: {accuracies:?}", c.name());
        match c {
            Consistency::Ssp { staleness: s } => assert!(most_ahead <= s as usize),
            Consistency::Dssp { upper, .. } => assert!(most_ahead <= upper as usize),
            Consistency::Bsp => assert_eq!(most_ahead, 0),
            Consistency::Asp => {}
        }
    }
}

/// A GPT's configuration: SGD (its update is proportional to the gradient, so a factor that were
/// not the whole batch's would show) and a clipping norm low enough that every step clips.
fn gpt_config(data: &Dataset, text: ringtmp_strategy::TextSource, out: &Path) -> TrainConfig {
    TrainConfig {
        model: ringtmp_testkit::fixtures::gpt(data.classes, 16),
        dataset: "text".into(),
        text: Some(text),
        source: None,
        init_from: None,
        lr: Defaulted::given(0.5),
        clip_grad_norm: Some(0.05),
        ..config(10, out)
    }
}

/// Under BSP the servers clip the mean gradient by its global norm, their shares of it summed
/// across servers: a GPT trained so equals `local` with the whole batch clipped as one. (Without
/// the clipping the run ends elsewhere: it is active.)
#[test]
fn a_gpt_under_bsp_clips_by_the_global_norm_across_servers_like_local() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    let cfg = gpt_config(&data, text, &tmp.path().join("local"));
    let oracle = oracle::local_params(&cfg, &data);
    let unclipped = oracle::local_params(
        &TrainConfig {
            clip_grad_norm: None,
            out: tmp.path().join("unclipped"),
            ..cfg.clone()
        },
        &data,
    );
    assert!(
        max_rel_diff(&oracle, &unclipped) > 1e-3,
        "clipping is active"
    );
    for servers in [1, SERVERS] {
        let job = ps_job(&cfg, &data, servers, WORKERS, Consistency::Bsp);
        let (params, _, _) = run(&job, &data, &[]);
        let diff = max_rel_diff(&params, &oracle);
        assert!(
            diff < 1e-4,
            "{servers} servers: differs from local by {diff}"
        );
    }
    // Without clipping too (each worker's mean over its tokens, averaged over the workers).
    let unclipped_cfg = TrainConfig {
        clip_grad_norm: None,
        lr: Defaulted::given(0.05),
        out: tmp.path().join("unclipped-local"),
        ..cfg.clone()
    };
    let oracle = oracle::local_params(&unclipped_cfg, &data);
    let job = ps_job(&unclipped_cfg, &data, SERVERS, WORKERS, Consistency::Bsp);
    let (params, _, _) = run(&job, &data, &[]);
    let diff = max_rel_diff(&params, &oracle);
    assert!(diff < 1e-4, "unclipped: differs from local by {diff}");
}

/// Under a stale model each worker clips the gradient it pushes: a GPT trains (its validation
/// loss falls below a uniform guess's).
#[test]
fn a_gpt_under_ssp_clips_each_workers_gradient_and_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    let cfg = TrainConfig {
        lr: Defaulted::given(0.2),
        clip_grad_norm: Some(1.0),
        max_steps: Some(60),
        ..gpt_config(&data, text, &tmp.path().join("ssp"))
    };
    let job = ps_job(
        &cfg,
        &data,
        SERVERS,
        WORKERS,
        Consistency::Ssp { staleness: 1 },
    );
    let (params, _, _) = run(&job, &data, &[]);
    let layers = ringtmp_strategy::layers_for(&cfg.model, &data).unwrap();
    let mut stage = Stage::new(&layers, 0..layers.len(), cfg.seed, 1);
    let before = ringtmp_strategy::evaluation::evaluate(&mut stage, &data.test, data.classes)
        .unwrap()
        .loss;
    stage.params_mut().copy_from_slice(&params);
    let after = ringtmp_strategy::evaluation::evaluate(&mut stage, &data.test, data.classes)
        .unwrap()
        .loss;
    println!("ssp with clipping: validation loss {before:.3} before, {after:.3} after");
    // The order of stale pushes follows the timing: after 60 steps 0.74 to 1.10 lower in runs
    // seen here, idle and beside three busy loops (after 40, once only 0.37, in a checked
    // build): a bar well below that.
    assert!(
        after < before - 0.2,
        "validation loss {before:.3} before, {after:.3} after"
    );
}
