//! `--wire-dtype`: every strategy sends its tensors as bf16 (or f16) when asked, computing in
//! f32. What travels is about half the bytes; the result stays close to the f32 run's (rounding
//! to 8 bits of mantissa on the wire only); all-reduce's replicas stay bit-identical, since a
//! complete chunk's owner keeps the rounded values it sends.

use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_testkit::fixtures::{MLP_MODEL, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::{adpsgd_job, allreduce_job, dpsgd_job, ps_job, ring_job};
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::run;
use ringtmp_transport::sim::test_seed;
use ringtmp_wire::Dtype;

fn config(dtype: Dtype, out: &std::path::Path) -> TrainConfig {
    TrainConfig {
        wire_dtype: dtype,
        ..ringtmp_testkit::fixtures::train_config(model(MLP_MODEL, "wire-test"), 32, 12, out)
    }
}

fn bytes(summary: &ringtmp_metrics::Summary) -> u64 {
    summary.per_node.iter().map(|n| n.bytes_sent).sum()
}

/// Asserts `reduced` sent 45–60% of `full`'s bytes (halved payloads, unchanged framing and
/// control messages).
fn about_half(what: &str, reduced: u64, full: u64) {
    let ratio = reduced as f64 / full as f64;
    println!("{what}: {reduced} bytes in bf16 against {full} in f32 ({ratio:.3})");
    assert!((0.45..0.6).contains(&ratio), "{what}: {ratio}");
}

#[test]
fn bf16_halves_what_every_strategy_sends_and_changes_little() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let backend = Backend::sim(test_seed(31));
    let dir = |name: &str| tmp.path().join(name);

    // All-reduce: bit-identical replicas, close to the f32 run.
    let mut results = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let job = allreduce_job(&config(dtype, &dir("x")), &data, 4, 4096, true);
        let out = dir(&format!("ar-{dtype:?}"));
        let ran = run::allreduce_nodes(&backend, &job, &data, &out);
        let replicas: Vec<(Vec<f32>, Option<_>)> =
            ran.results.into_iter().map(|r| r.unwrap()).collect();
        assert!(
            replicas.windows(2).all(|w| w[0].0 == w[1].0),
            "{dtype:?}: replicas differ"
        );
        let summary = replicas[0].1.clone().unwrap();
        results.push((replicas[0].0.clone(), bytes(&summary)));
    }
    let diff = max_rel_diff(&results[1].0, &results[0].0);
    println!("allreduce: bf16 against f32, max |Δparam| / max |param| = {diff:.2e}");
    assert!(diff > 0.0 && diff < 0.05, "{diff}");
    about_half("allreduce", results[1].1, results[0].1);

    // The ring: activations and gradients.
    let mut results = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let cfg = config(dtype, &dir("x"));
        let layers = ringtmp_strategy::RunSpec::new(cfg.clone(), &data, 32)
            .unwrap()
            .layers()
            .unwrap()
            .len();
        let job = ring_job(&cfg, &data, &[0, layers / 2, layers], Schedule::OneFOneB, 4);
        let ran = run::ring_nodes(&backend, &job, &data, &dir(&format!("ring-{dtype:?}")), 0);
        let (params, summary) = run::ring_params(ran.results);
        results.push((params, bytes(&summary)));
    }
    let diff = max_rel_diff(&results[1].0, &results[0].0);
    println!("ring: bf16 against f32, max |Δparam| / max |param| = {diff:.2e}");
    assert!(diff > 0.0 && diff < 0.05, "{diff}");
    // Evaluation travels in f32; with no evaluation but the final one, the training traffic
    // dominates.
    let ratio = results[1].1 as f64 / results[0].1 as f64;
    println!(
        "ring: {} bytes in bf16 against {} ({ratio:.3})",
        results[1].1, results[0].1
    );
    assert!(ratio < 0.8, "{ratio}");

    // The parameter server: gradients up, parameters down.
    let mut results = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let job = ps_job(&config(dtype, &dir("ps")), &data, 1, 2, Consistency::Bsp);
        // The server's sends: every parameter shard a worker pulls.
        let ran = run::ps_nodes_audited(&backend, &job, &data, &[], Some(0));
        let params = run::ps_params(&ran.results);
        let sent: u64 = ran.audit.iter().map(|m| m.payload.len() as u64).sum();
        results.push((params, sent));
    }
    let diff = max_rel_diff(&results[1].0, &results[0].0);
    println!("ps: bf16 against f32, max |Δparam| / max |param| = {diff:.2e}");
    assert!(diff > 0.0 && diff < 0.05, "{diff}");
    about_half("ps", results[1].1, results[0].1);

    // The gossip strategies: models between neighbours (the consensus gathered in f32).
    for strategy in ["dpsgd", "adpsgd"] {
        let mut runs = Vec::new();
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let cfg = config(dtype, &dir("x"));
            let out = dir(&format!("{strategy}-{dtype:?}"));
            let summary = if strategy == "dpsgd" {
                let job = dpsgd_job(
                    &cfg,
                    &data,
                    4,
                    ringtmp_strategy::collective::mixing::Topology::Ring,
                );
                let ran = run::dpsgd_nodes(&backend, &job, &data, &out, None);
                ran.results.into_iter().next().unwrap().unwrap().1.unwrap()
            } else {
                let job = adpsgd_job(&cfg, &data, 4);
                let ran = run::adpsgd_nodes(&backend, &job, &data, &out, None);
                ran.results.into_iter().next().unwrap().unwrap().2.unwrap()
            };
            runs.push(summary);
        }
        println!(
            "{strategy}: consensus accuracy {:.3} (bf16) against {:.3} (f32)",
            runs[1].final_test_accuracy, runs[0].final_test_accuracy
        );
        assert!((runs[1].final_test_accuracy - runs[0].final_test_accuracy).abs() < 0.1);
        // Per global step: AD-PSGD's iteration counts differ between runs, so compare bytes
        // per sample.
        about_half(
            strategy,
            (runs[1].bytes_per_sample * 1000.0) as u64,
            (runs[0].bytes_per_sample * 1000.0) as u64,
        );
    }
}
