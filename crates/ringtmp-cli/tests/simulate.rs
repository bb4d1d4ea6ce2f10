//! `ringtmp simulate`: the same options as `train`, a cost model measured here or
//! read from a file, results printed and written; sizes-only and computing runs agree.

use std::path::Path;
use std::process::{Command, Output};

fn ringtmp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .output()
        .expect("run ringtmp")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn simulate(strategy: &str, out: &Path, extra: &[&str]) -> Output {
    let out = out.to_str().unwrap();
    let mut args = vec![
        "simulate",
        "--strategy",
        strategy,
        "--nodes",
        "3",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--max-steps",
        "12",
        "--bandwidth-mbit",
        "100",
        "--latency-ms",
        "1",
        "--out",
        out,
    ];
    args.extend(extra);
    ringtmp(&args)
}

fn samples_per_second(out: &Path) -> f64 {
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    summary["samples_per_second"].as_f64().unwrap()
}

#[test]
fn simulate_prints_its_inputs_and_results_and_sizes_only_agrees_with_computing() {
    let tmp = tempfile::tempdir().unwrap();
    let costs = tmp.path().join("costs.json");
    let costs = costs.to_str().unwrap();
    for strategy in ["ring", "ps", "allreduce"] {
        let phantom = tmp.path().join(format!("{strategy}-phantom"));
        let first = if strategy == "ring" {
            simulate(strategy, &phantom, &["--save-cost-model", costs])
        } else {
            simulate(strategy, &phantom, &["--cost-model", costs])
        };
        let said = text(&first);
        assert!(first.status.success(), "{strategy}: {said}");
        for needle in [
            "cost model:",
            "network: 100 Mbit/s",
            "assumes:",
            "simulated:",
        ] {
            assert!(said.contains(needle), "{strategy}: no {needle:?} in {said}");
        }
        let record: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(phantom.join("simulation.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(record["phantom"], true);
        let computing = tmp.path().join(format!("{strategy}-computing"));
        let second = simulate(strategy, &computing, &["--cost-model", costs, "--compute"]);
        assert!(second.status.success(), "{strategy}: {}", text(&second));
        let (p, c) = (samples_per_second(&phantom), samples_per_second(&computing));
        assert!(p > 0.0, "{strategy}");
        // The same cost model prices the same work: the figures agree exactly, whatever else
        // the machine is doing (a simulated node's report carries no reading of this process).
        assert_eq!(p, c, "{strategy}: sizes only {p} samples/s, computing {c}");
    }
}

#[test]
fn simulate_refuses_what_it_cannot_simulate() {
    let tmp = tempfile::tempdir().unwrap();
    let local = ringtmp(&["simulate", "--strategy", "local", "--dataset", "digits"]);
    assert_eq!(local.status.code(), Some(2), "{}", text(&local));
    // A cost model of another model (its layers do not match).
    let costs = tmp.path().join("costs.json");
    let first = simulate(
        "ring",
        &tmp.path().join("a"),
        &["--save-cost-model", costs.to_str().unwrap()],
    );
    assert!(first.status.success(), "{}", text(&first));
    let other = ringtmp(&[
        "simulate",
        "--strategy",
        "ring",
        "--dataset",
        "digits",
        "--model",
        "mlp-deep",
        "--max-steps",
        "2",
        "--cost-model",
        costs.to_str().unwrap(),
        "--out",
        tmp.path().join("b").to_str().unwrap(),
    ]);
    assert!(!other.status.success());
    assert!(text(&other).contains("layers"), "{}", text(&other));
    let checkpoint = simulate("ring", &tmp.path().join("c"), &["--checkpoint-every", "5"]);
    assert_eq!(checkpoint.status.code(), Some(2), "{}", text(&checkpoint));
}

/// The scaling study's tool: `compare --simulate` sweeps node counts through the simulator,
/// with one cost model, and reports throughput without accuracy.
#[test]
fn compare_simulates_a_sweep_of_node_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("study");
    let run = ringtmp(&[
        "compare",
        "--simulate",
        "--strategies",
        "ring+ring-nodes=2,allreduce",
        "--nodes",
        "2,4",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--max-steps",
        "6",
        "--bandwidth-mbit",
        "100",
        "--failures-per-node-hour",
        "0.5",
        "--horizon-hours",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let results = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 4, "{results}");
    // The failure study: in every run's simulation.json, in the table and in two plots.
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("useful % of time with failures"),
        "{report}"
    );
    assert!(out.join("plots/useful_fraction.svg").is_file());
    assert!(out.join("plots/effective_scaling.svg").is_file());
    let simulation: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("runs/allreduce-n4-r0/simulation.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(simulation["failures"]["model"]["per_node_hour"], 0.5);
    assert!(out.join("cost-model.json").is_file());
    assert!(out.join("plots/scaling.svg").is_file());
    assert!(!out.join("plots/accuracy_vs_time.svg").exists());
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("SIMULATED"), "{report}");
    // Two rings of two nodes on 4: rings of rings.
    let job = std::fs::read_to_string(out.join("runs/ring_ring-nodes2-n4-r0/job.json"))
        .unwrap_or_else(|_| {
            let names: Vec<_> = std::fs::read_dir(out.join("runs"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            panic!("runs: {names:?}")
        });
    assert!(
        job.contains("\"replicas\": 2") || job.contains("\"replicas\":2"),
        "{job}"
    );
    // `local` is not simulated: refused before anything runs, not left out of the report.
    let with_local = tmp.path().join("with-local");
    let refused = ringtmp(&[
        "compare",
        "--simulate",
        "--strategies",
        "local,ring",
        "--nodes",
        "2",
        "--dataset",
        "digits",
        "--max-steps",
        "2",
        "--out",
        with_local.to_str().unwrap(),
    ]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains("local is not simulated"),
        "{}",
        text(&refused)
    );
    assert!(!with_local.join("runs").exists());
}

/// `--failures-per-node-hour` injects one failure into the strategy's own protocol
/// (the highest rank it can lose) to measure its recovery, then follows a long training through
/// failures: a plain ring must restart for any node, a ring with stage replicas heals around a
/// non-master node, an asynchronous parameter server drops a worker.
#[test]
fn failures_are_injected_into_the_protocol_and_give_a_useful_fraction() {
    let tmp = tempfile::tempdir().unwrap();
    let study = |name: &str, strategy: &str, extra: &[&str]| -> serde_json::Value {
        let out = tmp.path().join(name);
        let mut args = vec![
            "--failures-per-node-hour",
            "1",
            "--horizon-hours",
            "4",
            "--restart-seconds",
            "30",
        ];
        args.extend(extra);
        let run = simulate(strategy, &out, &args);
        assert!(run.status.success(), "{name}: {}", text(&run));
        assert!(text(&run).contains("useful fraction"), "{}", text(&run));
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("simulation.json")).unwrap())
                .unwrap();
        let fraction = record["failures"]["study"]["useful_fraction"]
            .as_f64()
            .unwrap();
        assert!(fraction > 0.0 && fraction <= 1.0, "{name}: {record}");
        record["failures"].clone()
    };
    let plain = study("ring", "ring", &[]);
    assert!(
        plain["probe"].is_null(),
        "a plain ring can lose no node: {plain}"
    );
    assert_eq!(plain["study"]["critical_nodes"], 3);
    let healed = study("healed", "ring", &["--stage-replicas", "2"]);
    assert_eq!(healed["probe"]["recovered"], true, "{healed}");
    assert_eq!(healed["probe"]["rank"], 2);
    assert_eq!(healed["study"]["critical_nodes"], 1, "only the master");
    let ps = study("ps", "ps", &["--consistency", "asp"]);
    assert_eq!(ps["probe"]["recovered"], true, "{ps}");
    assert_eq!(ps["study"]["critical_nodes"], 1, "only the server");
    // Restarting for every failure costs more of the time than losing a worker does.
    assert!(
        plain["study"]["restarts_per_hour"].as_f64().unwrap()
            > healed["study"]["restarts_per_hour"].as_f64().unwrap()
    );
    for (extra, needle) in [
        (
            vec!["--restart-seconds", "5"],
            "needs --failures-per-node-hour",
        ),
        (
            vec!["--failures-per-node-hour=-1"],
            "--failures-per-node-hour",
        ),
        (
            vec!["--failures-per-node-hour", "1", "--horizon-hours", "0"],
            "--horizon-hours",
        ),
    ] {
        let run = simulate("ring", &tmp.path().join("bad"), &extra);
        assert_eq!(run.status.code(), Some(2), "{extra:?}: {}", text(&run));
        assert!(text(&run).contains(needle), "{extra:?}: {}", text(&run));
    }
}

/// A simulated node is a coroutine, not a thread, and holds a stack only while it
/// is alive. `simulate --nodes 100000` aborted near 17,500 threads (exit 134); a ring that
/// leaves all but a few nodes idle now runs them all, with at most a handful alive at once.
#[test]
fn a_hundred_thousand_nodes_simulate_without_a_thread_each() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("wide");
    let run = ringtmp(&[
        "simulate",
        "--nodes",
        "100000",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--max-steps",
        "3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("simulation.json")).unwrap())
            .unwrap();
    assert_eq!(record["nodes"], 100000);
    let alive = record["most_alive"].as_u64().unwrap();
    assert!((2..=16).contains(&alive), "{record}");
    assert!(
        text(&run).contains(&format!(
            "at most {alive} of the 100000 nodes alive at once"
        )),
        "{}",
        text(&run)
    );
}

/// An AD-PSGD worker whose grant is used up waits minutes of virtual time at
/// 100 Mbit/s; the simulator timed it out after 300 s of virtual time. Simulated waits are
/// bounded by the simulation's time limit (a simulated node fails only where a fault says so).
/// And a run that does fail is a row of `compare --simulate`'s report that says so.
#[test]
fn long_simulated_waits_are_not_failures_and_failed_runs_are_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("slow");
    let run = ringtmp(&[
        "simulate",
        "--strategy",
        "adpsgd",
        "--nodes",
        "8",
        "--model",
        "mlp-deep",
        "--bandwidth-mbit",
        "100",
        "--batch-size",
        "16",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let study = tmp.path().join("study");
    let compare = ringtmp(&[
        "compare",
        "--simulate",
        "--strategies",
        "ring,adpsgd+recv-timeout=0.01",
        "--nodes",
        "4",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--max-steps",
        "6",
        "--bandwidth-mbit",
        "100",
        "--out",
        study.to_str().unwrap(),
    ]);
    assert!(compare.status.success(), "{}", text(&compare));
    assert!(text(&compare).contains("1 run(s) in the report, and 1 that failed"));
    for report in ["report.md", "report.html"] {
        let report = std::fs::read_to_string(study.join(report)).unwrap();
        assert!(report.contains("ring ×4"), "{report}");
        assert!(
            report.contains("adpsgd+recv-timeout=0.01 ×4")
                && report.contains("FAILED: the simulated run failed")
                && report.contains("timed out after 10ms"),
            "{report}"
        );
    }
}

/// A language model simulates on every strategy: the logits a loss reads (every position's)
/// travel with their values, the rest as sizes.
#[test]
fn a_gpt_simulates_on_every_strategy() {
    let tmp = tempfile::tempdir().unwrap();
    for strategy in ["ring", "allreduce", "ps", "dpsgd", "adpsgd", "diloco"] {
        let out = tmp.path().join(strategy);
        let run = ringtmp(&[
            "simulate",
            "--strategy",
            strategy,
            "--nodes",
            "4",
            "--dataset",
            "text",
            "--model",
            "gpt-nano",
            "--max-steps",
            "6",
            "--bandwidth-mbit",
            "100",
            "--out",
            out.to_str().unwrap(),
        ]);
        let said = text(&run);
        assert!(run.status.success(), "{strategy}: {said}");
        assert!(said.contains("simulated:"), "{strategy}: {said}");
    }
}
