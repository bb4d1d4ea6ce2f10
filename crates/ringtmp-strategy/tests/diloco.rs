//! DiLoCo against its oracles: with H = 1 and an outer SGD of rate 1 without momentum it is
//! all-reduce SGD (so `local` with the global batch); with H > 1 its outer steps equal a
//! hand-computed DiLoCo on a tiny model; the replicas end identical; a worker synchronises
//! 1/H as often as all-reduce does (bytes measured); a dead worker is dropped from the next
//! average; `--inner-seconds` bounds the inner steps.

use std::path::Path;

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_model::{LrSchedule, Optimizer, OptimizerConfig};
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::collective::outer::OuterConfig;
use ringtmp_strategy::diloco::OuterDtype;
use ringtmp_testkit::fixtures::{CONV_MODEL, deep_mlp, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::diloco_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::oracle;
use ringtmp_testkit::run;
use ringtmp_transport::sim::test_seed;

fn config(spec: ringtmp_model::ModelSpec, batch: usize, steps: u64, out: &Path) -> TrainConfig {
    TrainConfig {
        seed: 11,
        ..ringtmp_testkit::fixtures::train_config(spec, batch, steps, out)
    }
}

/// Every worker's replica, checked bit-identical; the first one, and rank 0's summary.
fn replicas_agree(results: Vec<run::Replica>) -> (Vec<f32>, ringtmp_metrics::Summary) {
    let mut replicas = Vec::new();
    let mut summary = None;
    for (rank, r) in results.into_iter().enumerate() {
        let (params, s) = r.unwrap_or_else(|e| panic!("worker {rank} failed: {e}"));
        replicas.push(params);
        summary = summary.or(s);
    }
    assert!(replicas.windows(2).all(|w| w[0] == w[1]), "replicas differ");
    (
        replicas.swap_remove(0),
        summary.expect("rank 0 reports the run"),
    )
}

const AVERAGING: OuterConfig = OuterConfig {
    lr: 1.0,
    momentum: 0.0,
    nesterov: false,
    follow_schedule: false,
};

const PAPER: OuterConfig = OuterConfig {
    lr: 0.7,
    momentum: 0.9,
    nesterov: true,
    follow_schedule: false,
};

#[test]
fn one_inner_step_and_an_averaging_outer_step_is_all_reduce_sgd() {
    // The mean of the stepped replicas is the step of the mean gradient; SGD's momentum and
    // weight decay are linear, so each worker's own velocity averages to all-reduce's.
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        model(CONV_MODEL, "ring-test"),
        24,
        10,
        &tmp.path().join("local"),
    );
    let oracle = oracle::local_params(&cfg, &data);
    for backend in [Backend::Tcp, Backend::sim(test_seed(21))] {
        for (workers, fragments) in [(2, 1), (3, 1), (4, 1)] {
            let job = diloco_job(&cfg, &data, workers, 1, AVERAGING, fragments, 4096);
            let out = tmp.path().join(format!("{workers}-{}", backend.name()));
            let (params, summary) =
                replicas_agree(run::diloco_nodes(&backend, &job, &data, &out).results);
            let diff = max_rel_diff(&params, &oracle);
            println!(
                "diloco H = 1, {workers} workers ({}): max |Δparam| / max |param| = {diff:.2e}",
                backend.name()
            );
            assert!(
                diff < 1e-4,
                "{workers} workers on {}: {diff}",
                backend.name()
            );
            assert_eq!(summary.steps, 10);
            assert_eq!(summary.samples, 10 * 24);
        }
    }
}

/// DiLoCo by hand: every worker trains its own copy on its shares with its own optimizer; every
/// `h` steps (each fragment at its turn) the mean of (outer − own) goes through Nesterov SGD
/// written out here, applied at once or `job.overlap` steps later with `job.mix` of the
/// fragment's own parameters kept; at the end every fragment synchronises at once.
fn hand_diloco(job: &ringtmp_strategy::diloco::DilocoJob, data: &Dataset) -> Vec<f32> {
    let spec = &job.spec;
    let layers = spec.layers().unwrap();
    let n = job.workers;
    let mut stages: Vec<_> = (0..n)
        .map(|_| {
            spec.initial_stage(&layers, 0..layers.len(), 1, false)
                .unwrap()
        })
        .collect();
    let mut optimizers: Vec<_> = (0..n)
        .map(|_| Optimizer::new(spec.optimizer.clone(), stages[0].params().len()))
        .collect();
    let tensors: Vec<_> = stages[0]
        .param_ranges()
        .map(|(_, r)| r)
        .filter(|r| !r.is_empty())
        .collect();
    let parts = ringtmp_strategy::collective::outer::fragments(&tensors, job.fragments);
    let f = parts.len() as u64;
    let mut global = stages[0].params().to_vec();
    let mut velocity = vec![0.0f32; global.len()];
    let mut plan = BatchPlan::new(data.train.len(), spec.batch_size * n, spec.seed).unwrap();
    let mut share = ringtmp_strategy::data_parallel::ShareBuffers::default();
    // (lands at, fragment range, mean pseudo-gradient, its rate)
    let mut pending: Option<(u64, std::ops::Range<usize>, Vec<f32>, f32)> = None;
    let (lr, mu) = (job.outer.lr, job.outer.momentum);
    // Under the schedule-following outer step, the pseudo-gradient of the H steps before `done`
    // enters the momentum divided by their mean rate (over the peak), and the step is taken at
    // that rate.
    let rate_before = |done: u64| -> f32 {
        if !job.outer.follow_schedule {
            return 1.0;
        }
        let from = done.saturating_sub(job.inner_steps);
        let sum: f64 = (from..done).map(|s| f64::from(spec.lr_at(s))).sum();
        (sum / (done - from) as f64 / f64::from(*spec.lr)) as f32
    };
    let mut apply = |range: std::ops::Range<usize>,
                     delta: &[f32],
                     rate: f32,
                     mix: f32,
                     global: &mut Vec<f32>,
                     stages: &mut Vec<ringtmp_model::Stage>| {
        for (k, i) in range.clone().enumerate() {
            let g = delta[k] / rate;
            velocity[i] = mu * velocity[i] + g;
            global[i] -= lr * rate * (g + mu * velocity[i]);
        }
        for s in stages.iter_mut() {
            for i in range.clone() {
                let own = s.params()[i];
                s.params_mut()[i] = mix * own + (1.0 - mix) * global[i];
            }
        }
    };
    let mean_delta =
        |range: &std::ops::Range<usize>, global: &[f32], stages: &[ringtmp_model::Stage]| {
            range
                .clone()
                .map(|i| {
                    stages
                        .iter()
                        .map(|s| global[i] - s.params()[i])
                        .sum::<f32>()
                        / n as f32
                })
                .collect::<Vec<f32>>()
        };
    for step in 0..spec.total_steps {
        for r in 0..n {
            ringtmp_strategy::data_parallel::forward_share(
                spec,
                &mut plan,
                data,
                &mut stages[r],
                r as u32,
                n,
                step,
                &mut share,
            )
            .unwrap();
            stages[r].backward(0, &share.dlogits).unwrap();
            stages[r].step(&mut optimizers[r], spec.lr_at(step));
        }
        let done = step + 1;
        if let Some((at, range, delta, rate)) = pending.take() {
            if at <= done {
                apply(range, &delta, rate, job.mix, &mut global, &mut stages);
            } else {
                pending = Some((at, range, delta, rate));
            }
        }
        let rate = rate_before(done);
        if done == spec.total_steps {
            let all = 0..global.len();
            let delta = mean_delta(&all, &global, &stages);
            apply(all, &delta, rate, 0.0, &mut global, &mut stages);
            continue;
        }
        for (p, range) in parts.iter().enumerate() {
            if done % job.inner_steps != ((p as u64 + 1) * job.inner_steps / f) % job.inner_steps {
                continue;
            }
            let delta = mean_delta(range, &global, &stages);
            if job.overlap > 0 && done + job.overlap < spec.total_steps {
                pending = Some((done + job.overlap, range.clone(), delta, rate));
            } else {
                apply(range.clone(), &delta, rate, 0.0, &mut global, &mut stages);
            }
        }
    }
    global
}

#[test]
fn outer_nesterov_steps_equal_hand_computed_ones() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let adamw = OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_embeddings: false,
    };
    let decaying = LrSchedule::CosineTo { min_ratio: 0.1 };
    // The outer step following the inner schedule: with a decaying rate and warm-up (every
    // interval's rate differs, the last interval is short), and with a constant one (where it
    // is the paper's step).
    let following = OuterConfig {
        follow_schedule: true,
        ..PAPER
    };
    let sgd = OptimizerConfig::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
    };
    for (optimizer, schedule, warmup, outer, h, steps) in [
        (sgd.clone(), LrSchedule::Constant, 0, PAPER, 3, 9),
        (adamw.clone(), LrSchedule::Constant, 0, PAPER, 4, 10),
        (adamw.clone(), decaying, 3, following, 4, 10),
        (sgd, LrSchedule::Constant, 0, following, 3, 9),
    ] {
        let cfg = TrainConfig {
            optimizer,
            lr: Defaulted::given(0.01),
            schedule: Defaulted::given(schedule),
            warmup_steps: Defaulted::given(warmup),
            ..config(deep_mlp(2, 16), 24, steps, tmp.path())
        };
        for (fragments, overlap) in [(1, 0), (2, 1), (2, 0), (1, 1)] {
            let mut job = diloco_job(&cfg, &data, 3, h, outer, fragments, 512);
            job.overlap = overlap;
            let expected = hand_diloco(&job, &data);
            let backend = Backend::sim(test_seed(22));
            let (params, summary) =
                replicas_agree(run::diloco_nodes(&backend, &job, &data, tmp.path()).results);
            let diff = max_rel_diff(&params, &expected);
            let moved = max_rel_diff(&params, &hand_start(&job));
            println!(
                "H = {h}, {fragments} fragment(s), overlap {overlap}, {steps} steps, outer step \
                 following the schedule {}: max |Δ| against the hand-computed run {diff:.2e}",
                outer.follow_schedule
            );
            assert!(
                diff < 1e-5,
                "{fragments} fragments, overlap {overlap}: {diff}"
            );
            assert!(moved > 1e-3, "the model moved ({moved})");
            assert_eq!(summary.steps, steps);
        }
    }
}

fn hand_start(job: &ringtmp_strategy::diloco::DilocoJob) -> Vec<f32> {
    let layers = job.spec.layers().unwrap();
    job.spec
        .initial_stage(&layers, 0..layers.len(), 1, false)
        .unwrap()
        .params()
        .to_vec()
}

#[test]
fn a_worker_moves_a_model_every_h_steps_whole_or_a_fragment_at_a_time() {
    // Each worker sends 2(N − 1)/N of what is reduced: the model every H steps (all-reduce SGD
    // sends it every step). F fragments move 1/F of it every H/F steps; at the run's end every
    // fragment not just synchronised synchronises once more (at most one model more). Bf16
    // halves the bytes, int8 quarters them.
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let (steps, h, workers) = (12u64, 4u64, 3usize);
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, steps, tmp.path());
    let backend = Backend::sim(test_seed(23));
    let n = workers as f64;
    let syncs = (steps / h) as f64;
    for (fragments, dtype) in [
        (1usize, OuterDtype::F32),
        (2, OuterDtype::F32),
        (4, OuterDtype::F32),
        (1, OuterDtype::Bf16),
        (1, OuterDtype::Int8),
    ] {
        let mut job = diloco_job(&cfg, &data, workers, h, PAPER, fragments, 4096);
        job.outer_dtype = dtype;
        let (params, summary) =
            replicas_agree(run::diloco_nodes(&backend, &job, &data, tmp.path()).results);
        let element = match dtype {
            OuterDtype::F32 => 4.0,
            OuterDtype::Bf16 | OuterDtype::F16 => 2.0,
            OuterDtype::Int8 => 1.0,
        };
        let ideal = 2.0 * (n - 1.0) / n * params.len() as f64 * element * syncs;
        for node in &summary.per_node {
            let ratio = node.bytes_sent as f64 / ideal;
            println!(
                "{fragments} fragments, {dtype:?}, rank {}: {} bytes, {ratio:.3}× a model every H steps",
                node.rank, node.bytes_sent
            );
            let end_extra = if fragments > 1 { 1.0 / syncs } else { 0.0 };
            assert!(
                (1.0..1.0 + end_extra + 0.035 * 4.0 / element).contains(&ratio),
                "{fragments} fragments, {dtype:?}: {ratio}"
            );
        }
        assert!(params.iter().all(|p| p.is_finite()));
    }
}

/// A worker that dies between synchronisations is dropped from the next average: the survivors
/// re-form the ring, redo that synchronisation without it and finish together.
#[test]
fn a_dead_worker_is_dropped_from_the_next_average() {
    use ringtmp_transport::sim::{Fault, SimConfig};
    use std::time::Duration;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, 30, tmp.path());
    for (case, (dead, at, fragments, overlap)) in [
        (2u32, 30u64, 1, 0),
        (1, 5, 1, 0),
        (3, 60, 1, 0),
        (2, 30, 2, 1),
        (1, 12, 5, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let mut job = diloco_job(&cfg, &data, 4, 5, PAPER, fragments, 4096);
        job.overlap = overlap;
        let mut sim = SimConfig::new(test_seed(24) + case as u64);
        sim.faults.push(Fault::Die {
            rank: dead,
            at: Duration::from_millis(at),
        });
        let out = tmp.path().join(format!("case-{case}"));
        let ran = run::diloco_nodes(&Backend::Sim(sim), &job, &data, &out);
        let survivors: Vec<run::Replica> = ran
            .results
            .into_iter()
            .enumerate()
            .filter(|(r, _)| *r as u32 != dead)
            .map(|(_, x)| x)
            .collect();
        let (params, summary) = replicas_agree(survivors);
        assert!(params.iter().all(|p| p.is_finite()));
        assert_eq!(summary.steps, 30);
        let left: Vec<u32> = summary.dropped_nodes.iter().map(|d| d.rank).collect();
        assert_eq!(left, vec![dead], "{summary:?}");
        println!(
            "{fragments} fragment(s), overlap {overlap}: rank {dead} died at {at} ms, dropped at \
             step {}",
            summary.dropped_nodes[0].step
        );
    }
}

/// `--inner-seconds`: a worker out of time skips to the next synchronisation. With a window
/// no step fits in, every worker takes exactly the first inner step of each interval.
#[test]
fn inner_seconds_bound_the_inner_steps() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let (steps, h) = (20u64, 5u64);
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, steps, tmp.path());
    let mut job = diloco_job(&cfg, &data, 3, h, PAPER, 1, 4096);
    job.inner_seconds = Some(1e-9);
    let (params, summary) = replicas_agree(
        run::diloco_nodes(&Backend::sim(test_seed(25)), &job, &data, tmp.path()).results,
    );
    assert!(params.iter().all(|p| p.is_finite()));
    for node in &summary.per_node {
        assert_eq!(node.iterations, steps / h, "rank {}", node.rank);
    }
    // The run's samples are the examples trained: the skipped shares are not (the global
    // batch of 24 shared by the workers, 4 steps of 20 taken).
    assert_eq!(summary.samples, 24 * steps / h);
    assert_eq!(
        summary.per_node.iter().map(|n| n.samples).sum::<u64>(),
        summary.samples
    );
    // Unbounded, every step is taken.
    job.inner_seconds = None;
    let (_, summary) = replicas_agree(
        run::diloco_nodes(&Backend::sim(test_seed(25)), &job, &data, tmp.path()).results,
    );
    assert!(summary.per_node.iter().all(|n| n.iterations == steps));
    assert_eq!(summary.samples, 24 * steps);
}
