//! `ringtmp compare`: the report, finished runs skipped, equal time budgets.

use std::process::Stdio;
use std::time::Duration;

use ringtmp_testkit::process::{finish, stderr};

use super::common::*;

// `ringtmp compare` runs each configuration into its own directory and writes
// results.jsonl, report.md, the SVG plots and report.html; a second call into the same
// directory runs nothing again; `local`, the same one process at both node counts, runs once;
// bad specs are exit 2 before anything runs.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario told in order: the report written, then the finished runs skipped"
)]
fn compare_writes_the_report_and_skips_finished_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cmp").display().to_string();
    let args = [
        "compare",
        "--strategies",
        "ring,ps:bsp,allreduce,local",
        "--nodes",
        "2,3",
        "--out",
        &out,
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "12",
        "--lr",
        "0.05",
        "--max-steps",
        "6",
        "--eval-every",
        "3",
    ];
    let run = || {
        let child = ringtmp()
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        finish(child, Duration::from_secs(180)).0
    };
    let output = run();
    let err = stderr(&output);
    if output.status.code() == Some(2) && err.contains("needs a writable cgroup cpu controller") {
        // A sweep gives every node the same CPU share through cgroups; without them compare
        // refuses (tested here), and the rest needs a machine that has them.
        eprintln!("no writable cgroups here: the sweep's refusal is all this test can check");
        return;
    }
    assert!(output.status.success(), "{err}");
    assert!(err.contains("8 run(s)"), "{err}");
    let dir = tmp.path().join("cmp");
    // `local` ran on 2 nodes' share; on 3 it had the same arguments and was not run again.
    assert_eq!(err.matches("the same arguments as").count(), 1, "{err}");
    assert!(
        err.contains("local on 3 node(s), repeat 1: the same arguments as local-n2-r0"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("runs/local-n3-r0/same-as")).unwrap(),
        "local-n2-r0\n"
    );
    assert_eq!(
        std::fs::read(dir.join("runs/local-n3-r0/summary.json")).unwrap(),
        std::fs::read(dir.join("runs/local-n2-r0/summary.json")).unwrap()
    );
    let md_settings = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md_settings.contains("under a CPU quota of"),
        "the sweep's equal share is stated: {md_settings}"
    );
    assert!(
        md_settings.contains("runs with the same arguments ran once (local ×3 is local ×2's run)"),
        "{md_settings}"
    );
    let job: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("runs/ring-n2-r0/train.toml"))
            .map(|t| {
                let v: toml::Value = toml::from_str(&t).unwrap();
                serde_json::to_string(&v).unwrap()
            })
            .unwrap(),
    )
    .unwrap();
    assert!(job["node-cpu"].is_array(), "{job}");
    let results = std::fs::read_to_string(dir.join("results.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = results
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8, "{results}");
    for line in &lines {
        assert!(line["samples_per_second"].as_f64().unwrap() > 0.0, "{line}");
        // One process sends nothing; every distributed strategy does.
        let sends = line["bytes_per_sample"].as_f64().unwrap() > 0.0;
        assert_eq!(sends, line["strategy"] != "local", "{line}");
    }
    // The table comes from the summaries: the parameter server's busiest node is its server.
    let ps = lines.iter().find(|l| l["run"] == "ps_bsp-n3-r0").unwrap();
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("runs/ps_bsp-n3-r0/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(ps["total_bytes_sent"], summary["total_bytes_sent"]);
    assert_eq!(
        ps["busiest_node_bytes_sent"].as_u64(),
        summary["per_node"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["bytes_sent"].as_u64().unwrap())
            .max()
    );
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("| ps:bsp ×3 |") && md.contains("| allreduce ×2 |"),
        "{md}"
    );
    // The claims are computed from the summaries, with a verdict either way.
    let training = |run: &str| -> f64 {
        let s: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("runs/{run}/summary.json"))).unwrap(),
        )
        .unwrap();
        let sent: u64 = s["per_node"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["bytes_sent"].as_u64().unwrap() - n["eval_bytes_sent"].as_u64().unwrap_or(0))
            .sum();
        sent as f64 / s["samples"].as_f64().unwrap()
    };
    let (ring, ps) = (training("ring-n3-r0"), training("ps_bsp-n3-r0"));
    assert!(
        md.contains(&format!(
            "measured: {ring:.0} bytes per sample for the ring against {ps:.0} for ps:bsp on 3 nodes"
        )),
        "{md}"
    );
    let claim_a = md
        .lines()
        .find(|l| l.starts_with("**(a)"))
        .unwrap_or_else(|| panic!("{md}"));
    let expected = if ring < ps {
        "— holds"
    } else {
        "— does not hold"
    };
    assert!(claim_a.contains(expected), "{claim_a}");
    assert!(
        md.contains("**(b)") && md.contains("**(c)") && md.contains("**(d)"),
        "{md}"
    );
    for plot in [
        "accuracy_vs_time",
        "accuracy_vs_samples",
        "samples_per_second",
        "bytes_per_sample",
        "peak_memory",
        "compute_idle",
        "scaling",
    ] {
        let svg = std::fs::read_to_string(dir.join(format!("plots/{plot}.svg"))).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert_eq!(doc.root_element().tag_name().name(), "svg");
    }
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    let doc = roxmltree::Document::parse_with_options(
        &html,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        doc.descendants()
            .filter(|n| n.tag_name().name() == "svg")
            .count(),
        7,
        "every plot inline"
    );
    // Again into the same directory: every run is kept.
    let output = run();
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert_eq!(err.matches("finished before, kept").count(), 8, "{err}");

    // Bad specs: exit 2, named, before any run.
    for (extra, needle) in [
        (
            vec!["--strategies", "ring,horovod"],
            "unknown strategy \"horovod\"",
        ),
        (vec!["--link", "9:50"], "rank 9 does not exist"),
        (
            vec!["--strategies", "adpsgd", "--nodes", "3"],
            "even number of nodes",
        ),
        (vec!["--repeats", "0"], "--repeats"),
        (vec!["--node-cpu", "1:0"], "more than zero cores"),
    ] {
        let bad = tmp.path().join("bad").display().to_string();
        let mut args = vec!["compare", "--out", &bad, "--dataset", "digits"];
        args.extend(extra);
        let output = ringtmp()
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .args(&args)
            .output()
            .unwrap();
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!tmp.path().join("bad/runs").exists(), "nothing ran");
    }
}

// A sample budget cuts the faster strategies short, so `compare --train-seconds T`
// gives every run the same training time instead: a probe run per configuration measures its
// samples/s, and the run trains on T times that many samples.
#[test]
fn compare_at_equal_time_gives_every_run_the_budget_its_probe_measured() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("eq").display().to_string();
    let seconds = 1.5;
    let child = ringtmp()
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args([
            "compare",
            "--strategies",
            "ring,allreduce",
            "--nodes",
            "2",
            "--train-seconds",
            &seconds.to_string(),
            "--out",
            &out,
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/lenet-dropout.toml",
            "--batch-size",
            "16",
            "--eval-every",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = finish(child, Duration::from_secs(240)).0;
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("every configuration runs twice"),
        "said up front: {err}"
    );
    let dir = tmp.path().join("eq");
    let summary = |run: &str| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("runs/{run}/summary.json"))).unwrap(),
        )
        .unwrap()
    };
    for strategy in ["ring", "allreduce"] {
        let probe = summary(&format!("{strategy}-n2-probe"));
        assert_eq!(probe["train_samples"], 2048, "{probe}");
        let rate = probe["samples_per_second"].as_f64().unwrap();
        let expected = ((rate * seconds).ceil() as u64).max(2048);
        assert!(
            err.contains(&format!("so {expected} samples for {seconds} s")),
            "{err}"
        );
        // A run that missed the time by more than 15% ran once more on a corrected budget.
        let run = summary(&format!("{strategy}-n2-r0"));
        let trained = run["train_samples"].as_u64().unwrap();
        let again = format!("on {expected} samples; once more on {trained}");
        assert!(
            trained == expected || err.contains(&again),
            "{strategy}: {trained} samples against the probe's {expected}: {err}"
        );
    }
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("equal training time: about 1.5 s per run"),
        "{md}"
    );
    assert!(md.contains("training time (s)"), "{md}");
    // The probes are not runs of the report.
    let results = std::fs::read_to_string(dir.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 2, "{results}");
    assert!(!results.contains("probe"), "{results}");
    for line in results.lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        let args: Vec<&str> = line["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let budget = line["train_samples"].as_u64().unwrap().to_string();
        assert!(
            args.ends_with(&["--train-samples", budget.as_str()]),
            "the run's budget is in its arguments: {line}"
        );
    }
}
