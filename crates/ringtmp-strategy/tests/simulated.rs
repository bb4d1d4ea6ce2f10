//! The ring and the parameter server at scales and in failures that real sockets on two cores
//! cannot show, on the seeded simulated network: 16 nodes and more, nodes that die or freeze
//! mid-step, stragglers, all in virtual time. Each test prints its seed; `RINGTMP_SEED=N` replays
//! a failure exactly.

use std::time::Duration;

use ringtmp_model::ModelSpec;
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_testkit::fixtures::{MLP_MODEL, deep_mlp, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::{ps_job, ring_job};
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::oracle;
use ringtmp_testkit::run::{self, PsNode};
use ringtmp_transport::sim::{Fault, SimConfig, test_seed};

fn config(spec: ModelSpec, batch: usize, steps: u64, out: &std::path::Path) -> TrainConfig {
    ringtmp_testkit::fixtures::train_config(spec, batch, steps, out)
}

/// A ring of 16: a deep perceptron of 32 layers, the master with 3, 14 nodes with 2, the last
/// with the output layer.
fn sixteen_stages() -> Vec<usize> {
    let mut bounds = vec![0, 3];
    bounds.extend((0..14).map(|i| 5 + 2 * i));
    bounds.push(32);
    bounds
}

#[test]
fn a_ring_of_16_nodes_equals_local() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(15, 16), 32, 5, &tmp.path().join("local"));
    let oracle = oracle::local_params(&cfg, &data);
    let seed = test_seed(16);
    for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
        let job = ring_job(&cfg, &data, &sixteen_stages(), schedule, 8);
        let out = tmp.path().join(schedule.name());
        let ran = run::ring_nodes(&Backend::sim(seed), &job, &data, &out, 0);
        let (params, summary) = run::ring_params(ran.results);
        let diff = max_rel_diff(&params, &oracle);
        println!(
            "{} on 16 simulated nodes: max |Δparam| / max |param| = {diff:.2e}, {:?} virtual",
            schedule.name(),
            ran.elapsed
        );
        assert!(diff < 1e-4, "{}: {diff}", schedule.name());
        assert_eq!(summary.per_node.len(), 16);
    }
}

#[test]
fn an_async_ring_replays_bit_for_bit_from_its_seed() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(15, 16), 32, 12, tmp.path());
    let job = ring_job(&cfg, &data, &sixteen_stages(), Schedule::Async, 1);
    let mut sim = SimConfig::new(test_seed(21));
    sim.jitter = Duration::from_millis(3);
    let run = |sim: &SimConfig| {
        let ran = run::ring_nodes(&Backend::Sim(sim.clone()), &job, &data, tmp.path(), 0);
        let trace = ran.trace;
        (run::ring_params(ran.results).0, trace)
    };
    let (first, trace) = run(&sim);
    let (again, trace_again) = run(&sim);
    assert_eq!(
        trace, trace_again,
        "the same seed sends the same messages at the same times"
    );
    assert!(
        first == again,
        "and ends with the same bits: {:.2e}",
        max_rel_diff(&first, &again)
    );
}

#[test]
fn a_ring_node_that_dies_or_freezes_mid_step_is_named_by_every_node() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(15, 16), 32, 40, tmp.path());
    let job = ring_job(&cfg, &data, &sixteen_stages(), Schedule::OneFOneB, 8);
    let seed = test_seed(9);
    // How long the whole run takes, to put the faults in its middle.
    let whole = run::ring_nodes(&Backend::sim(seed), &job, &data, tmp.path(), 0).elapsed;
    for (fault, rank) in [
        (
            Fault::Die {
                rank: 9,
                at: whole / 2,
            },
            9u32,
        ),
        (
            Fault::Stall {
                rank: 5,
                at: whole / 3,
            },
            5,
        ),
    ] {
        let mut sim = SimConfig::new(seed);
        sim.faults.push(fault);
        let ran = run::ring_nodes(&Backend::Sim(sim.clone()), &job, &data, tmp.path(), 0);
        let name = format!("rank {rank}");
        for (r, result) in ran.results.iter().enumerate() {
            let Err(e) = result else {
                panic!("{fault:?}: rank {r} finished a run that lost a node")
            };
            if r as u32 != rank {
                assert!(e.contains(&name), "{fault:?}: rank {r} says {e}");
            }
        }
        // Within the heartbeat timeout of the fault, in virtual time.
        let at = match fault {
            Fault::Die { at, .. } | Fault::Stall { at, .. } => at,
            Fault::Delay { .. } | Fault::OnSend { .. } => unreachable!(),
        };
        assert!(
            ran.elapsed <= at + sim.peer_timeout + Duration::from_secs(1),
            "{fault:?}: noticed at {:?}",
            ran.elapsed
        );
    }
}

#[test]
fn a_straggler_sets_the_pace_of_a_flushed_ring() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(15, 16), 32, 4, tmp.path());
    let job = ring_job(&cfg, &data, &sixteen_stages(), Schedule::Gpipe, 8);
    let seed = test_seed(4);
    let even = run::ring_nodes(&Backend::sim(seed), &job, &data, tmp.path(), 0);
    let mut sim = SimConfig::new(seed);
    sim.node_speed.insert(7, 0.25);
    let slow = run::ring_nodes(&Backend::Sim(sim), &job, &data, tmp.path(), 0);
    let (even_params, _) = run::ring_params(even.results);
    let (slow_params, _) = run::ring_params(slow.results);
    let ratio = slow.elapsed.as_secs_f64() / even.elapsed.as_secs_f64();
    println!(
        "gpipe, 16 nodes, rank 7 at a quarter speed: {:?} vs {:?} ({ratio:.2}×)",
        slow.elapsed, even.elapsed
    );
    // Synchronous SGD: the same result, later. Every micro-batch passes the straggler.
    assert!(slow_params == even_params);
    assert!(ratio > 1.3, "{ratio}");
}

fn ps_config(workers: usize, steps: u64, out: &std::path::Path) -> TrainConfig {
    config(model(MLP_MODEL, "ps-test"), 4 * workers, steps, out)
}

#[test]
fn bsp_with_14_workers_equals_local_with_14_times_the_batch() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ps_config(14, 6, tmp.path());
    let oracle = oracle::local_params(&cfg, &data);
    let job = ps_job(&cfg, &data, 2, 14, Consistency::Bsp);
    let ran = run::ps_nodes(&Backend::sim(test_seed(14)), &job, &data, &[]);
    let diff = max_rel_diff(&run::ps_params(&ran.results), &oracle);
    println!("bsp, 2 servers, 14 simulated workers: max |Δparam| / max |param| = {diff:.2e}");
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn asynchronous_servers_go_on_without_a_dead_and_a_frozen_worker() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ps_config(15, 60, tmp.path());
    let seed = test_seed(33);
    for consistency in [Consistency::Asp, Consistency::Ssp { staleness: 2 }] {
        let job = ps_job(&cfg, &data, 1, 15, consistency);
        let mut sim = SimConfig::new(seed);
        sim.faults.push(Fault::Die {
            rank: 5,
            at: Duration::from_millis(20),
        });
        sim.faults.push(Fault::Stall {
            rank: 9,
            at: Duration::from_millis(30),
        });
        let ran = run::ps_nodes(&Backend::Sim(sim), &job, &data, &[]);
        let Ok(PsNode::Server(server)) = &ran.results[0] else {
            panic!(
                "{}: the server failed: {:?}",
                consistency.name(),
                ran.results[0].as_ref().err()
            )
        };
        let dropped: Vec<u32> = server.dropped.iter().map(|d| d.rank).collect();
        assert_eq!(dropped, [5, 9], "{}", consistency.name());
        assert!(
            server.dropped[1].reason.contains("silent"),
            "{:?}",
            server.dropped
        );
        for (r, result) in ran.results.iter().enumerate().skip(1) {
            match (r, result) {
                (5 | 9, Err(_)) => {}
                (_, Ok(PsNode::Worker(..))) => {}
                (_, other) => panic!("rank {r}: {:?}", other.as_ref().err()),
            }
        }
    }
}

#[test]
fn bsp_stops_naming_a_dead_worker() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ps_config(6, 60, tmp.path());
    let job = ps_job(&cfg, &data, 2, 6, Consistency::Bsp);
    let mut sim = SimConfig::new(test_seed(8));
    sim.faults.push(Fault::Die {
        rank: 4,
        at: Duration::from_millis(15),
    });
    let ran = run::ps_nodes(&Backend::Sim(sim), &job, &data, &[]);
    for (r, result) in ran.results.iter().enumerate() {
        let Err(e) = result else {
            panic!("rank {r} finished without worker rank 4 under bsp")
        };
        if r != 4 {
            assert!(e.contains("rank 4"), "rank {r}: {e}");
        }
    }
}

#[test]
fn bounded_staleness_outpaces_bsp_with_a_straggler_in_virtual_time() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ps_config(4, 80, tmp.path());
    let seed = test_seed(12);
    let mut elapsed = Vec::new();
    for consistency in [
        Consistency::Bsp,
        Consistency::Ssp { staleness: 3 },
        Consistency::Dssp { lower: 1, upper: 4 },
        Consistency::Asp,
    ] {
        let job = ps_job(&cfg, &data, 1, 4, consistency);
        let mut sim = SimConfig::new(seed);
        sim.node_speed.insert(4, 0.25);
        let ran = run::ps_nodes(&Backend::Sim(sim), &job, &data, &[]);
        run::ps_params(&ran.results);
        println!(
            "{} with a quarter-speed worker: {:?}",
            consistency.name(),
            ran.elapsed
        );
        elapsed.push(ran.elapsed);
    }
    // Work goes to whoever is free (FlexRR): the straggler no longer sets the pace.
    for (t, name) in elapsed[1..].iter().zip(["ssp:3", "dssp:1:4", "asp"]) {
        assert!(
            t.as_secs_f64() < 0.75 * elapsed[0].as_secs_f64(),
            "{name}: {t:?} vs bsp {:?}",
            elapsed[0]
        );
    }
}

/// A ring with stage replicas loses a node mid-run (dead, or frozen until the
/// heartbeat gives up on it); its predecessor takes its layers from the replica, the ring closes
/// around it and trains on from the last replication round — and, the schedule being exact SGD
/// on any partition, ends with the parameters of one process training alone. So does a ring cut
/// inside two layers (docs/decisions/edge-emulation.md), whose heals merge a tail, whole layers and a head
/// into one stage.
#[test]
fn a_ring_with_stage_replicas_heals_around_a_lost_node_and_still_equals_local() {
    use ringtmp_strategy::ring::plan::partition::CutInside;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(deep_mlp(7, 16), 32, 40, &tmp.path().join("local"));
    cfg.checkpoint_every = 40;
    let oracle = oracle::local_params(&cfg, &data);
    let seed = test_seed(14);
    // Whole layers; then layers 5 and 9 (16 → 16) cut after 8 and 4 outputs, each head ending a
    // stage and its tail starting the next (two more layers, so the bounds move).
    let cuts = [
        CutInside { layer: 5, split: 8 },
        CutInside { layer: 9, split: 4 },
    ];
    let cases: [(&[CutInside], &[usize]); 2] = [
        (&[], &[0, 3, 5, 7, 9, 11, 16]),
        (&cuts, &[0, 3, 6, 8, 11, 13, 18]),
    ];
    for (k, (cuts, bounds)) in cases.into_iter().enumerate() {
        let mut job = ring_job(&cfg, &data, bounds, Schedule::OneFOneB, 4);
        job.cuts_inside = cuts.to_vec();
        job.replica_every = 5;
        let whole = run::healing_ring_nodes(
            &Backend::sim(seed),
            &job,
            &data,
            &tmp.path().join(format!("w-{k}")),
        )
        .elapsed;
        for (i, fault) in [
            Fault::Die {
                rank: 3,
                at: whole / 2,
            },
            Fault::Stall {
                rank: 1,
                at: whole / 3,
            },
            Fault::Die {
                rank: 5,
                at: whole * 3 / 4,
            },
        ]
        .into_iter()
        .enumerate()
        {
            let mut sim = SimConfig::new(seed);
            sim.faults.push(fault);
            let out = tmp.path().join(format!("heal-{k}-{i}"));
            let ran = run::healing_ring_nodes(&Backend::Sim(sim), &job, &data, &out);
            let (lost, summary) = match fault {
                Fault::Die { rank, .. } | Fault::Stall { rank, .. } => (
                    rank,
                    ran.results[0]
                        .clone()
                        .unwrap_or_else(|e| panic!("{fault:?}: the master failed: {e}"))
                        .expect("the master reports"),
                ),
                Fault::Delay { .. } | Fault::OnSend { .. } => unreachable!(),
            };
            for (r, result) in ran.results.iter().enumerate() {
                if r as u32 != lost {
                    assert!(result.is_ok(), "{fault:?}: rank {r}: {result:?}");
                }
            }
            assert_eq!(summary.heals.len(), 1, "{fault:?}: {summary:?}");
            let heal = &summary.heals[0];
            assert_eq!(heal.rank, lost);
            assert!(
                heal.resumed_from_step % 5 == 0 && heal.resumed_from_step <= heal.failed_at_step
            );
            assert_eq!(summary.per_node.len(), 5, "the survivors report");
            assert!(summary.per_node.iter().all(|n| n.rank != lost));
            assert_eq!(summary.dropped_nodes[0].rank, lost);
            let params = oracle::checkpoint_params(&out, &cfg, &data);
            let diff = max_rel_diff(&params, &oracle);
            println!(
                "{} cut(s), {fault:?}: healed from mini-batch {} (failed at {}), {:?} virtual; max \
             |Δparam| / max |param| against local = {diff:.2e}",
                cuts.len(),
                heal.resumed_from_step,
                heal.failed_at_step,
                ran.elapsed
            );
            assert!(diff < 1e-4, "{} cut(s), {fault:?}: {diff}", cuts.len());
        }
    }
}

/// R rings of batch b, corresponding stages averaging their gradients before each
/// step, compute what one process does with batch R·b (flushed schedules). So do rings that
/// average their parameters after every step (`--replica-sync every:1`): SGD with momentum is
/// linear in the gradient, so the mean of the R copies' steps from the same parameters is the
/// step of the mean gradient. Rings cut inside layers too (every ring the same cuts).
#[test]
fn rings_of_rings_equal_one_process_with_their_global_batch() {
    use ringtmp_strategy::ring::plan::partition::CutInside;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let steps = 12;
    // Layers 5 and 9 (16 → 16) cut after 8 and 4 outputs: heads end stages 0 and 1.
    let cuts = [
        CutInside { layer: 5, split: 8 },
        CutInside { layer: 9, split: 4 },
    ];
    for (rings, stages, bounds, average_every, cuts) in [
        (2usize, 3usize, &[0, 5, 11, 16][..], 0u64, &[][..]),
        (3, 2, &[0, 7, 16][..], 0, &[]),
        // Four rings: ring 2's master is not a stage-group neighbour of rank 0, yet reports to
        // it (found by `ringtmp simulate` on 64 rings).
        (4, 2, &[0, 7, 16][..], 0, &[]),
        (2, 3, &[0, 5, 11, 16][..], 1, &[]),
        (3, 2, &[0, 7, 16][..], 1, &[]),
        (2, 3, &[0, 6, 11, 18][..], 0, &cuts[..]),
        (2, 3, &[0, 6, 11, 18][..], 1, &cuts[..]),
    ] {
        let global = 12 * rings;
        let mut local_cfg = config(deep_mlp(7, 16), global, steps, &tmp.path().join("local"));
        local_cfg.checkpoint_every = steps;
        let oracle = oracle::local_params(&local_cfg, &data);
        let ring_cfg = TrainConfig {
            batch_size: 12,
            ..local_cfg.clone()
        };
        let mut job = ring_job(&ring_cfg, &data, bounds, Schedule::OneFOneB, 3);
        job.spec = ringtmp_strategy::RunSpec::new(ring_cfg.clone(), &data, global).unwrap();
        job.replicas = rings;
        job.average_every = average_every;
        job.cuts_inside = cuts.to_vec();
        let out = tmp.path().join(format!(
            "rings-{rings}x{stages}-{average_every}-{}",
            cuts.len()
        ));
        let ran = run::healing_ring_nodes(&Backend::sim(test_seed(15)), &job, &data, &out);
        let summary = ran.results[0]
            .clone()
            .unwrap_or_else(|e| panic!("{rings} rings: the master failed: {e}"))
            .expect("the first master reports");
        for (r, result) in ran.results.iter().enumerate() {
            assert!(result.is_ok(), "{rings} rings: rank {r}: {result:?}");
        }
        assert_eq!(summary.per_node.len(), rings * stages);
        assert_eq!(summary.samples, steps * global as u64, "{summary:?}");
        let params = oracle::checkpoint_params(&out, &local_cfg, &data);
        let diff = max_rel_diff(&params, &oracle);
        println!(
            "{rings} rings of {stages} (average every {average_every}, {} cut(s)): max \
             |Δparam| / max |param| against local with batch {global} = {diff:.2e}, {:?} virtual",
            cuts.len(),
            ran.elapsed
        );
        assert!(
            diff < 1e-4,
            "{rings} rings of {stages}, every {average_every}, {} cut(s): {diff}",
            cuts.len()
        );
    }
}

/// Rings of rings under `--replica-sync diloco:H` are DiLoCo with a ring as each
/// worker: R flushed rings of batch b (each one process of batch b) whose stage copies take one
/// outer step together every H mini-batches equal `--strategy diloco` with R workers of batch b,
/// stage by stage — with an averaging outer step (lr 1, no momentum) and with the paper's.
#[test]
fn rings_of_rings_under_diloco_equal_diloco_workers() {
    use ringtmp_strategy::collective::outer::OuterConfig;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let steps = 12;
    for (rings, h, outer) in [
        (
            2usize,
            1u64,
            OuterConfig {
                lr: 1.0,
                momentum: 0.0,
                nesterov: false,
                follow_schedule: false,
            },
        ),
        (2, 4, OuterConfig::PAPER),
        (3, 5, OuterConfig::PAPER),
        // The outer step following a decaying inner schedule (warm-up, cosine, a last interval
        // of 2 mini-batches): the same H mini-batches' rate on both sides.
        (
            2,
            5,
            OuterConfig {
                follow_schedule: true,
                ..OuterConfig::PAPER
            },
        ),
    ] {
        let global = 12 * rings;
        let mut local_cfg = config(deep_mlp(7, 16), global, steps, &tmp.path().join("local"));
        local_cfg.checkpoint_every = steps;
        if outer.follow_schedule {
            local_cfg.schedule =
                Defaulted::given(ringtmp_model::LrSchedule::CosineTo { min_ratio: 0.1 });
            local_cfg.warmup_steps = Defaulted::given(2);
        }
        let workers =
            ringtmp_testkit::jobs::diloco_job(&local_cfg, &data, rings, h, outer, 1, 4096);
        let expected = run::diloco_nodes(
            &Backend::sim(test_seed(45)),
            &workers,
            &data,
            &tmp.path().join(format!("dl-{rings}-{h}")),
        )
        .results
        .remove(0)
        .expect("worker 0 trains")
        .0;
        let ring_cfg = TrainConfig {
            batch_size: 12,
            ..local_cfg.clone()
        };
        let mut job = ring_job(&ring_cfg, &data, &[0, 5, 11, 16], Schedule::OneFOneB, 3);
        job.spec = ringtmp_strategy::RunSpec::new(ring_cfg.clone(), &data, global).unwrap();
        job.replicas = rings;
        job.average_every = h;
        job.outer_sync = Some(outer);
        let out = tmp.path().join(format!("rings-{rings}-{h}"));
        let ran = run::healing_ring_nodes(&Backend::sim(test_seed(15)), &job, &data, &out);
        for (r, result) in ran.results.iter().enumerate() {
            assert!(result.is_ok(), "{rings} rings: rank {r}: {result:?}");
        }
        let params = oracle::checkpoint_params(&out, &local_cfg, &data);
        let diff = max_rel_diff(&params, &expected);
        println!(
            "{rings} rings of 3 under diloco:{h} ({outer:?}): max |Δparam| / max |param| \
             against {rings} DiLoCo workers = {diff:.2e}"
        );
        assert!(diff < 1e-4, "{rings} rings, H = {h}: {diff}");
    }
}

/// Rings of rings under `--replica-sync diloco:H` compose with stage replicas. A
/// node that dies between two outer steps is healed inside its ring (its predecessor takes its
/// layers and their outer momentum over from the replica taken right after the last outer
/// step), the other rings go on, and at the next outer step the copies of its stages meet their
/// new holder. With flushed rings the healed run computes what the unbroken one does: R DiLoCo
/// workers, stage by stage; under `every:K`, the unbroken rings.
#[test]
fn rings_of_rings_under_diloco_heal_a_dead_node_and_still_equal_diloco_workers() {
    use ringtmp_strategy::collective::outer::OuterConfig;
    use ringtmp_transport::sim::SendTrigger;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let steps = 12;
    // (rings, H, the victim's rank, its forward sends before it dies: 3 micro-batches a
    // mini-batch, so the 17th is in mini-batch 5, the 20th in mini-batch 6).
    for (rings, h, victim, nth) in [(2usize, 4u64, 4u32, 17u32), (2, 4, 2, 17), (3, 5, 7, 20)] {
        let global = 12 * rings;
        let mut local_cfg = config(deep_mlp(7, 16), global, steps, &tmp.path().join("local"));
        local_cfg.checkpoint_every = steps;
        let outer = OuterConfig::PAPER;
        let workers =
            ringtmp_testkit::jobs::diloco_job(&local_cfg, &data, rings, h, outer, 1, 4096);
        let expected = run::diloco_nodes(
            &Backend::sim(test_seed(45)),
            &workers,
            &data,
            &tmp.path().join(format!("dl-{rings}-{h}-{victim}")),
        )
        .results
        .remove(0)
        .expect("worker 0 trains")
        .0;
        let ring_cfg = TrainConfig {
            batch_size: 12,
            ..local_cfg.clone()
        };
        let mut job = ring_job(&ring_cfg, &data, &[0, 5, 11, 16], Schedule::OneFOneB, 3);
        job.spec = ringtmp_strategy::RunSpec::new(ring_cfg.clone(), &data, global).unwrap();
        job.replicas = rings;
        job.average_every = h;
        job.outer_sync = Some(outer);
        job.replica_every = h;
        let mut sim = SimConfig::new(test_seed(46));
        sim.faults.push(Fault::OnSend {
            rank: victim,
            stall: false,
            trigger: SendTrigger {
                from: victim,
                to: None,
                what: "Activation tensor",
                nth,
            },
            after: Duration::ZERO,
        });
        let out = tmp.path().join(format!("rings-{rings}-{h}-{victim}"));
        let ran = run::healing_ring_nodes(&Backend::Sim(sim), &job, &data, &out);
        for (r, result) in ran.results.iter().enumerate() {
            assert!(
                r as u32 == victim || result.is_ok(),
                "{rings} rings, rank {victim} dead: rank {r}: {result:?}"
            );
        }
        let summary = ran.results[0]
            .clone()
            .unwrap()
            .expect("the first master reports");
        assert_eq!(
            summary.heals.iter().map(|h| h.rank).collect::<Vec<_>>(),
            vec![victim],
            "{summary:?}"
        );
        let params = oracle::checkpoint_params(&out, &local_cfg, &data);
        let diff = max_rel_diff(&params, &expected);
        println!(
            "{rings} rings of 3 under diloco:{h}, rank {victim} dead in mini-batch {}: healed \
             from mini-batch {}; max |Δparam| / max |param| against {rings} DiLoCo workers = \
             {diff:.2e}, {:?} virtual",
            summary.heals[0].failed_at_step, summary.heals[0].resumed_from_step, ran.elapsed
        );
        assert!(
            diff < 1e-4,
            "{rings} rings, H = {h}, rank {victim} dead: {diff}"
        );
    }
    // `--replica-sync every:K` heals the same way (no outer state): the healed run ends where
    // the unbroken one does.
    let mut local_cfg = config(deep_mlp(7, 16), 24, steps, &tmp.path().join("local"));
    local_cfg.checkpoint_every = steps;
    let ring_cfg = TrainConfig {
        batch_size: 12,
        ..local_cfg.clone()
    };
    let mut job = ring_job(&ring_cfg, &data, &[0, 5, 11, 16], Schedule::OneFOneB, 3);
    job.spec = ringtmp_strategy::RunSpec::new(ring_cfg.clone(), &data, 24).unwrap();
    (job.replicas, job.average_every, job.replica_every) = (2, 4, 4);
    let mut params = Vec::new();
    for victim in [None, Some(5u32)] {
        let mut sim = SimConfig::new(test_seed(47));
        sim.faults.extend(victim.map(|rank| Fault::OnSend {
            rank,
            stall: false,
            trigger: SendTrigger {
                from: rank,
                to: None,
                what: "Activation tensor",
                nth: 17,
            },
            after: Duration::ZERO,
        }));
        let out = tmp.path().join(format!("every-{victim:?}"));
        let ran = run::healing_ring_nodes(&Backend::Sim(sim), &job, &data, &out);
        let summary = ran.results[0]
            .clone()
            .unwrap()
            .expect("the first master reports");
        assert_eq!(
            summary.heals.len(),
            usize::from(victim.is_some()),
            "{summary:?}"
        );
        params.push(oracle::checkpoint_params(&out, &local_cfg, &data));
    }
    let diff = max_rel_diff(&params[1], &params[0]);
    println!("2 rings of 3 under every:4, rank 5 dead: {diff:.2e} from the unbroken run");
    assert!(diff < 1e-4, "every:4, rank 5 dead: {diff}");
}

/// `--replica-sync every:K` and `adpsgd`: rings of rings that train on their own
/// under the async schedule and average their parameters every K mini-batches, or gossip them
/// (AD-PSGD's pairs, nobody waiting until the end), learn as well as one async ring does on the
/// same number of mini-batches (each ring sees its share of every global batch; the exactness of
/// the averaging itself is the `every:1` case above, the gossip's conservation a unit test of
/// `ring::rings::gossip`).
#[test]
fn rings_of_rings_averaging_every_k_mini_batches_or_gossiping_learn_like_one_ring() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        epochs: 4,
        ..config(
            model(MLP_MODEL, "ps-test"),
            16,
            10_000,
            &tmp.path().join("x"),
        )
    };
    let run = |replicas: usize, average_every: u64, gossip: bool, name: &str| {
        let mut job = ring_job(&cfg, &data, &[0, 2, 5], Schedule::Async, 1);
        job.spec = ringtmp_strategy::RunSpec::new(cfg.clone(), &data, 16 * replicas).unwrap();
        job.replicas = replicas;
        job.average_every = average_every;
        job.gossip_every = u64::from(gossip);
        let ran = run::healing_ring_nodes(
            &Backend::sim(test_seed(16)),
            &job,
            &data,
            &tmp.path().join(name),
        );
        for (r, result) in ran.results.iter().enumerate() {
            assert!(result.is_ok(), "{name}: rank {r}: {result:?}");
        }
        let summary = ran.results[0]
            .clone()
            .unwrap()
            .expect("the first master reports");
        assert_eq!(summary.per_node.len(), 2 * replicas, "{name}");
        println!(
            "{name}: {:.2}% after {} steps, {:?} virtual",
            summary.final_test_accuracy * 100.0,
            summary.steps,
            ran.elapsed
        );
        summary
    };
    let one = run(1, 0, false, "one ring");
    assert!(one.final_test_accuracy > 0.8, "{one:?}");
    let mut averaged_bytes = 0;
    for (replicas, every, gossip, name) in [
        (2, 4, false, "two rings averaging every 4"),
        (2, 0, true, "two rings gossiping"),
        (4, 0, true, "four rings gossiping"),
    ] {
        let rings = run(replicas, every, gossip, name);
        if replicas == 2 && !gossip {
            averaged_bytes = rings.total_bytes_sent;
        } else if replicas == 2 {
            // An exchange after nearly every mini-batch against an average every fourth: the
            // copies did talk.
            assert!(
                rings.total_bytes_sent > averaged_bytes + averaged_bytes / 4,
                "gossip sent {} bytes, averaging every 4 {averaged_bytes}",
                rings.total_bytes_sent
            );
        }
        assert!(
            rings.final_test_accuracy > one.final_test_accuracy - 0.05,
            "{name}: {:.4} against one ring's {:.4}",
            rings.final_test_accuracy,
            one.final_test_accuracy
        );
    }
}

#[test]
fn ring_nodes_report_what_they_waited_for_around_a_straggler() {
    // Rank 2 at a twentieth of the speed: the node after it waits for its activations, the node
    // before it for its gradients; the master, on both sides of the ring, for both.
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(7, 128), 32, 12, tmp.path());
    let job = ring_job(&cfg, &data, &[0, 5, 9, 13, 16], Schedule::Async, 1);
    let mut sim = SimConfig::new(test_seed(33));
    sim.node_speed.insert(2, 0.05);
    let ran = run::ring_nodes(&Backend::Sim(sim), &job, &data, tmp.path(), 0);
    let (_, summary) = run::ring_params(ran.results);
    for n in &summary.per_node {
        println!(
            "node {}: waited {:.4} s (activation {:.4}, gradient {:.4}), idle {:.4} s",
            n.rank,
            n.wait_seconds,
            n.wait_activation_seconds,
            n.wait_gradient_seconds,
            n.idle_seconds
        );
        assert!(n.wait_activation_seconds + n.wait_gradient_seconds <= n.wait_seconds + 1e-9);
        assert!(
            n.wait_seconds <= n.idle_seconds + 1e-6,
            "waits are not compute"
        );
    }
    let (before, after) = (&summary.per_node[1], &summary.per_node[3]);
    assert!(before.wait_gradient_seconds > 3.0 * before.wait_activation_seconds);
    assert!(after.wait_activation_seconds > 3.0 * after.wait_gradient_seconds);
    assert!(summary.per_node[2].wait_seconds < before.wait_seconds.min(after.wait_seconds));
}
