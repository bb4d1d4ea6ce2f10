//! The `ringtmp` binary as a user meets it: exit status 2 with one clear message for every kind
//! of bad input, and a small real training run that writes the output contract.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ringtmp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run ringtmp")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Asserts exit status 2 and that stderr holds exactly one `error:` line mentioning `needle`.
fn assert_usage_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    if !stderr.contains("Usage:") {
        assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn unknown_preset_is_a_usage_error() {
    assert_usage_error(
        &ringtmp(&["train", "--model", "resnet50", "--dataset", "digits"]),
        "unknown preset",
    );
}

#[test]
fn unknown_dataset_is_a_usage_error() {
    assert_usage_error(
        &ringtmp(&["train", "--dataset", "imagenet"]),
        "unknown dataset \"imagenet\"",
    );
    // A format without its files says which flag names them.
    assert_usage_error(
        &ringtmp(&["train", "--dataset", "cifar10"]),
        "name its directory with --data-file DIR",
    );
}

#[test]
fn a_malformed_table_is_a_usage_error_naming_row_and_column_before_any_node_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = write(tmp.path(), "t.csv", "a,b,label\n1,2,0\n3,oops,1\n");
    let out = ringtmp(&[
        "train",
        "--dataset",
        "csv",
        "--data-file",
        &csv,
        "--nodes",
        "3",
    ]);
    assert_usage_error(&out, "t.csv: row 2, column \"b\": \"oops\" is not a number");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("[node"));
}

#[test]
fn a_config_dataset_table_trains_a_table_with_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rows = String::from("x1,x2,kind\n");
    for i in 0..200 {
        let (a, b) = ((i % 10) as f32 / 10.0, (i % 7) as f32 / 7.0);
        rows.push_str(&format!(
            "{a},{b},{}\n",
            if a + b > 0.8 { "big" } else { "small" }
        ));
    }
    let csv = write(tmp.path(), "t.csv", &rows);
    let config = write(
        tmp.path(),
        "run.toml",
        &format!(
            "strategy = \"local\"\nepochs = 1\n[dataset]\nformat = \"csv\"\ndata-file = \
             {csv:?}\nlabel = \"kind\"\nval-fraction = 0.25\n"
        ),
    );
    let out_dir = tmp.path().join("run");
    let out = ringtmp(&[
        "train",
        "--config",
        &config,
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("150 train / 50 test") && stderr.contains("2 classes (big, small)"),
        "{stderr}"
    );
    assert!(stderr.contains("training tabular"), "{stderr}");
    // A key the table does not know is refused, naming it.
    let bad = write(
        tmp.path(),
        "bad.toml",
        "[dataset]\nformat = \"csv\"\ncolumns = 3\n",
    );
    assert_usage_error(
        &ringtmp(&["train", "--config", &bad]),
        "unknown key `columns`",
    );
}

#[test]
fn corrupt_dataset_names_file_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("train-images-idx3-ubyte"),
        [0u8, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 28],
    )
    .unwrap();
    let dir = tmp.path().display().to_string();
    let out = ringtmp(&["train", "--dataset", "mnist", "--data-dir", &dir]);
    assert_usage_error(
        &out,
        "train-images-idx3-ubyte: at byte 12: file is truncated",
    );
}

#[test]
fn unknown_layer_in_model_file_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(
        tmp.path(),
        "m.toml",
        "[[layer]]\ntype = \"lstm\"\nunits = 4\n",
    );
    let out = ringtmp(&["train", "--dataset", "digits", "--model-file", &file]);
    assert_usage_error(&out, "m.toml");
    assert_usage_error(&out, "lstm");
}

#[test]
fn impossible_shape_is_a_usage_error_naming_the_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(
        tmp.path(),
        "m.toml",
        "[[layer]]\ntype = \"flatten\"\n[[layer]]\ntype = \"conv2d\"\nout_channels = 4\nkernel = 3\n",
    );
    let out = ringtmp(&["train", "--dataset", "digits", "--model-file", &file]);
    assert_usage_error(&out, "layer 1 (conv2d): needs an image input");
}

#[test]
fn bad_config_key_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "c.toml", "epochs = 1\nbatch_sise = 32\n");
    let out = ringtmp(&["train", "--config", &file]);
    assert_usage_error(&out, "batch_sise");
}

#[test]
fn non_positive_batch_size_is_a_usage_error() {
    assert_usage_error(
        &ringtmp(&["train", "--dataset", "digits", "--batch-size", "0"]),
        "--batch-size must be at least 1",
    );
    assert_usage_error(
        &ringtmp(&["train", "--dataset", "digits", "--batch-size", "-5"]),
        "batch-size",
    );
    assert_usage_error(
        &ringtmp(&["train", "--dataset", "digits", "--lr", "-1"]),
        "--lr must be a positive number",
    );
}

#[test]
fn resume_from_nothing_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().display().to_string();
    let out = ringtmp(&[
        "train",
        "--dataset",
        "digits",
        "--resume",
        &dir,
        "--out",
        &dir,
    ]);
    assert_usage_error(&out, "no checkpoint here");
}

#[test]
fn shipped_examples_validate() {
    for entry in std::fs::read_dir(repo().join("examples/models")).unwrap() {
        let path = entry.unwrap().path().display().to_string();
        // A language model's file (it starts with an embedding) validates on the bundled text.
        let text = std::fs::read_to_string(&path).unwrap();
        let datasets: &[&str] = if text.contains("type = \"embedding\"") {
            &["text"]
        } else {
            &["mnist", "digits"]
        };
        for &dataset in datasets {
            let out = ringtmp(&[
                "validate-config",
                "--model-file",
                &path,
                "--dataset",
                dataset,
            ]);
            assert!(
                out.status.success(),
                "{path} on {dataset}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    for entry in std::fs::read_dir(repo().join("examples/configs")).unwrap() {
        let path = entry.unwrap().path().display().to_string();
        let out = ringtmp(&["validate-config", "--config", &path]);
        assert!(
            out.status.success(),
            "{path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn small_training_run_writes_summary_and_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run").display().to_string();
    let out = ringtmp(&[
        "train",
        "--strategy",
        "local",
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
        "--threads",
        "2",
        "--target-accuracy",
        "0.8",
        "--out",
        &out_dir,
        "--checkpoint-every",
        "40",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("final test accuracy"), "{stdout}");
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("run/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["strategy"], "local");
    assert_eq!(summary["dataset"], "digits");
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.8,
        "{summary}"
    );
    assert!(summary["per_node"][0]["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(tmp.path().join("run/metrics.jsonl").is_file());
    assert!(tmp.path().join("run/checkpoints/latest").is_file());
}

#[test]
fn ring_refuses_to_start_when_no_partition_fits_the_memory_limits() {
    let out = ringtmp(&[
        "train",
        "--model-file",
        "examples/models/wide-mlp.toml",
        "--nodes",
        "2",
        "--node-memory-limit",
        "200M",
    ]);
    assert_usage_error(&out, "no partition fits the nodes' memory limits");
}

/// A tiny local run (a few steps on the digits) into `out`, with `extra` options.
fn tiny_local_run(out: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "--strategy",
        "local",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--max-steps",
        "4",
        "--eval-every",
        "0",
        "--out",
        out,
    ];
    args.extend(extra);
    ringtmp(&args)
}

// A wrong --data-dir is an error naming it and the files, for every strategy.
#[test]
fn r10_a_wrong_data_dir_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().display().to_string();
    for strategy in ["local", "ring", "ps"] {
        assert_usage_error(
            &ringtmp(&[
                "train",
                "--strategy",
                strategy,
                "--data-dir",
                "/nonexistent/x",
            ]),
            "/nonexistent/x (no such directory)",
        );
        let out = ringtmp(&["train", "--strategy", strategy, "--data-dir", &empty]);
        assert_usage_error(&out, "train-labels-idx1-ubyte");
        assert_usage_error(&out, &empty);
    }
}

// --out never replaces another run unless asked to; resuming from it is fine.
#[test]
fn r10_out_refuses_an_existing_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run").display().to_string();
    let first = tiny_local_run(&out, &["--checkpoint-every", "2"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let summary = std::fs::read_to_string(tmp.path().join("run/summary.json")).unwrap();
    assert_usage_error(&tiny_local_run(&out, &[]), "already holds a run");
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("run/summary.json")).unwrap(),
        summary,
        "the refused run touched nothing"
    );
    // A ring run into it is refused before any node starts.
    assert_usage_error(
        &ringtmp(&["train", "--strategy", "ring", "--nodes", "2", "--out", &out]),
        "--overwrite",
    );
    let resumed = tiny_local_run(&out, &["--resume", &out, "--epochs", "3"]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let replaced = tiny_local_run(&out, &["--overwrite", "--no-checkpoint"]);
    assert!(
        replaced.status.success(),
        "{}",
        String::from_utf8_lossy(&replaced.stderr)
    );
    assert!(
        !tmp.path().join("run/checkpoints").exists(),
        "the old run's checkpoints are gone"
    );
}

// A finished run's last checkpoint resumed into another directory trained nothing
// there and reported a run of no samples ("46613588.0 bytes per sample"): it is refused, before
// that directory exists, for every strategy; in its own directory it reports the run again.
#[test]
fn resuming_a_finished_run_elsewhere_says_there_is_nothing_to_train() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run").display().to_string();
    let first = tiny_local_run(&out, &["--checkpoint-every", "2"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    for strategy in ["local", "ring", "allreduce", "ps"] {
        let elsewhere = tmp.path().join(format!("again-{strategy}"));
        let mut args = vec![
            "train",
            "--strategy",
            strategy,
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/lenet-dropout.toml",
            "--max-steps",
            "4",
            "--resume",
            &out,
            "--out",
            elsewhere.to_str().unwrap(),
        ];
        if strategy != "local" {
            args.extend(["--nodes", "2"]);
        }
        let again = ringtmp(&args);
        assert_usage_error(&again, "where this run ends (4 steps: --max-steps 4)");
        assert_usage_error(&again, "nothing is left to train");
        assert!(!elsewhere.exists(), "{strategy}: nothing was written");
    }
    let own = tiny_local_run(&out, &["--resume", &out]);
    let err = String::from_utf8_lossy(&own.stderr);
    assert!(own.status.success(), "{err}");
    let report = String::from_utf8_lossy(&own.stdout);
    assert!(report.contains("after 4 steps"), "{report}");
}

// User mistakes exit 2 with one message that names the file.
#[test]
fn r10_missing_files_and_unwritable_out_are_usage_errors_said_once() {
    let out = ringtmp(&[
        "train",
        "--strategy",
        "local",
        "--model-file",
        "/nonexistent/m.toml",
    ]);
    assert_usage_error(&out, "--model-file /nonexistent/m.toml: No such file");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
    let out = tiny_local_run("/proc/ringtmp-cannot-write", &[]);
    assert_usage_error(&out, "output directory /proc/ringtmp-cannot-write");
}

// Options that do not apply to the strategy are refused, from flags and files alike.
#[test]
fn r10_options_that_do_not_apply_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (
            &["--strategy", "local", "--consistency", "asp"][..],
            "--consistency applies to --strategy ps",
        ),
        (
            &["--strategy", "ring", "--servers", "2"][..],
            "--servers applies to --strategy ps",
        ),
        (
            &["--strategy", "ps", "--schedule", "1f1b"][..],
            "--schedule applies to --strategy ring",
        ),
        (
            &["--strategy", "ring", "--in-flight", "0"][..],
            "--in-flight must be at least 1",
        ),
        (
            &[
                "--strategy",
                "ring",
                "--schedule",
                "gpipe",
                "--in-flight",
                "2",
            ][..],
            "async schedule only",
        ),
        (
            &["--strategy", "local", "--node-speed", "0:0.5"][..],
            "--node-speed applies to",
        ),
        (
            &[
                "--strategy",
                "local",
                "--epochs",
                "1",
                "--train-samples",
                "100",
            ][..],
            "--epochs and --train-samples both",
        ),
        (
            &[
                "--strategy",
                "ring",
                "--stage-replicas",
                "--master-holds-head",
            ][..],
            "--stage-replicas and --master-holds-head",
        ),
    ] {
        let mut all = vec!["train"];
        all.extend(args);
        assert_usage_error(&ringtmp(&all), needle);
        all[0] = "validate-config";
        assert_usage_error(&ringtmp(&all), needle);
    }
    // Refused by the plan (which `validate-config` does not make), before any node starts.
    assert_usage_error(
        &ringtmp(&[
            "train",
            "--strategy",
            "ring",
            "--nodes",
            "4",
            "--replicas",
            "2",
            "--stage-replicas",
        ]),
        "needs rings that train on their own between synchronisations",
    );
    let config = write(tmp.path(), "c.toml", "strategy = \"local\"\nservers = 2\n");
    assert_usage_error(
        &ringtmp(&["train", "--config", &config]),
        "--servers applies",
    );
    let both = write(
        tmp.path(),
        "b.toml",
        "model = \"mlp\"\nmodel-file = \"x.toml\"\n",
    );
    assert_usage_error(
        &ringtmp(&["train", "--config", &both]),
        "both model and model-file",
    );
}

// A config's node count that disagrees with the launcher's is refused.
#[test]
fn r10_nodes_in_a_config_must_match_the_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let config = write(
        tmp.path(),
        "c.toml",
        &format!(
            "strategy = \"ring\"\nnodes = 3\nout = \"{}\"\n",
            tmp.path().join("o").display()
        ),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args([
            "node",
            "--rank",
            "0",
            "--world-size",
            "2",
            "--job",
            "train",
            "--config",
            &config,
        ])
        .env("RINGTMP_SECRET", "0123456789abcdef-test")
        .current_dir(repo())
        .output()
        .unwrap();
    assert_usage_error(&out, "nodes = 3, but the launcher started 2 nodes");
}

// A job read from a file is checked before use: a corrupted one is a usage error
// naming the file and what is wrong, not a panic.
#[test]
fn r11_a_corrupted_job_file_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let plan = ringtmp(&[
        "train",
        "--strategy",
        "ring",
        "--nodes",
        "2",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--max-steps",
        "2",
        "--out",
        &out.display().to_string(),
    ]);
    assert!(
        plan.status.success(),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let job_file = out.join("job.json");
    let mut job: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&job_file).unwrap()).unwrap();
    job["micro_batches"] = serde_json::json!(0);
    let bad = write(tmp.path(), "bad.json", &job.to_string());
    let config = out.join("train.toml").display().to_string();
    let node = |job_file: &str| {
        Command::new(env!("CARGO_BIN_EXE_ringtmp"))
            .args(["node", "--rank", "0", "--world-size", "2", "--job", "train"])
            .args(["--config", &config, "--job-file", job_file])
            .env("RINGTMP_SECRET", "0123456789abcdef-test")
            .current_dir(repo())
            .output()
            .unwrap()
    };
    let out_bad = node(&bad);
    assert_usage_error(&out_bad, "bad.json");
    assert_usage_error(&out_bad, "micro-batches");
    let garbage = write(
        tmp.path(),
        "garbage.json",
        "{\"strategy\": \"ring\", \"seed\": []}",
    );
    assert_usage_error(&node(&garbage), "is not a job file");
}

// Emulated cards for the local nodes of `train`; a bad spec is exit 2, named.
#[test]
fn bad_link_specs_are_usage_errors() {
    let base = [
        "train",
        "--strategy",
        "ring",
        "--nodes",
        "4",
        "--dataset",
        "digits",
    ];
    for (extra, needle) in [
        (
            vec!["--link", "7:50"],
            "rank 7 does not exist in a run of 4 nodes",
        ),
        (
            vec!["--link", "1:0"],
            "'--link <RANK:MBIT[:MS]>': \"1:0\": a bandwidth must be a positive number",
        ),
        (vec!["--link", "1"], "expected RANK:MBIT or RANK:MBIT:MS"),
        (
            vec!["--link", "1:50:-3"],
            "a latency must be a number of ms ≥ 0",
        ),
        (
            vec!["--bandwidth-mbit", "0"],
            "'--bandwidth-mbit <MBIT>': a bandwidth must be a positive number",
        ),
        (
            vec!["--latency-ms", "-1"],
            "'--latency-ms <MS>': a latency must be a number of ms ≥ 0",
        ),
        (vec!["--node-cpu", "2:0"], "more than zero cores"),
        (vec!["--node-cpu", "5:1"], "rank 5 does not exist"),
        (vec!["--enforce-memory-limit"], "needs --node-memory-limit"),
        (
            vec!["--node-memory-limit", "30M"],
            "leaves nothing for its stage",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend(extra);
        assert_usage_error(&ringtmp(&args), needle);
    }
    assert_usage_error(
        &ringtmp(&[
            "train",
            "--strategy",
            "local",
            "--dataset",
            "digits",
            "--link",
            "0:50",
        ]),
        "--link applies to",
    );
}

// `bench-transport` at toy sizes: every section runs and reports numbers, the latency between two
// pinned nodes among them (idle and busy, each direction's size), or says why it was skipped.
#[test]
fn bench_transport_reports_throughput_round_trips_and_latency_between_pinned_nodes() {
    let out = ringtmp(&[
        "bench-transport",
        "--size-mib",
        "0.1",
        "--count",
        "2",
        "--repeats",
        "1",
        "--pings",
        "5",
        "--emulated-mbit",
        "0",
        "--busy-tensors",
        "20",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("plain TCP socket copy"), "{stdout}");
    if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
        assert!(stdout.contains("skipped (needs two cores)"), "{stdout}");
        return;
    }
    for row in ["cores otherwise idle", "cores kept busy by compute"] {
        let line = stdout
            .lines()
            .find(|l| l.contains(row))
            .unwrap_or_else(|| panic!("no {row:?} row in {stdout}"));
        let numbers: Vec<f64> = line
            .split_whitespace()
            .filter_map(|w| w.trim_end_matches(';').parse().ok())
            .collect();
        // 256 KiB: mean, p50, p90; 2.5 KiB: the same; latencies are positive and ordered.
        assert_eq!(numbers.len(), 8, "{line}");
        let (big, small) = (&numbers[1..4], &numbers[5..8]);
        for [mean, p50, p90] in [[big[0], big[1], big[2]], [small[0], small[1], small[2]]] {
            assert!(mean > 0.0 && p50 > 0.0 && p90 >= p50, "{line}");
        }
    }
}

// `bench-cores` at toy durations: each probe reports a rate per CPU alone and together, the JSON
// holds the same, and the verdict gives the ceiling of a ring on those CPUs. One CPU, a repeated
// CPU or a CPU the process may not use is a usage error naming it.
#[test]
fn bench_cores_reports_each_probe_alone_and_together_and_the_ring_ceiling() {
    assert_usage_error(
        &ringtmp(&["bench-cores", "--cpus", "0"]),
        "at least two distinct CPUs",
    );
    assert_usage_error(
        &ringtmp(&["bench-cores", "--cpus", "0,0"]),
        "at least two distinct CPUs",
    );
    assert_usage_error(
        &ringtmp(&["bench-cores", "--cpus", "0,100000"]),
        "may not run on CPU 100000",
    );
    let allowed = ringtmp_metrics::resources::allowed_cores();
    if allowed.len() < 2 {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("cores.json");
    let cpus = format!("{},{}", allowed[0], allowed[1]);
    let out = ringtmp(&[
        "bench-cores",
        "--cpus",
        &cpus,
        "--seconds",
        "0.02",
        "--rounds",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("ring nodes pinned to CPUs {cpus} compute at")),
        "{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let probes = report["probes"].as_array().unwrap();
    let names: Vec<&str> = probes
        .iter()
        .map(|p| p["probe"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["arithmetic", "ring stage", "memory"]);
    for p in probes {
        for key in ["alone", "together", "together_over_alone"] {
            let values = p[key].as_array().unwrap();
            assert_eq!(values.len(), 2, "{p}");
            assert!(
                values
                    .iter()
                    .all(|v| v.as_f64().is_some_and(|v| v > 0.0 && v.is_finite())),
                "{p}"
            );
        }
    }
    assert!(!report["verdict"].as_array().unwrap().is_empty());
}

// `--cut-inside` names what is wrong with a cut before anything runs: the first layer with
// parameters (its input is the raw data), a layer that is not linear, a part left empty, a
// layer cut twice, more cuts than the ring has boundaries, a layer of the head the master holds,
// the flag it does not go with, and text that is not a cut.
#[test]
fn a_bad_cut_inside_is_a_usage_error_naming_the_layer() {
    let ring = |cut: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--strategy",
            "ring",
            "--nodes",
            "2",
            "--model",
            "mlp-deep",
            "--dataset",
            "digits",
            "--cut-inside",
            cut,
        ];
        args.extend_from_slice(extra);
        ringtmp(&args)
    };
    assert_usage_error(&ring("1:256", &[]), "layer 1 is the first with parameters");
    assert_usage_error(&ring("2:256", &[]), "layer 2 (relu): only a linear layer");
    assert_usage_error(&ring("3:1024", &[]), "leaves a part empty");
    assert_usage_error(&ring("3:64,3:128", &[]), "layer 3 is cut twice");
    assert_usage_error(
        &ring("3:64", &["--partition", "0:9,9:18"]),
        "do not go with --partition",
    );
    assert_usage_error(&ring("3:x", &[]), "expected true, false or LAYER:SPLIT");
    assert_usage_error(&ring("3:64,5:64", &[]), "2 cut(s) need 3 stages");
    assert_usage_error(
        &ring("17:5", &["--master-holds-head"]),
        "layer 17 is in the head the master holds",
    );
}

// A window whose attention cannot fit this machine is refused with the figures before anything
// is allocated, not aborted by the allocator (40 GB for one thread at 100,000 positions), on
// the ring as in one process.
#[test]
fn a_window_too_large_for_memory_is_refused_with_the_figures() {
    for strategy in [
        &["--strategy", "local"][..],
        &["--strategy", "ring", "--nodes", "2"],
    ] {
        let mut args = vec!["train", "--dataset", "text", "--model", "gpt-nano"];
        args.extend_from_slice(&["--seq-len", "100000", "--max-steps", "1"]);
        args.extend_from_slice(strategy);
        assert_usage_error(&ringtmp(&args), "attention scratch per compute thread");
    }
}
