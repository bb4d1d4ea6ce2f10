//! AD-PSGD against its invariants, on the seeded simulated network over many seeds, node speeds
//! and delays: no run deadlocks, every averaging a worker starts completes on both sides, and
//! with a zero learning rate pairwise averaging keeps the sum of the models (to float rounding)
//! while bringing them together. With a real rate the workers' average learns, on TCP (where a
//! passive worker answers from its network thread while it computes) and in simulation; a seed
//! replays bit for bit; a dead worker is skipped by its neighbours and the run completes.

use std::path::Path;
use std::time::Duration;

use ringtmp_model::OptimizerConfig;
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::TrainConfig;
use ringtmp_testkit::fixtures::{MLP_MODEL, digits, model};
use ringtmp_testkit::jobs::adpsgd_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::run::{self, GossipReplica};
use ringtmp_transport::sim::{Fault, SimConfig, test_seed};

fn config(batch: usize, steps: u64, lr: f32, out: &Path) -> TrainConfig {
    TrainConfig {
        epochs: 3,
        lr: Defaulted::given(lr),
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        },
        seed: 13,
        ..ringtmp_testkit::fixtures::train_config(
            model(MLP_MODEL, "adpsgd-test"),
            batch,
            steps,
            out,
        )
    }
}

fn ok(ran: Vec<GossipReplica>) -> Vec<(Vec<f32>, u64, Option<ringtmp_metrics::Summary>)> {
    ran.into_iter()
        .enumerate()
        .map(|(r, m)| m.unwrap_or_else(|e| panic!("worker {r}: {e}")))
        .collect()
}

/// A small deterministic generator for the test's random choices (xorshift64*).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn averaging_conserves_the_sum_completes_and_never_deadlocks_over_many_seeds() {
    // Ref: Lian et al. 2018 — each averaging replaces x_a and x_p by (x_a + x_p)/2, which keeps
    // x_a + x_p; the bipartite split leaves no cycle of waits.
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let base = test_seed(100);
    for case in 0..12u64 {
        let seed = base + case;
        let mut draw = Draw(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let workers = [2, 4, 6, 8][(case % 4) as usize];
        let mut sim = SimConfig::new(seed);
        sim.jitter = Duration::from_micros((draw.next() * 3000.0) as u64);
        for r in 0..workers as u32 {
            // Speeds from a quarter to full; one link slowed for a while.
            sim.node_speed.insert(r, 0.25 + 0.75 * draw.next());
        }
        sim.faults.push(Fault::Delay {
            from: 1,
            to: 0,
            start: Duration::from_millis(5),
            end: Duration::from_millis(40),
            extra: Duration::from_millis((1.0 + draw.next() * 20.0) as u64),
        });
        let job = adpsgd_job(&config(2 * workers, 12, 0.0, tmp.path()), &data, workers);
        let start = |rank: u32| -> Vec<f32> {
            // Workers start apart: the seed's model, scaled and shifted per rank.
            let layers = job.spec.layers().unwrap();
            let stage = ringtmp_model::Stage::new(&layers, 0..layers.len(), 13, 1);
            let k = rank as f32;
            stage
                .params()
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1.0 + k) + 0.01 * k * ((i % 7) as f32 - 3.0))
                .collect()
        };
        let initial: Vec<Vec<f32>> = (0..workers as u32).map(start).collect();
        let ran = run::adpsgd_nodes(&Backend::Sim(sim), &job, &data, tmp.path(), Some(&start));
        let results = ok(ran.results);
        // Every averaging completed on both sides: as many on the active side as on the passive.
        let (active, passive): (u64, u64) =
            results.iter().enumerate().fold((0, 0), |(a, p), (r, x)| {
                if r % 2 == 0 {
                    (a + x.1, p)
                } else {
                    (a, p + x.1)
                }
            });
        assert_eq!(
            active, passive,
            "seed {seed}: an averaging was left half done"
        );
        assert!(active > 0, "seed {seed}: no averaging happened");
        // The sum is conserved.
        let len = initial[0].len();
        let sum = |xs: &[&Vec<f32>]| -> Vec<f64> {
            (0..len)
                .map(|j| xs.iter().map(|x| f64::from(x[j])).sum())
                .collect()
        };
        let before = sum(&initial.iter().collect::<Vec<_>>());
        let after = sum(&results.iter().map(|r| &r.0).collect::<Vec<_>>());
        let scale = before.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let worst = before
            .iter()
            .zip(&after)
            .map(|(b, a)| (b - a).abs())
            .fold(0.0f64, f64::max);
        assert!(
            worst <= 1e-5 * scale,
            "seed {seed}, {workers} workers: the sum moved by {worst} (scale {scale})"
        );
        // And the models came together.
        let summary = results[0].2.as_ref().expect("rank 0 reports the run");
        assert!(
            summary.consensus_distance.is_some_and(|d| d < 0.5),
            "seed {seed}: {:?}",
            summary.consensus_distance
        );
        assert_eq!(summary.steps, 12, "seed {seed}");
        // Rank 0's grants end the run on its budget, however the speeds and delays fall: 12
        // global steps of `workers` iterations of 2 × workers / workers examples each.
        assert_eq!(
            summary.samples,
            12 * 2 * workers as u64,
            "seed {seed}: the workers trained beyond (or short of) the run's samples"
        );
        assert!(summary.dropped_nodes.is_empty());
    }
}

#[test]
fn the_average_learns_on_tcp_and_in_simulation_and_a_seed_replays() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(64, 60, 0.2, tmp.path());
    cfg.eval_every = 20;
    cfg.checkpoint_every = 30;
    let job = adpsgd_job(&cfg, &data, 4);
    for backend in [Backend::Tcp, Backend::sim(test_seed(4))] {
        let out = tmp.path().join(backend.name());
        let ran = run::adpsgd_nodes(&backend, &job, &data, &out, None);
        let results = ok(ran.results);
        let summary = results[0].2.clone().expect("rank 0 reports the run");
        println!(
            "{}: consensus accuracy {:.3}, distance {:?}, {:.0} samples/s",
            backend.name(),
            summary.final_test_accuracy,
            summary.consensus_distance,
            summary.samples_per_second
        );
        // On TCP the threads' timing decides which gossip meets which step, so the final
        // accuracy spreads: 0.845–0.909 over 13 runs (0.845 failed a bar of 0.85 in CI). The seeded simulation replays exactly and keeps the tighter bar; a broken
        // average stays near chance (0.1) on either.
        // The consensus distance spreads on TCP the same way (0.16 seen on an Intel Xeon kind
        // with the machine busy); the simulation's is exact.
        let (bar, distance_bar) = match backend {
            Backend::Tcp => (0.80, 0.25),
            _ => (0.85, 0.1),
        };
        assert!(summary.final_test_accuracy > bar, "{summary:?}");
        assert!(
            summary.steps == 60 && summary.samples == 60 * 64,
            "{summary:?}"
        );
        assert!(
            summary.consensus_distance.is_some_and(|d| d < distance_bar),
            "{summary:?}"
        );
        assert_eq!(summary.per_node.len(), 4);
        assert!(summary.per_node.iter().all(|n| n.test_accuracy.is_some()));
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let evals = metrics.lines().filter(|l| l.contains("\"event\":\"eval\""));
        let due = (1..=60).filter(|s| job.spec.eval_due(*s)).count();
        assert_eq!(
            evals.count(),
            due,
            "every 20 steps and every epoch: {metrics}"
        );
        // Checkpoints hold the average and every worker's own model, and resume as any other.
        for step in [30, 60] {
            let dir = out.join("checkpoints").join(format!("step-{step:09}"));
            let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
            assert_eq!((manifest.files.len(), manifest.replicas.len()), (1, 4));
            let layers = job.spec.layers().unwrap();
            let mut stage = ringtmp_model::Stage::new(&layers, 0..layers.len(), 1, 1);
            let mut opt = ringtmp_model::Optimizer::new(job.spec.optimizer.clone(), 0);
            opt = ringtmp_model::Optimizer::new(opt.config().clone(), stage.params().len());
            ringtmp_model::checkpoint::read_stage(&dir, &manifest, &mut stage, &mut opt).unwrap();
        }
        let last = out.join("checkpoints/step-000000060");
        let manifest = ringtmp_model::checkpoint::read_manifest(&last).unwrap();
        for (rank, entry) in manifest.replicas.iter().enumerate() {
            assert_eq!(entry.name, format!("replica-{rank}.safetensors"));
            let bytes = std::fs::read(last.join(&entry.name)).unwrap();
            assert_eq!(ringtmp_model::checkpoint::sha256_hex(&bytes), entry.sha256);
        }
    }
    let twice: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|i| {
            let out = tmp.path().join(format!("replay-{i}"));
            let ran = run::adpsgd_nodes(&Backend::sim(test_seed(4)), &job, &data, &out, None);
            ok(ran.results).into_iter().map(|r| r.0).collect()
        })
        .collect();
    assert!(twice[0] == twice[1], "a seed replays bit for bit");
}

#[test]
fn a_dead_worker_is_skipped_and_the_run_completes() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    for dead in [3u32, 2] {
        let job = adpsgd_job(&config(32, 60, 0.1, tmp.path()), &data, 4);
        let mut sim = SimConfig::new(test_seed(20) + u64::from(dead));
        sim.faults.push(Fault::Die {
            rank: dead,
            at: Duration::from_millis(30),
        });
        let out = tmp.path().join(format!("dead-{dead}"));
        let ran = run::adpsgd_nodes(&Backend::Sim(sim), &job, &data, &out, None);
        for (rank, result) in ran.results.iter().enumerate() {
            if rank as u32 != dead {
                assert!(result.is_ok(), "rank {rank}: {:?}", result.as_ref().err());
            }
        }
        let summary = ran.results[0].as_ref().unwrap().2.clone().unwrap();
        assert_eq!(summary.steps, 60, "the survivors do the run's work");
        assert_eq!(summary.dropped_nodes.len(), 1, "{summary:?}");
        assert_eq!(summary.dropped_nodes[0].rank, dead);
        assert!(summary.dropped_nodes[0].step < 60);
        assert!(
            summary.dropped_nodes[0]
                .reason
                .contains(&format!("rank {dead}")),
            "{summary:?}"
        );
        assert_eq!(summary.per_node.len(), 3, "the survivors report");
        assert!(summary.final_test_accuracy > 0.7, "{summary:?}");
    }
}

/// A GPT on AD-PSGD with clipping (each worker clips the gradient it applies): the consensus
/// model's validation loss falls well below a uniform guess's.
#[test]
fn a_gpt_trains_with_each_worker_clipping_its_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    let cfg = TrainConfig {
        model: ringtmp_testkit::fixtures::gpt(data.classes, 16),
        dataset: "text".into(),
        text: Some(text),
        source: None,
        init_from: None,
        clip_grad_norm: Some(1.0),
        ..config(16, 40, 0.2, &tmp.path().join("adpsgd"))
    };
    let job = adpsgd_job(&cfg, &data, 4);
    let ran = run::adpsgd_nodes(&Backend::sim(test_seed(8)), &job, &data, &cfg.out, None);
    let summary = ok(ran.results)
        .into_iter()
        .find_map(|r| r.2)
        .expect("rank 0 reports the run");
    let loss = summary
        .language
        .expect("a language model's figures")
        .final_val_loss;
    let uniform = (data.classes as f64).ln();
    println!("a GPT with clipping: validation loss {loss:.3} (a uniform guess {uniform:.3})");
    assert!(
        loss < uniform - 0.5,
        "validation loss {loss} (uniform {uniform})"
    );
}
