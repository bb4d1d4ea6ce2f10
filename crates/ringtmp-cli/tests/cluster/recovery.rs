//! Failures during training: dead workers dropped, nodes restarted from checkpoints, rings healed from stage replicas, runs restarted from outside, and chaos.

use std::process::Stdio;
use std::time::Duration;

use ringtmp_testkit::process::{Running, finish, stderr};

use super::common::*;

#[test]
fn ring_node_crash_stops_the_run_and_keeps_the_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ring").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "ring",
        "--nodes",
        "3",
        // Rank 2 must hold a stage to crash mid-run.
        "--use-all-nodes",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "500",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "20",
        "--crash-rank",
        "2",
        "--crash-after-ms",
        "3000",
        "--out",
        &out,
    ]);
    let (output, took) = finish(child, Duration::from_secs(60));
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("node 2 failed"), "{err}");
    // The master names the dead node, having seen its link close or rank 1's abort first
    // (whichever of the two arrives first is a race).
    let master = err
        .lines()
        .find(|l| l.starts_with("[node 0] error: "))
        .unwrap_or_default();
    assert!(
        master.contains("rank 2 (127.0.0.1:"),
        "the master names the dead node: {err}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    // The newest complete checkpoint is intact: its manifest lists files whose hashes match.
    let dir = ringtmp_model::checkpoint::resolve(&tmp.path().join("ring")).unwrap();
    let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(manifest.files.len(), 3);
    for f in &manifest.files {
        let bytes = std::fs::read(dir.join(&f.name)).unwrap();
        assert_eq!(ringtmp_model::checkpoint::sha256_hex(&bytes), f.sha256);
    }
}

#[test]
fn parameter_server_drops_a_dead_worker_under_ssp_and_stops_under_bsp() {
    let tmp = tempfile::tempdir().unwrap();
    let common = [
        "--strategy",
        "ps",
        "--nodes",
        "4",
        "--servers",
        "1",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--eval-every",
        "0",
    ];
    let out = tmp.path().join("ssp").display().to_string();
    let mut args = common.to_vec();
    args.extend([
        "--consistency",
        "ssp:2",
        "--epochs",
        "100",
        "--crash-rank",
        "3",
        "--crash-after-ms",
        "1000",
        "--out",
        &out,
    ]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(120));
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("dropping worker rank 3"),
        "the drop is logged: {err}"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("ssp/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        summary["per_node"][0]["dropped_workers"],
        serde_json::json!([3]),
        "{summary}"
    );
    // The degraded run says so, in summary.json and in its final lines.
    let dropped = &summary["dropped_nodes"][0];
    assert_eq!(dropped["rank"], 3, "{summary}");
    assert!(dropped["step"].as_u64().is_some(), "{summary}");
    assert!(
        dropped["reason"].as_str().unwrap().contains("rank 3"),
        "{summary}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("degraded run: rank 3 was dropped"),
        "{stdout}"
    );
    assert!(
        summary["final_train_loss"]
            .as_f64()
            .is_some_and(|l| l > 0.0),
        "{summary}"
    );

    let out = tmp.path().join("bsp").display().to_string();
    let mut args = common.to_vec();
    args.extend([
        "--consistency",
        "bsp",
        "--epochs",
        "100",
        "--crash-rank",
        "3",
        "--crash-after-ms",
        "1000",
        "--out",
        &out,
    ]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(120));
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 3"), "names the dead worker: {err}");
}

// AD-PSGD on local processes writes the output contract (the average's
// accuracy, each worker's own, the consensus distance, checkpoints with every replica); a killed
// worker is skipped and the run completes, saying so; an odd node count is refused.
#[test]
fn adpsgd_on_local_nodes_survives_a_dead_worker_and_refuses_odd_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let common = [
        "--strategy",
        "adpsgd",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
    ];
    let out = tmp.path().join("ad").display().to_string();
    let mut args = common.to_vec();
    args.extend([
        "--nodes",
        "4",
        "--epochs",
        "60",
        "--checkpoint-every",
        "50",
        "--crash-rank",
        "3",
        "--crash-after-ms",
        "300",
        "--out",
        &out,
    ]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(180));
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("rank 3") && err.contains("left the run"),
        "{err}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("ad/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["strategy"], "adpsgd");
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
    assert!(
        summary["consensus_distance"].as_f64().is_some(),
        "{summary}"
    );
    assert_eq!(summary["dropped_nodes"][0]["rank"], 3, "{summary}");
    let nodes = summary["per_node"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "the survivors report: {summary}");
    assert!(nodes.iter().all(|n| n["test_accuracy"].as_f64().is_some()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("degraded run: rank 3 was dropped"),
        "{stdout}"
    );
    let dir = ringtmp_model::checkpoint::resolve(&tmp.path().join("ad")).unwrap();
    let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(manifest.strategy, "adpsgd");
    assert_eq!(manifest.files.len(), 1);
    assert!(!manifest.replicas.is_empty(), "{manifest:?}");
    // The ring resumes from the workers' average, as from any other strategy's checkpoint.
    let resumed = tmp.path().join("ring").display().to_string();
    let ad = tmp.path().join("ad").display().to_string();
    let (output, _) = finish(
        spawn_train(&[
            "--strategy",
            "ring",
            "--nodes",
            "2",
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/lenet-dropout.toml",
            "--epochs",
            "61",
            "--resume",
            &ad,
            "--out",
            &resumed,
        ]),
        Duration::from_secs(60),
    );
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    let ring: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("ring/summary.json")).unwrap(),
    )
    .unwrap();
    assert!(
        ring["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{ring}"
    );

    let mut args = common.to_vec();
    let out = tmp.path().join("odd").display().to_string();
    args.extend(["--nodes", "3", "--epochs", "1", "--out", &out]);
    let (output, _) = finish(spawn_train(&args), Duration::from_secs(60));
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("even number of nodes"), "{err}");
}

// A killed all-reduce worker does not stop the run: the survivors re-form the ring,
// and the output says which rank left and at which step.
#[test]
fn allreduce_goes_on_without_a_killed_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ar").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "allreduce",
        "--nodes",
        "4",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--epochs",
        "40",
        "--batch-size",
        "16",
        "--lr",
        "0.05",
        "--eval-every",
        "0",
        "--crash-rank",
        "2",
        "--crash-after-ms",
        "300",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(180));
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("re-formed the ring on ranks [0, 1, 3]"),
        "{err}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("ar/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["dropped_nodes"][0]["rank"], 2, "{summary}");
    assert!(summary["dropped_nodes"][0]["step"].as_u64().is_some());
    assert_eq!(summary["per_node"].as_array().unwrap().len(), 3);
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.7,
        "{summary}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("degraded run: rank 2 was dropped"),
        "{stdout}"
    );
}

// A node that dies is restarted with the run, from the newest checkpoint
// that verifies, and the run ends with the parameters of one that was never interrupted (a
// synchronous schedule); a disk that fills up mid-checkpoint loses nothing written before;
// `--resume auto` passes over a damaged checkpoint, naming the file; the master's death is not
// restarted. The runs that do not depend on one another run at once: most of their time is the
// links' latency and the failure detection's waits, not CPU (7 s of CPU in 51 s of wall, one
// after another).
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario told in order: the failure, the restart, and the comparison with an unbroken run"
)]
fn a_failed_ring_node_restarts_the_run_from_its_checkpoint_and_ends_where_an_unbroken_run_does() {
    let tmp = tempfile::tempdir().unwrap();
    let common = [
        "--strategy",
        "ring",
        "--schedule",
        "1f1b",
        "--nodes",
        "4",
        // The node that dies must hold a stage (the plan would take fewer on 2 cores).
        "--use-all-nodes",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "10",
    ];
    let out = |name: &str| tmp.path().join(name);
    let train = |extra: &[&str], out: &std::path::Path| {
        let mut args = common.to_vec();
        args.extend(extra);
        args.extend(["--out", out.to_str().unwrap()]);
        Running::new(spawn_train(&args))
    };
    // 5 ms links make a step take tens of milliseconds in any build, so a crash at 1.5 s falls
    // inside the run (the clock starts when the links are up).
    let crash_node_2 = [
        "--latency-ms",
        "5",
        "--crash-rank",
        "2",
        "--crash-after-ms",
        "1500",
    ];
    let with = |extra: &[&'static str]| [&crash_node_2[..], extra].concat();
    let unbroken = train(&[], &out("unbroken"));
    // A node restarted with the run.
    let restarted = train(&with(&["--max-restarts", "1"]), &out("restarted"));
    // A board that is gone for good: the run goes on without it, planned again on 3 nodes from
    // the checkpoint, and ends where the unbroken run does (1f1b is exact SGD on any partition).
    let shrunk = train(
        &with(&["--max-restarts", "1", "--shrink-on-failure"]),
        &out("shrunk"),
    );
    // With stage replicas the ring heals around the dead node in place — no
    // restart, no checkpoint read — and still ends where the unbroken run does.
    let healed = train(&with(&["--stage-replicas", "10"]), &out("healed"));
    // A disk that fills up while step 20's checkpoint is written.
    let full_out = out("full");
    let mut args = common.to_vec();
    args.extend(["--out", full_out.to_str().unwrap()]);
    let full = Running::new(
        ringtmp()
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .env("RINGTMP_FAULT_ENOSPC", "step-000000020")
            .arg("train")
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The master holds the data: its death ends the run, restarts or not.
    let master = train(
        &[
            "--latency-ms",
            "5",
            "--max-restarts",
            "3",
            "--crash-rank",
            "0",
            "--crash-after-ms",
            "1000",
        ],
        &out("master"),
    );

    let limit = Duration::from_secs(180);
    let (output, _) = unbroken.finish(limit);
    assert!(output.status.success(), "{}", stderr(&output));
    let unbroken_hashes = final_hashes(&out("unbroken"));
    let unbroken_summary = summary(&out("unbroken"));
    let accuracy = |s: &serde_json::Value| s["final_test_accuracy"].as_f64().unwrap();

    let (output, _) = restarted.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("launcher: restart 1/1: node 2 failed"),
        "{err}"
    );
    let restarted_summary = summary(&out("restarted"));
    let restart = &restarted_summary["restarts"][0];
    assert_eq!(restart["rank"], 2, "{restarted_summary}");
    let (failed, resumed) = (
        restart["failed_at_step"].as_u64().unwrap(),
        restart["resumed_from_step"].as_u64().unwrap(),
    );
    assert!(resumed <= failed && resumed % 10 == 0, "{restart}");
    assert_eq!(restart["steps_redone"].as_u64(), Some(failed - resumed));
    assert!(
        restart["downtime_seconds"].as_f64().unwrap() > 0.0,
        "{restart}"
    );
    assert_eq!(restarted_summary["steps"], 186, "{restarted_summary}");
    assert_eq!(
        final_hashes(&out("restarted")),
        unbroken_hashes,
        "the restarted run ends with the unbroken run's parameters"
    );

    let (output, _) = shrunk.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("on 3 nodes") && err.contains("partition (3 nodes"),
        "{err}"
    );
    let shrunk = summary(&out("shrunk"));
    assert_eq!(shrunk["nodes"], 3, "{shrunk}");
    assert_eq!(shrunk["restarts"][0]["nodes"], 3, "{shrunk}");
    assert!(
        (accuracy(&shrunk) - accuracy(&unbroken_summary)).abs() < 0.01,
        "{shrunk}"
    );

    let (output, _) = healed.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("ring: rank 2 left") && !err.contains("launcher: restart"),
        "{err}"
    );
    let healed = summary(&out("healed"));
    assert_eq!(healed["heals"][0]["rank"], 2, "{healed}");
    assert_eq!(healed["nodes"], 3, "{healed}");
    assert_eq!(
        accuracy(&healed),
        accuracy(&unbroken_summary),
        "exact SGD on any partition: {healed}"
    );

    let (output, _) = master.finish(limit);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("does not restart without it"), "{err}");

    // The full disk: the run ends naming the file, the partial checkpoint goes, step 10's still
    // verifies, and the run resumes from it to the unbroken run's end.
    let (output, _) = full.finish(limit);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("No space left on device") && err.contains("step-000000020/stage-"),
        "{err}"
    );
    assert!(
        !out("full").join("checkpoints/step-000000020").exists(),
        "{err}"
    );
    let full_resumed = train(&["--resume", "auto"], &out("full"));

    // `--resume auto` on the unbroken run, one epoch longer: its newest checkpoint (the end) is
    // damaged, so it goes on from the one before, naming the file it passed over.
    let checkpoints = out("unbroken").join("checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).unwrap();
    let stage = checkpoints.join(latest.trim()).join("stage-1.safetensors");
    let mut bytes = std::fs::read(&stage).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&stage, bytes).unwrap();
    let mut args: Vec<&str> = common
        .iter()
        .map(|a| if *a == "2" { "3" } else { a })
        .collect();
    let unbroken_out = out("unbroken");
    args.extend(["--resume", "auto", "--max-steps", "190", "--out"]);
    args.push(unbroken_out.to_str().unwrap());
    let passed_over = Running::new(spawn_train(&args));

    let (output, _) = full_resumed.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("step-000000010 (step 10)"), "{err}");
    assert_eq!(final_hashes(&out("full")), unbroken_hashes);

    let (output, _) = passed_over.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("passing over") && err.contains("stage-1.safetensors"),
        "{err}"
    );
    assert!(
        err.contains("--resume auto: resuming from") && err.contains("step-000000180"),
        "{err}"
    );
}

// Stage replicas heal around a node killed (SIGKILL) or frozen (SIGSTOP) from
// outside, mid-run, with replication rounds every five mini-batches so that the signal falls in
// or near one; under 1f1b and the async schedule. The mlp on MNIST, as users run it: its last
// stage is small, so that node's replica and token can reach its predecessor before the
// master's order does, which the master took for a protocol error. The run ends well, one heal names the node,
// and the launcher kills the frozen process once the run is over.
#[test]
fn a_ring_with_stage_replicas_heals_a_node_killed_or_stopped_from_outside() {
    let tmp = tempfile::tempdir().unwrap();
    let runs: Vec<_> = [
        ("kill", libc::SIGKILL, "1f1b"),
        ("stop", libc::SIGSTOP, "async"),
    ]
    .into_iter()
    .map(|(name, signal, schedule)| {
        let out = tmp.path().join(name);
        let child = spawn_train(&[
            "--strategy",
            "ring",
            "--schedule",
            schedule,
            "--nodes",
            "4",
            "--use-all-nodes",
            "--model",
            "mlp",
            "--train-samples",
            "25600",
            "--eval-every",
            "0",
            "--stage-replicas",
            "5",
            "--out",
            out.to_str().unwrap(),
        ]);
        (name, signal, out, Running::new(child))
    })
    .collect();
    let limit = Duration::from_secs(120);
    for (name, signal, out, running) in &runs {
        let victim = node_pid(running.id(), 2, limit).expect("rank 2's process starts");
        assert!(
            wait_for_step(out, 60, limit),
            "{name}: the run reaches step 60"
        );
        // SAFETY: kill(2) on a pid this test's child started.
        assert_eq!(unsafe { libc::kill(victim as i32, *signal) }, 0, "{name}");
    }
    for (name, _, out, running) in runs {
        let (output, _) = running.finish(limit);
        let err = stderr(&output);
        assert!(output.status.success(), "{name}: {err}");
        assert!(err.contains("ring: rank 2 left"), "{name}: {err}");
        let healed = summary(&out);
        assert_eq!(healed["heals"][0]["rank"], 2, "{name}: {healed}");
        assert_eq!(healed["nodes"], 3, "{name}: {healed}");
        assert!(
            healed["final_test_accuracy"].as_f64().unwrap() > 0.7,
            "{name}: {healed}"
        );
        if name == "stop" {
            assert!(err.contains("launcher: node 2 had not exited"), "{err}");
        }
    }
}

// Chaos. Two random non-master nodes of a 4-node ring die during a short run, and a
// worker and a server of the parameter server once each; with restarts the runs complete their
// steps, and their final parameters equal uninterrupted runs' (synchronous schedules). The seed
// is printed; RINGTMP_TEST_SEED replays it.
#[test]
fn chaos_kills_during_runs_cost_restarts_not_results() {
    let seed: u64 = std::env::var("RINGTMP_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
                .into()
        });
    println!("chaos seed {seed} (RINGTMP_TEST_SEED={seed} replays it)");
    let mut x = seed | 1;
    let mut draw = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let victims: Vec<u64> = (0..2).map(|_| 1 + draw(3)).collect();
    let times: Vec<u64> = (0..2).map(|_| 700 + draw(600)).collect();
    let plan = format!("{}:{},{}:{}", victims[0], times[0], victims[1], times[1]);
    let tmp = tempfile::tempdir().unwrap();
    let digits = [
        "--nodes",
        "4",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "10",
    ];
    // Slow links make every run last seconds in any build, so the kills fall inside it: a ring
    // step crosses 14 links, a parameter-server step 4. The four runs go at once (their time is
    // mostly the links' latency and the restarts' waits), the checks after.
    let mut runs = Vec::new();
    for (name, strategy, latency, plan) in [
        (
            "ring",
            &[
                "--strategy",
                "ring",
                "--use-all-nodes",
                "--schedule",
                "1f1b",
                "--epochs",
                "2",
            ][..],
            "5",
            plan.as_str(),
        ),
        // Rank 3 is a worker and rank 1 a server (rank 0, the other server, is the master).
        (
            "ps",
            &["--strategy", "ps", "--servers", "2", "--epochs", "3"][..],
            "20",
            "3:900,1:900",
        ),
    ] {
        let mut args = digits.to_vec();
        args.extend(strategy);
        let unbroken = tmp.path().join(format!("{name}-unbroken"));
        let mut all = args.clone();
        all.extend(["--out", unbroken.to_str().unwrap()]);
        let unbroken_run = Running::new(spawn_train(&all));
        args.extend([
            "--latency-ms",
            latency,
            "--max-restarts",
            "2",
            "--crash-plan",
            plan,
        ]);
        let chaos = tmp.path().join(format!("{name}-chaos"));
        args.extend(["--out", chaos.to_str().unwrap()]);
        let chaos_run = Running::new(spawn_train(&args));
        runs.push((name, plan, unbroken, unbroken_run, chaos, chaos_run));
    }
    for (name, plan, unbroken, unbroken_run, chaos, chaos_run) in runs {
        let limit = Duration::from_secs(180);
        let (output, _) = unbroken_run.finish(limit);
        assert!(output.status.success(), "{}", stderr(&output));
        let (output, _) = chaos_run.finish(limit);
        let err = stderr(&output);
        assert!(output.status.success(), "{name}, seed {seed}: {err}");
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(chaos.join("summary.json")).unwrap())
                .unwrap();
        let restarts = summary["restarts"].as_array().expect("restarts listed");
        let ranks: Vec<String> = plan
            .split(',')
            .map(|e| e.split(':').next().unwrap().to_string())
            .collect();
        assert_eq!(
            restarts
                .iter()
                .map(|r| r["rank"].to_string())
                .collect::<Vec<_>>(),
            ranks,
            "{name}, seed {seed}: {summary}"
        );
        assert_eq!(
            final_hashes(&chaos),
            final_hashes(&unbroken),
            "{name}, seed {seed}: the final parameters"
        );
        // Every checkpoint left verifies.
        for entry in std::fs::read_dir(chaos.join("checkpoints")).unwrap() {
            let dir = entry.unwrap().path();
            if dir.is_dir() {
                ringtmp_model::checkpoint::verify(&dir)
                    .unwrap_or_else(|e| panic!("{name}, seed {seed}: {e}"));
            }
        }
    }
}

// Under an external launcher (torchrun's variables here; Slurm's requeue or a
// Kubernetes restart policy alike) a run that lost a node is started again with the same command
// plus `--resume auto`, and continues from the newest checkpoint that verifies.
#[test]
fn an_externally_restarted_run_resumes_itself_from_its_newest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let config = tmp.path().join("train.toml");
    std::fs::write(
        &config,
        format!(
            "strategy = \"ring\"\nschedule = \"1f1b\"\ndataset = \"digits\"\n\
             model-file = \"examples/models/lenet-dropout.toml\"\nbatch-size = 16\nepochs = 2\n\
             eval-every = 0\ncheckpoint-every = 10\nout = {:?}\n",
            out.display().to_string()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let first: Vec<_> = external_train_nodes(3, config, &[])
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(120)).0)
        .collect();
    assert!(
        first.iter().any(|o| !o.status.success()),
        "the first run lost a node"
    );
    let again: Vec<_> = external_train_nodes(3, config, &["--resume", "auto"])
        .into_iter()
        .map(|c| finish(c, Duration::from_secs(120)).0)
        .collect();
    let err0 = stderr(&again[0]);
    for (rank, o) in again.iter().enumerate() {
        assert!(o.status.success(), "rank {rank}: {}", stderr(o));
    }
    assert!(err0.contains("--resume auto: resuming from"), "{err0}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 186, "{summary}");
}

// Rings of rings under `--replica-sync diloco:H` heal a dead node inside one ring
// while the other ring goes on, as processes on loopback links. Ring 1's second node (rank 4)
// is killed a few mini-batches after the replication round that follows an outer step (ring
// 1's own records say when); its predecessor takes its layers and their outer momentum over,
// the other ring's copies of its stage meet that node at the next outer step, and the run
// ends with the heal recorded.
#[test]
fn rings_of_rings_under_diloco_heal_a_node_killed_in_one_ring() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rings");
    let running = Running::new(spawn_train(&[
        "--strategy",
        "ring",
        "--nodes",
        "6",
        "--ring-nodes",
        "3",
        "--replica-sync",
        "diloco:10",
        "--stage-replicas",
        "10",
        "--schedule",
        "1f1b",
        "--model",
        "mlp",
        "--max-steps",
        "60",
        "--eval-every",
        "0",
        // A step takes tens of milliseconds: the kill lands well before the next outer step.
        "--latency-ms",
        "5",
        "--out",
        out.to_str().unwrap(),
    ]));
    let limit = Duration::from_secs(120);
    let victim = node_pid(running.id(), 4, limit).expect("rank 4's process starts");
    assert!(
        wait_for_step(&out.join("rings").join("ring-1"), 12, limit),
        "ring 1 reaches step 12"
    );
    // SAFETY: kill(2) on a pid this test's child started.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let (output, _) = running.finish(limit);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    let healed = summary(&out);
    assert_eq!(
        healed["heals"].as_array().map(Vec::len),
        Some(1),
        "{healed}"
    );
    assert_eq!(healed["heals"][0]["rank"], 4, "{healed}");
    let resumed = healed["heals"][0]["resumed_from_step"].as_u64().unwrap();
    assert_eq!(
        resumed % 10,
        0,
        "a heal goes back to an outer step's round: {healed}"
    );
    assert!(
        healed["final_test_accuracy"].as_f64().unwrap() > 0.5,
        "{healed}"
    );
}
