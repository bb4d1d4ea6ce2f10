//! Every strategy whose promise is `local`'s model, asked only through the contract: each job
//! runs as `ringtmp node` runs it (`Job::neighbours`, `needs_data`, `run`), on real loopback
//! links and on the seeded simulated network, and the model it leaves is read from its final
//! checkpoint, whatever its partition — so a new strategy joins this table with one row, and
//! nothing here names a driver.

use ringtmp_model::LrSchedule;
use ringtmp_strategy::collective::outer::OuterConfig;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_strategy::{CHECKPOINT_AT_END, Defaulted, Job, TrainConfig};
use ringtmp_testkit::fixtures::{CONV_MODEL, digits, max_rel_diff, model};
use ringtmp_testkit::jobs::{allreduce_job, diloco_job, ps_job, ring_job};
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::{oracle, run};
use ringtmp_transport::sim::test_seed;

/// 8 steps of a global batch of 24 on the digits, with a cosine rate and a final checkpoint.
fn config(out: &std::path::Path) -> TrainConfig {
    TrainConfig {
        schedule: Defaulted::given(LrSchedule::Cosine),
        warmup_steps: Defaulted::given(2),
        seed: 5,
        checkpoint_every: CHECKPOINT_AT_END,
        ..ringtmp_testkit::fixtures::train_config(model(CONV_MODEL, "contract"), 24, 8, out)
    }
}

#[test]
fn every_strategy_that_promises_locals_model_leaves_it_in_its_final_checkpoint() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(&tmp.path().join("local"));
    let expected = oracle::local_params(&cfg, &data);
    let averaging = OuterConfig {
        lr: 1.0,
        momentum: 0.0,
        nesterov: false,
        follow_schedule: false,
    };
    // (the job, its world size)
    let table: Vec<(Job, u32)> = vec![
        (
            Job::Ring(ring_job(&cfg, &data, &[0, 4, 7, 10], Schedule::Gpipe, 3)),
            3,
        ),
        (Job::AllReduce(allreduce_job(&cfg, &data, 3, 4096, true)), 3),
        (Job::Ps(ps_job(&cfg, &data, 2, 3, Consistency::Bsp)), 5),
        (
            Job::Diloco(diloco_job(&cfg, &data, 2, 1, averaging, 1, 4096)),
            2,
        ),
    ];
    for backend in [Backend::Tcp, Backend::sim(test_seed(31))] {
        for (job, world) in &table {
            let mut job = job.clone();
            let out = tmp
                .path()
                .join(format!("{}-{}", job.name(), backend.name()));
            job.spec_mut().config.out.clone_from(&out);
            let ran = run::job_nodes(&backend, &job, &data, *world);
            let mut summaries = ran.results.into_iter().enumerate().map(|(rank, r)| {
                r.unwrap_or_else(|e| panic!("{} rank {rank} failed: {e}", job.name()))
            });
            let summary = summaries
                .next()
                .flatten()
                .unwrap_or_else(|| panic!("{}: rank 0 reports the run", job.name()));
            assert_eq!(summary.steps, 8, "{}", job.name());
            let left = oracle::checkpoint_params(&out, &cfg, &data);
            let diff = max_rel_diff(&left, &expected);
            println!(
                "{} on {}: max |Δparam| / max |param| = {diff:.2e}",
                job.name(),
                backend.name()
            );
            assert!(diff < 1e-4, "{} on {}: {diff}", job.name(), backend.name());
        }
    }
}
