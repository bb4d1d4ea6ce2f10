//! Every strategy on local node processes: the output contract, resuming across strategies, rings of rings.

use std::time::Duration;

use ringtmp_testkit::process::{finish, stderr};

use super::common::*;

#[test]
fn ring_training_on_three_local_nodes_writes_the_output_contract() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ring").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "ring",
        "--nodes",
        "3",
        // Every node, though on a machine of 2 cores the plan would take fewer.
        "--use-all-nodes",
        "--schedule",
        "1f1b",
        "--micro-batches",
        "4",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--lr",
        "0.05",
        "--target-accuracy",
        "0.8",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(120));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("ring/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["strategy"], "ring");
    assert_eq!(summary["schedule"], "1f1b");
    assert_eq!(summary["per_node"].as_array().unwrap().len(), 3);
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.8,
        "{summary}"
    );
    assert!(summary["partition"].as_array().unwrap().len() == 3);
}

#[test]
fn parameter_server_on_local_nodes_writes_the_output_contract() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ps").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "ps",
        "--nodes",
        "4",
        "--servers",
        "2",
        "--consistency",
        "ssp:2",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "10",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
        "--target-accuracy",
        "0.7",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(120));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("ps/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "ps");
    // The run ends above the target, so it reached it, at a time within the run and at a
    // global iteration worker 0 evaluated (the final replica counts, as the run's last).
    let reached = summary["time_to_target_seconds"].as_f64();
    assert!(
        reached.is_some_and(|t| t > 0.0 && t <= summary["wall_seconds"].as_f64().unwrap()),
        "{summary}"
    );
    let worker0 = &summary["per_node"][2];
    let evaluated: Vec<u64> = worker0["evaluations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[0].as_u64().unwrap())
        .collect();
    assert!(evaluated.contains(&summary["steps_to_target"].as_u64().unwrap()));
    assert_eq!(evaluated.last(), summary["steps"].as_u64().as_ref());
    assert!(evaluated.windows(2).all(|p| p[0] < p[1]), "{evaluated:?}");
    assert_eq!(summary["consistency"], "ssp:2");
    // The parameter server's run log, written by the same recorder as the others.
    let events: Vec<serde_json::Value> =
        std::fs::read_to_string(tmp.path().join("ps/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(events.first().unwrap()["event"], "start");
    assert_eq!(events.first().unwrap()["strategy"], "ps");
    assert_eq!(events.last().unwrap()["event"], "end");
    let evals = events.iter().filter(|e| e["event"] == "eval").count();
    assert_eq!(evals, evaluated.len(), "{events:?}");
    // And its steps (worker 0's units, every one of a run this short), in order,
    // with their losses; worker 0 (rank 2) shows the progress.
    let steps: Vec<u64> = events
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| {
            assert!(e["loss"].as_f64().unwrap().is_finite(), "{e}");
            e["step"].as_u64().unwrap()
        })
        .collect();
    assert!(steps.len() > 10, "{events:?}");
    assert!(steps.windows(2).all(|p| p[0] < p[1]), "{steps:?}");
    assert!(*steps.last().unwrap() <= summary["steps"].as_u64().unwrap());
    assert!(worker0.get("steps").is_none(), "{worker0}");
    let err = stderr(&output);
    assert!(
        err.contains("[node 2] 22602 parameters; steps 0.."),
        "{err}"
    );
    let nodes = summary["per_node"].as_array().unwrap();
    assert_eq!(nodes.len(), 4);
    assert_eq!(nodes.iter().filter(|n| n["role"] == "server").count(), 2);
    // Each server holds a shard; together they hold the model once.
    let shard_params: u64 = nodes
        .iter()
        .filter(|n| n["role"] == "server")
        .map(|n| n["params"].as_u64().unwrap())
        .sum();
    assert_eq!(shard_params, summary["model_params"].as_u64().unwrap());
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
}

// Ring all-reduce SGD on local processes writes the output contract.
#[test]
fn allreduce_on_local_nodes_writes_the_output_contract() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ar").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "allreduce",
        "--nodes",
        "3",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "4",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
        "--bucket-mb",
        "0.01",
        "--target-accuracy",
        "0.7",
        "--checkpoint-every",
        "20",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(120));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("ar/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "allreduce");
    assert_eq!(summary["per_node"].as_array().unwrap().len(), 3);
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
    assert!(
        summary["time_to_target_seconds"].as_f64().is_some(),
        "{summary}"
    );
    assert!(
        summary["final_train_loss"]
            .as_f64()
            .is_some_and(|l| l > 0.0),
        "{summary}"
    );
    let metrics = std::fs::read_to_string(tmp.path().join("ar/metrics.jsonl")).unwrap();
    assert!(
        metrics.lines().any(|l| l.contains("\"event\":\"eval\"")),
        "{metrics}"
    );
    // One model checkpointed, in the format every strategy reads.
    let dir = ringtmp_model::checkpoint::resolve(&tmp.path().join("ar")).unwrap();
    let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(
        (manifest.strategy.as_str(), manifest.files.len()),
        ("allreduce", 1)
    );
}

// DiLoCo on local processes writes the output contract: the outer model evaluated
// and checkpointed, one record per outer step, streamed fragments; a run resumes from it.
#[test]
fn diloco_on_local_nodes_writes_the_output_contract_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dl").display().to_string();
    let common = [
        "--strategy",
        "diloco",
        "--nodes",
        "3",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--lr",
        "0.02",
        "--inner-steps",
        "20",
        "--outer-fragments",
        "2",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--epochs",
        "4",
        "--target-accuracy",
        "0.7",
        "--checkpoint-every",
        "40",
        "--out",
        &out,
    ]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(120));
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("20 inner steps"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("dl/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "diloco");
    assert_eq!(summary["per_node"].as_array().unwrap().len(), 3);
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
    let metrics = std::fs::read_to_string(tmp.path().join("dl/metrics.jsonl")).unwrap();
    // 124 steps: fragment 0 at 10, 30, …, 110, fragment 1 at 20, 40, …, 120, both at 124.
    let outer_steps = metrics
        .lines()
        .filter(|l| l.contains("\"event\":\"outer_step\""))
        .count();
    assert_eq!(outer_steps, 13, "{metrics}");
    let dir = ringtmp_model::checkpoint::resolve(&tmp.path().join("dl")).unwrap();
    let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(manifest.strategy, "diloco");
    // Resumed from its checkpoint at step 40 for 20 more steps.
    let again = tmp.path().join("dl2").display().to_string();
    let at_40 = tmp
        .path()
        .join("dl/checkpoints/step-000000040")
        .display()
        .to_string();
    let mut args = common.to_vec();
    args.extend(["--max-steps", "60", "--resume", &at_40, "--out", &again]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(120));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("dl2/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 60, "{summary}");
}

// D-PSGD on local processes writes the output contract, with the consensus model's
// accuracy, every worker's own, and the consensus distance.
#[test]
fn dpsgd_on_local_nodes_writes_the_output_contract() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dp").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "dpsgd",
        "--topology",
        "exp",
        "--nodes",
        "4",
        // Emulated cards, every node's and one override.
        "--bandwidth-mbit",
        "2000",
        "--link",
        "1:1000:1",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "4",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
        "--target-accuracy",
        "0.7",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(120));
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("dp/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "dpsgd");
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
    assert!(
        summary["consensus_distance"].as_f64().is_some(),
        "{summary}"
    );
    let nodes = summary["per_node"].as_array().unwrap();
    assert_eq!(nodes.len(), 4);
    assert!(
        nodes.iter().all(|n| n["test_accuracy"].as_f64().is_some()),
        "{summary}"
    );
    let metrics = std::fs::read_to_string(tmp.path().join("dp/metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"event\":\"consensus\""), "{metrics}");
}

// Any strategy resumes from any other's checkpoint without restating the batch: a
// resumed run takes the checkpoint's global batch and splits it over its workers.
#[test]
fn r10_a_resume_carries_the_global_batch_across_strategies() {
    let tmp = tempfile::tempdir().unwrap();
    let first = tmp.path().join("local").display().to_string();
    let common = [
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--eval-every",
        "0",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--strategy",
        "local",
        "--batch-size",
        "32",
        "--max-steps",
        "4",
        "--checkpoint-every",
        "4",
        "--out",
        &first,
    ]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(60));
    assert!(output.status.success(), "{}", stderr(&output));
    for (strategy, nodes, batch) in [("ps", "3", 16), ("ring", "2", 32)] {
        let out = tmp.path().join(strategy).display().to_string();
        let mut args = common.to_vec();
        args.extend([
            "--strategy",
            strategy,
            "--nodes",
            nodes,
            "--max-steps",
            "8",
            "--resume",
            &first,
            "--out",
            &out,
        ]);
        let (output, _) = finish(spawn_train(&args), Duration::from_secs(60));
        let err = stderr(&output);
        assert!(output.status.success(), "{strategy}: {err}");
        assert!(err.contains("checkpoint's global batch of 32"), "{err}");
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join(strategy).join("summary.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["batch_size"], batch, "{summary}");
        // And the rate of that batch, not the default scaled by the workers.
        assert!(
            err.contains("checkpoint's learning rate of 0.01"),
            "{strategy}: {err}"
        );
        assert_eq!(summary["lr"].as_f64(), Some(0.01), "{summary}");
    }
}

// Rings of rings on local processes: two rings of two, one summary for all four
// nodes, the second ring's own records beside; impossible layouts are refused.
#[test]
fn rings_of_rings_run_on_local_nodes_and_refuse_what_cannot_work() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rings");
    let args = [
        "--strategy",
        "ring",
        "--nodes",
        "4",
        "--replicas",
        "2",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--eval-every",
        "0",
    ];
    let output = train_into(&args, &out);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("2 rings of 2 nodes"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["nodes"], 4, "{summary}");
    assert_eq!(
        summary["per_node"].as_array().unwrap().len(),
        4,
        "{summary}"
    );
    // 46 steps of 2 × 16 rows.
    assert_eq!(summary["samples"], 46 * 32, "{summary}");
    assert!(out.join("rings/ring-1/summary.json").is_file());
    // The same rings gossiping their stages' parameters (real processes: the passive copies'
    // end, which puts its ring's messages back, runs on sockets here).
    let gossip_out = tmp.path().join("gossip");
    let mut gossip = args.to_vec();
    gossip.extend(["--replica-sync", "adpsgd"]);
    let output = train_into(&gossip, &gossip_out);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("gossip their parameters"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(gossip_out.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["samples"], 46 * 32, "{summary}");
    // It learned: ten classes, chance is 0.1. Which gossip meets which step depends on the
    // threads' timing; twenty runs here ended between 0.45 and 0.69 (a bar of 0.5 failed 3 in
    // 10, AMD EPYC).
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.3,
        "{summary}"
    );
    // The same rings synchronised like DiLoCo: an outer step every 8 mini-batches.
    let diloco_out = tmp.path().join("diloco");
    let mut diloco = args.to_vec();
    diloco.extend(["--replica-sync", "diloco:8"]);
    let output = train_into(&diloco, &diloco_out);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("take one DiLoCo outer step together every 8"),
        "{err}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(diloco_out.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["samples"], 46 * 32, "{summary}");
    for (extra, needle) in [
        (
            &["--nodes", "4", "--replicas", "3"][..],
            "must split into rings",
        ),
        (
            &[
                "--nodes",
                "4",
                "--replicas",
                "2",
                "--replica-sync",
                "diloco:8:0:0.9",
            ][..],
            "diloco:H[:LR:MOMENTUM[:SCHEDULE]]",
        ),
        (
            &[
                "--nodes",
                "6",
                "--replicas",
                "3",
                "--replica-sync",
                "adpsgd",
            ][..],
            "needs an even number of rings",
        ),
        (
            &[
                "--nodes",
                "4",
                "--replicas",
                "2",
                "--replica-sync",
                "adpsgd:0",
            ][..],
            "expected gradients, every:K, adpsgd, adpsgd:K or diloco:H",
        ),
        (
            &["--nodes", "4", "--replicas", "2", "--schedule", "async"][..],
            "needs --schedule 1f1b or gpipe",
        ),
    ] {
        let mut all = vec![
            "--strategy",
            "ring",
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/lenet-dropout.toml",
        ];
        all.extend(extra);
        let output = train_into(&all, &tmp.path().join("refused"));
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains(needle), "{}", stderr(&output));
    }
}

// A run resumed at its very end (a node died after the last step, before the summary, and the
// restart found the final checkpoint) still evaluates: its summary says where the run ended.
#[test]
fn a_ring_resumed_at_its_end_reports_its_final_accuracy() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = [
        "--strategy",
        "ring",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "1",
        "--checkpoint-every",
        "100",
    ];
    let output = train_into(&args, &out);
    assert!(output.status.success(), "{}", stderr(&output));
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
    };
    let first = read()["final_test_accuracy"].as_f64().unwrap();
    let first_samples = read()["samples"].as_u64().unwrap();
    let mut again = args.to_vec();
    again.extend(["--resume", out.to_str().unwrap()]);
    let output = train_into(&again, &out);
    assert!(output.status.success(), "{}", stderr(&output));
    let summary = read();
    // Nothing left to train: the run's record is the first attempt's (it covers
    // the whole run, not the attempt after the resume).
    assert_eq!(
        summary["samples"].as_u64(),
        Some(first_samples),
        "{summary}"
    );
    assert_eq!(
        summary["final_test_accuracy"].as_f64(),
        Some(first),
        "{summary}"
    );
}

// A job whose description passes the links' 64 KiB frame header (a table of 2,100 columns and
// 3,000 class names: its recipe carries every column's name and statistics and every class
// name) still reaches every node: the rendezvous carries settings of up to 16 MiB.
#[test]
fn a_job_larger_than_a_frame_header_reaches_every_node() {
    let tmp = tempfile::tempdir().unwrap();
    let table = tmp.path().join("wide.csv");
    let columns = 2_100;
    let mut text: String = (0..columns).map(|c| format!("feature_{c},")).collect();
    text.push_str("label\n");
    for row in 0..6_000u32 {
        for c in 0..columns {
            text.push_str(if (row as usize + c).is_multiple_of(3) {
                "1,"
            } else {
                "0,"
            });
        }
        text.push_str(&format!("class-number-{}\n", row % 3_000));
    }
    std::fs::write(&table, text).unwrap();
    for strategy in ["allreduce", "ring"] {
        let out = tmp.path().join(strategy);
        let output = train_into(
            &[
                "--dataset",
                "csv",
                "--data-file",
                table.to_str().unwrap(),
                "--strategy",
                strategy,
                "--nodes",
                "2",
                "--max-steps",
                "2",
                "--eval-every",
                "0",
            ],
            &out,
        );
        assert!(output.status.success(), "{strategy}: {}", stderr(&output));
    }
}
