//! Ring all-reduce SGD against its oracle: N workers of batch b equal `local` with batch N·b, on
//! real loopback links and on the simulated network, with and without the bucketed overlap; the
//! replicas stay bit-identical; every worker sends 2(N − 1)/N of the gradients per step.

use std::path::Path;

use ringtmp_model::LrSchedule;
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::TrainConfig;
use ringtmp_testkit::fixtures::{CONV_MODEL, deep_mlp, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::allreduce_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::oracle;
use ringtmp_testkit::run;
use ringtmp_transport::sim::test_seed;

fn config(spec: ringtmp_model::ModelSpec, batch: usize, steps: u64, out: &Path) -> TrainConfig {
    TrainConfig {
        schedule: Defaulted::given(LrSchedule::Cosine),
        warmup_steps: Defaulted::given(2),
        seed: 11,
        ..ringtmp_testkit::fixtures::train_config(spec, batch, steps, out)
    }
}

/// Every worker's replica, checked bit-identical; the first one.
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

#[test]
fn n_workers_of_batch_b_equal_local_with_batch_n_b() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        model(CONV_MODEL, "ring-test"),
        24,
        10,
        &tmp.path().join("local"),
    );
    let oracle = oracle::local_params(&cfg, &data);
    for backend in [Backend::Tcp, Backend::sim(test_seed(2))] {
        for workers in [2, 3, 4] {
            // Small buckets, so several all-reduces overlap the backward pass.
            let job = allreduce_job(&cfg, &data, workers, 4096, true);
            let out = tmp.path().join(format!("{workers}-{}", backend.name()));
            let ran = run::allreduce_nodes(&backend, &job, &data, &out);
            let (params, summary) = replicas_agree(ran.results);
            let diff = max_rel_diff(&params, &oracle);
            println!(
                "allreduce, {workers} workers × {} ({}): max |Δparam| / max |param| = {diff:.2e}",
                24 / workers,
                backend.name()
            );
            assert!(
                diff < 1e-4,
                "{workers} workers on {}: {diff}",
                backend.name()
            );
            assert_eq!(summary.steps, 10);
            assert_eq!(summary.per_node.len(), workers);
        }
    }
}

/// Overlapping the reduction with the backward pass changes when chunks travel, never what is
/// summed in which order: the same bits. Another bucket size moves the chunk boundaries, so
/// values are summed starting at other workers: rounding only.
#[test]
fn overlap_does_not_change_a_bit_and_bucket_size_only_rounding() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, 6, tmp.path());
    let backend = Backend::sim(test_seed(3));
    let params = |bucket: usize, overlap: bool| {
        let job = allreduce_job(&cfg, &data, 3, bucket, overlap);
        replicas_agree(run::allreduce_nodes(&backend, &job, &data, tmp.path()).results).0
    };
    let reference = params(4096, false);
    assert!(
        params(4096, true) == reference,
        "overlap changed the result"
    );
    let other = params(100, true);
    let diff = max_rel_diff(&other, &reference);
    assert!(diff < 1e-5, "{diff}");
}

#[test]
fn every_worker_sends_two_n_minus_one_over_n_of_the_gradients_per_step() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let steps = 8;
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, steps, tmp.path());
    for workers in [2, 3, 4] {
        let job = allreduce_job(&cfg, &data, workers, 4096, true);
        let ran = run::allreduce_nodes(&Backend::sim(test_seed(5)), &job, &data, tmp.path());
        let (params, summary) = replicas_agree(ran.results);
        let n = workers as f64;
        // The gradients and the loss slot, 2(N − 1) chunks of 1/N each per step.
        let ideal = 2.0 * (n - 1.0) / n * ((params.len() + 1) * 4) as f64 * steps as f64;
        for node in &summary.per_node {
            let ratio = node.bytes_sent as f64 / ideal;
            println!(
                "{workers} workers, rank {}: {} bytes sent, {ratio:.4}× the ideal",
                node.rank, node.bytes_sent
            );
            // Framing (a 20-byte prefix and a small header per chunk) and the final report.
            assert!((1.0..1.05).contains(&ratio), "rank {}: {ratio}", node.rank);
        }
    }
}

#[test]
fn sixteen_simulated_workers_equal_local() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(deep_mlp(3, 24), 64, 5, &tmp.path().join("local"));
    let oracle = oracle::local_params(&cfg, &data);
    let job = allreduce_job(&cfg, &data, 16, 2048, true);
    let ran = run::allreduce_nodes(&Backend::sim(test_seed(16)), &job, &data, tmp.path());
    let (params, _) = replicas_agree(ran.results);
    let diff = max_rel_diff(&params, &oracle);
    println!("allreduce, 16 simulated workers × 4: max |Δparam| / max |param| = {diff:.2e}");
    assert!(diff < 1e-4, "{diff}");
}

/// Elastic all-reduce: when workers die, the survivors re-form the ring from rank 0's replica
/// and split the same global batch among themselves, so the run still equals `local` with the
/// global batch — across one death, two, and a split that leaves shares of unequal size.
#[test]
fn survivors_re_form_the_ring_and_still_equal_local() {
    use ringtmp_transport::sim::{Fault, SimConfig};
    use std::time::Duration;
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    for (case, (batch, deaths)) in [
        (20, vec![(2u32, 30u64)]),
        (24, vec![(1, 20), (3, 45)]),
        (24, vec![(3, 1)]),
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = config(
            model(CONV_MODEL, "ring-test"),
            batch,
            40,
            &tmp.path().join("local"),
        );
        let oracle = oracle::local_params(&cfg, &data);
        let job = allreduce_job(&cfg, &data, 4, 4096, true);
        let mut sim = SimConfig::new(test_seed(9) + case as u64);
        for (rank, at) in &deaths {
            sim.faults.push(Fault::Die {
                rank: *rank,
                at: Duration::from_millis(*at),
            });
        }
        let out = tmp.path().join(format!("case-{case}"));
        let ran = run::allreduce_nodes(&Backend::Sim(sim), &job, &data, &out);
        let dead: Vec<u32> = deaths.iter().map(|d| d.0).collect();
        let survivors: Vec<run::Replica> = ran
            .results
            .into_iter()
            .enumerate()
            .filter(|(r, _)| !dead.contains(&(*r as u32)))
            .map(|(_, x)| x)
            .collect();
        let (params, summary) = replicas_agree(survivors);
        let diff = max_rel_diff(&params, &oracle);
        println!("case {case}: deaths {deaths:?}, max |Δparam| / max |param| = {diff:.2e}");
        assert!(diff < 1e-4, "case {case}: {diff}");
        assert_eq!(summary.steps, 40);
        assert_eq!(
            summary.samples,
            40 * batch as u64,
            "every global batch once"
        );
        let mut left: Vec<u32> = summary.dropped_nodes.iter().map(|d| d.rank).collect();
        left.sort_unstable();
        let mut expected = dead.clone();
        expected.sort_unstable();
        assert_eq!(left, expected, "{summary:?}");
        assert!(
            summary
                .dropped_nodes
                .iter()
                .all(|d| d.step < 40 && !d.reason.is_empty())
        );
        assert_eq!(summary.per_node.len(), 4 - dead.len());
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(
            metrics.matches("\"event\":\"dropped\"").count(),
            dead.len(),
            "{metrics}"
        );
    }
}

/// Rank 0 holds the run's record: its death ends the run, every survivor naming it, within the
/// heartbeat timeout in virtual time.
#[test]
fn rank_0_dying_ends_the_run_named_by_every_survivor() {
    use ringtmp_transport::sim::{Fault, SimConfig};
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(model(CONV_MODEL, "ring-test"), 24, 40, tmp.path());
    let job = allreduce_job(&cfg, &data, 4, 4096, true);
    let mut sim = SimConfig::new(test_seed(9));
    sim.faults.push(Fault::Die {
        rank: 0,
        at: std::time::Duration::from_millis(30),
    });
    let ran = run::allreduce_nodes(&Backend::Sim(sim.clone()), &job, &data, tmp.path());
    for (rank, result) in ran.results.iter().enumerate() {
        let Err(e) = result else {
            panic!("rank {rank} finished without rank 0")
        };
        if rank != 0 {
            assert!(e.contains("rank 0"), "rank {rank}: {e}");
        }
    }
    assert!(ran.elapsed < std::time::Duration::from_millis(30) + sim.peer_timeout * 2);
}

/// A GPT, without clipping and with clipping by the global norm (SGD, a norm low enough that
/// every step clips): every replica holds the averaged gradient — each share's mean over its
/// tokens, weighed by its windows — and clips it as `local` clips its whole batch's.
#[test]
fn a_gpt_with_and_without_clipping_equals_local() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = ringtmp_testkit::fixtures::text_data(tmp.path());
    for clip in [None, Some(0.05)] {
        let cfg = TrainConfig {
            dataset: "text".into(),
            text: Some(text.clone()),
            source: None,
            init_from: None,
            lr: if clip.is_some() {
                Defaulted::given(0.5)
            } else {
                Defaulted::given(0.05)
            },
            clip_grad_norm: clip,
            ..config(
                ringtmp_testkit::fixtures::gpt(data.classes, 16),
                12,
                8,
                &tmp.path().join(format!("local-{clip:?}")),
            )
        };
        let oracle = oracle::local_params(&cfg, &data);
        for workers in [2, 3, 4] {
            let job = allreduce_job(&cfg, &data, workers, 4096, true);
            let out = tmp.path().join(format!("{workers}-{clip:?}"));
            let ran = run::allreduce_nodes(&Backend::sim(test_seed(7)), &job, &data, &out);
            let (params, summary) = replicas_agree(ran.results);
            let diff = max_rel_diff(&params, &oracle);
            assert!(
                diff < 1e-4,
                "{workers} workers, clip {clip:?}: differs from local by {diff}"
            );
            // The reported loss is the mean over the batch's tokens, as local's.
            let loss = summary.final_train_loss;
            assert!(loss < (data.classes as f64).ln() + 1.0, "train loss {loss}");
        }
    }
}
