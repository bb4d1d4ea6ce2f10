//! D-PSGD against what the theory says: with a zero learning rate, gossip alone brings workers
//! that start apart to the mean of their starting models at the rate of the mixing matrix's
//! second eigenvalue, and keeps that mean; one worker is plain SGD (`local`); with a real rate,
//! the consensus model learns on both graphs, and a seed replays bit for bit.

use std::path::Path;

use ringtmp_model::OptimizerConfig;
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::collective::mixing::{Topology, second_eigenvalue};
use ringtmp_testkit::fixtures::{MLP_MODEL, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::dpsgd_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::{oracle, run};
use ringtmp_transport::sim::test_seed;

fn config(batch: usize, steps: u64, lr: f32, out: &Path) -> TrainConfig {
    TrainConfig {
        epochs: 3,
        lr: Defaulted::given(lr),
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        },
        seed: 13,
        ..ringtmp_testkit::fixtures::train_config(model(MLP_MODEL, "ps-test"), batch, steps, out)
    }
}

fn models(ran: Vec<run::Replica>) -> Vec<Vec<f32>> {
    ran.into_iter()
        .enumerate()
        .map(|(r, m)| m.unwrap_or_else(|e| panic!("worker {r}: {e}")).0)
        .collect()
}

/// √Σ_i ‖x_i − mean‖², and the mean.
fn spread(xs: &[Vec<f32>]) -> (f64, Vec<f64>) {
    let n = xs.len() as f64;
    let mean: Vec<f64> = (0..xs[0].len())
        .map(|j| xs.iter().map(|x| f64::from(x[j])).sum::<f64>() / n)
        .collect();
    let d = xs
        .iter()
        .map(|x| {
            x.iter()
                .zip(&mean)
                .map(|(a, m)| (f64::from(*a) - m).powi(2))
                .sum::<f64>()
        })
        .sum::<f64>()
        .sqrt();
    (d, mean)
}

#[test]
fn gossip_alone_converges_to_the_initial_mean_at_the_second_eigenvalue() {
    // Ref: Lian et al. 2017 — W symmetric, doubly stochastic: the mean is kept and the distance
    // to it shrinks by at least |λ2| per round, exactly |λ2| along the slowest mode.
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let steps = 6;
    let cases: [(Topology, usize, bool); 3] = [
        (Topology::Ring, 6, true),
        (Topology::Ring, 6, false),
        (Topology::Exp, 8, false),
    ];
    for (topology, n, slowest) in cases {
        // A vanishing rate and no momentum: only the averaging moves the models.
        let mut cfg = config(8 * n, steps, 1e-30, tmp.path());
        cfg.optimizer = OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let job = dpsgd_job(&cfg, &data, n, topology);
        let len = {
            let layers = cfg
                .model
                .build(&ringtmp_model::Shape::image(8, 8, 1), 10)
                .unwrap();
            layers.iter().map(|l| l.param_count()).sum::<usize>()
        };
        // Either the ring's slowest mode (worker r at cos(2πr/n) times one vector) or scattered.
        let initial = move |rank: u32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    let base = ((i as u64 * 2654435761 % 1000) as f32 / 500.0) - 1.0;
                    if slowest {
                        let phase = 2.0 * std::f32::consts::PI * rank as f32 / n as f32;
                        1.0 + base * phase.cos()
                    } else {
                        (((i as u64 * 2654435761 + u64::from(rank) * 40503) % 1000) as f32 / 500.0)
                            - 1.0
                    }
                })
                .collect()
        };
        let starts: Vec<Vec<f32>> = (0..n as u32).map(initial).collect();
        let (d0, mean0) = spread(&starts);
        let ran = run::dpsgd_nodes(
            &Backend::sim(test_seed(7)),
            &job,
            &data,
            tmp.path(),
            Some(&initial),
        );
        let ends = models(ran.results);
        let (d, mean) = spread(&ends);
        let predicted = second_eigenvalue(topology, n as u32).powi(steps as i32) * d0;
        println!(
            "{topology:?}, {n} workers{}: spread {d0:.3} → {d:.5} after {steps} rounds; λ2^t·d0 = {predicted:.5}",
            if slowest { " (slowest mode)" } else { "" }
        );
        assert!(d <= 1.001 * predicted + 1e-6, "{d} > {predicted}");
        if slowest {
            assert!(d >= 0.999 * predicted - 1e-6, "{d} < {predicted}");
        }
        let drift = mean
            .iter()
            .zip(&mean0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(drift < 1e-5, "the mean moved by {drift}");
    }
}

#[test]
fn one_worker_is_local_sgd() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(16, 12, 0.05, &tmp.path().join("local"));
    let oracle = oracle::local_params(&cfg, &data);
    let job = dpsgd_job(&cfg, &data, 1, Topology::Ring);
    let ends = models(
        run::dpsgd_nodes(&Backend::sim(test_seed(1)), &job, &data, tmp.path(), None).results,
    );
    let diff = max_rel_diff(&ends[0], &oracle);
    assert!(diff < 1e-6, "{diff}");
}

#[test]
fn the_consensus_learns_on_both_graphs_and_replays_from_its_seed() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(64, 60, 0.2, tmp.path());
    cfg.eval_every = 20;
    for (backend, topology) in [
        (Backend::Tcp, Topology::Ring),
        (Backend::sim(test_seed(4)), Topology::Exp),
    ] {
        let job = dpsgd_job(&cfg, &data, 4, topology);
        let ran = run::dpsgd_nodes(&backend, &job, &data, tmp.path(), None);
        let mut results = ran.results;
        let (_, summary) = results.remove(0).unwrap();
        let summary = summary.expect("rank 0 reports the run");
        println!(
            "{topology:?} on {}: consensus accuracy {:.3}, distance {:?}",
            backend.name(),
            summary.final_test_accuracy,
            summary.consensus_distance
        );
        assert!(summary.final_test_accuracy > 0.85, "{summary:?}");
        assert!(
            summary.consensus_distance.is_some_and(|d| d < 0.05),
            "{summary:?}"
        );
        assert!(summary.per_node.iter().all(|n| n.test_accuracy.is_some()));
    }
    let job = dpsgd_job(&cfg, &data, 4, Topology::Exp);
    let twice: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| {
            models(
                run::dpsgd_nodes(&Backend::sim(test_seed(4)), &job, &data, tmp.path(), None)
                    .results,
            )
        })
        .collect();
    assert!(twice[0] == twice[1], "a seed replays bit for bit");
}

/// D-PSGD stops when a worker dies, every other worker naming it.
#[test]
fn a_dead_worker_stops_dpsgd_naming_it() {
    use ringtmp_transport::sim::{Fault, SimConfig};
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(32, 40, 0.05, tmp.path());
    let job = dpsgd_job(&cfg, &data, 4, Topology::Exp);
    let mut sim = SimConfig::new(test_seed(10));
    sim.faults.push(Fault::Die {
        rank: 1,
        at: std::time::Duration::from_millis(20),
    });
    let ran = run::dpsgd_nodes(&Backend::Sim(sim), &job, &data, tmp.path(), None);
    for (rank, result) in ran.results.iter().enumerate() {
        let Err(e) = result else {
            panic!("rank {rank} finished without worker 1")
        };
        if rank != 1 {
            assert!(e.contains("rank 1"), "rank {rank}: {e}");
        }
    }
}

/// With `--drop-dead-workers`, a dead worker's neighbours drop it and the run completes, the
/// consensus formed from the survivors.
#[test]
fn with_drop_dead_workers_the_survivors_go_on() {
    use ringtmp_transport::sim::{Fault, SimConfig};
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(32, 40, 0.05, tmp.path());
    cfg.checkpoint_every = 20;
    for topology in [Topology::Ring, Topology::Exp] {
        let mut job = dpsgd_job(&cfg, &data, 4, topology);
        job.drop_dead_workers = true;
        let mut sim = SimConfig::new(test_seed(11));
        sim.faults.push(Fault::Die {
            rank: 2,
            at: std::time::Duration::from_millis(20),
        });
        let out = tmp.path().join(format!("{topology:?}"));
        let ran = run::dpsgd_nodes(&Backend::Sim(sim), &job, &data, &out, None);
        for (rank, result) in ran.results.iter().enumerate() {
            if rank != 2 {
                assert!(result.is_ok(), "rank {rank}: {:?}", result.as_ref().err());
            }
        }
        let summary = ran.results[0].as_ref().unwrap().1.clone().unwrap();
        assert_eq!(summary.steps, 40);
        assert_eq!(summary.dropped_nodes.len(), 1, "{summary:?}");
        assert_eq!(summary.dropped_nodes[0].rank, 2);
        assert_eq!(summary.per_node.len(), 3, "the survivors report");
        assert!(summary.final_test_accuracy > 0.7, "{summary:?}");
        // The checkpoint after the death holds the survivors' replicas.
        let dir = out.join("checkpoints/step-000000040");
        let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
        let names: Vec<&str> = manifest.replicas.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "replica-0.safetensors",
                "replica-1.safetensors",
                "replica-3.safetensors"
            ]
        );
    }
}

/// A GPT on D-PSGD with clipping (each worker clips the gradient it applies): the consensus
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
        ..config(16, 40, 0.2, &tmp.path().join("dpsgd"))
    };
    let job = dpsgd_job(&cfg, &data, 4, Topology::Ring);
    let ran = run::dpsgd_nodes(&Backend::sim(test_seed(8)), &job, &data, &cfg.out, None);
    let summary = ran
        .results
        .into_iter()
        .find_map(|r| r.unwrap_or_else(|e| panic!("{e}")).1)
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
