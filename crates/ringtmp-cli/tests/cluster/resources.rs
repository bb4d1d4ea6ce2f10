//! Emulated machines and the ring's planning for them: CPU quotas, pinned cores, memory limits, links, and every node profiling itself.

use std::time::Duration;

use ringtmp_testkit::process::{finish, stderr};

use super::common::*;

// --node-cpu puts a local node under a kernel CPU quota (cgroups); where no cgroup
// controller is writable the run is refused before it starts, saying what is missing. The group
// is removed after the run.
#[test]
fn node_cpu_puts_a_node_under_a_quota_or_says_why_not() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q").display().to_string();
    let child = spawn_train(&[
        "--strategy",
        "ps",
        "--nodes",
        "3",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--max-steps",
        "10",
        "--eval-every",
        "0",
        "--node-cpu",
        "1:0.5",
        "--out",
        &out,
    ]);
    let Some((launcher, output, err)) = finish_under_quota(child) else {
        return;
    };
    assert!(
        err.contains("node 1 runs under a CPU quota of 0.5 core(s)"),
        "{err}"
    );
    // The limited node reports how long its quota held it off the CPU; the others had none.
    let summary = summary(&tmp.path().join("q"));
    for node in summary["per_node"].as_array().unwrap() {
        let throttled = &node["throttled_seconds"];
        if node["rank"] == 1 {
            assert!(throttled.as_f64().is_some_and(|t| t >= 0.0), "{node}");
        } else {
            assert!(throttled.is_null(), "{node}");
        }
    }
    let printed = String::from_utf8_lossy(&output.stdout) + err.as_str();
    assert!(printed.contains("throttled"), "{printed}");
    assert_no_quota_groups_left(launcher);
}

// A pinned node reports the hypervisor's steal on its core during its run; an unpinned one has
// no core of its own to report (its steal would be the machine's).
#[test]
fn pinned_nodes_report_their_cores_steal() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, pin) in [("pinned", true), ("free", false)] {
        let mut args = vec![
            "--strategy",
            "ring",
            "--nodes",
            "2",
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/lenet-dropout.toml",
            "--max-steps",
            "4",
            "--eval-every",
            "0",
        ];
        if pin {
            args.push("--pin");
        }
        let output = train_into(&args, &tmp.path().join(name));
        assert!(output.status.success(), "{}", stderr(&output));
        let summary = summary(&tmp.path().join(name));
        for node in summary["per_node"].as_array().unwrap() {
            let steal = &node["steal_seconds"];
            if pin {
                assert!(steal.as_f64().is_some_and(|s| s >= 0.0), "{node}");
            } else {
                assert!(steal.is_null(), "{node}");
            }
        }
    }
}

// --strategy local --node-cpu 0:CORES trains in a group of that quota (a one-board baseline on a
// ring node's share): the run reports its throttled time and leaves no group behind.
#[test]
fn local_under_node_cpu_runs_in_a_quota_of_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("l");
    let child = spawn_train(&[
        "--strategy",
        "local",
        "--dataset",
        "digits",
        "--max-steps",
        "10",
        "--eval-every",
        "0",
        "--node-cpu",
        "0:0.5",
        "--out",
        out.to_str().unwrap(),
    ]);
    let Some((pid, _, err)) = finish_under_quota(child) else {
        return;
    };
    assert!(
        err.contains("runs under a CPU quota of 0.5 core(s)"),
        "{err}"
    );
    let node = &summary(&out)["per_node"][0];
    assert!(
        node["throttled_seconds"].as_f64().is_some_and(|t| t >= 0.0),
        "{node}"
    );
    assert_no_quota_groups_left(pid);
}

// --enforce-memory-limit holds each node process to --node-memory-limit; a strategy
// whose node does not fit fails as a board with that memory would, and the run says which rank
// exceeded which limit.
#[test]
fn an_enforced_memory_limit_names_the_rank_that_exceeded_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m").display().to_string();
    // wide-mlp's server holds 442 MB of parameters, gradients and momentum.
    let (output, _) = finish(
        spawn_train(&[
            "--strategy",
            "ps",
            "--nodes",
            "3",
            "--dataset",
            "digits",
            "--model-file",
            "examples/models/wide-mlp.toml",
            "--max-steps",
            "5",
            "--eval-every",
            "0",
            "--node-memory-limit",
            "300M",
            "--enforce-memory-limit",
            "--out",
            &out,
        ]),
        Duration::from_secs(120),
    );
    let err = stderr(&output);
    if output.status.code() == Some(2) {
        assert!(
            err.contains("needs a writable cgroup memory controller"),
            "{err}"
        );
        return;
    }
    assert_eq!(output.status.code(), Some(1), "{err}");
    // The server (rank 0) holds the most, but a worker's replica does not fit either: whichever
    // the kernel kills first is named.
    assert!(
        (0..3).any(|r| err.contains(&format!("rank {r} exceeded its 300 MiB memory limit"))),
        "{err}"
    );
}

// The ring's planner counts what a process needs besides its stage, so the ring's own
// run fits the enforced limit it was planned for (and a limit too small is refused at planning).
#[test]
fn the_ring_planned_for_a_memory_limit_runs_under_it_enforced() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("w").display().to_string();
    let child = spawn_train(&[
        "--model-file",
        "examples/models/wide-mlp.toml",
        "--dataset",
        "digits",
        "--schedule",
        "1f1b",
        "--nodes",
        "3",
        "--node-memory-limit",
        "330M",
        "--enforce-memory-limit",
        "--max-steps",
        "4",
        "--eval-every",
        "0",
        "--out",
        &out,
    ]);
    let (output, _) = finish(child, Duration::from_secs(180));
    let err = stderr(&output);
    if output.status.code() == Some(2) && err.contains("needs a writable cgroup memory controller")
    {
        return;
    }
    assert!(output.status.success(), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("w/summary.json")).unwrap())
            .unwrap();
    for node in summary["per_node"].as_array().unwrap() {
        assert!(
            node["peak_rss_bytes"].as_u64().unwrap() < 330 << 20,
            "{summary}"
        );
    }
}

// The async window, and with it each stage's stashed weights and activations,
// follows the ring the plan chooses, not the nodes given. 64 nodes under a 120 MB limit each
// were refused ("only 4 blocks of layers") because every stage was counted with 65 micro-batches
// in flight; the plan uses 2 and counts 3, and the 62 idle nodes leave.
#[test]
fn idle_nodes_cost_the_ring_no_memory_in_the_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("wide");
    let output = train_into(
        &[
            "--strategy",
            "ring",
            "--nodes",
            "64",
            "--dataset",
            "digits",
            "--model",
            "mlp",
            "--node-memory-limit",
            "120M",
            "--max-steps",
            "2",
            "--eval-every",
            "0",
        ],
        &out,
    );
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("of the 64 nodes"), "{err}");
    assert!(err.contains("(one per node and one more)"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let used = summary["per_node"].as_array().unwrap().len();
    assert!((2..=4).contains(&used), "{summary}");
}

// The planner counts the links. At 100 Mbit/s every cut of the digits mlp sends a
// 1,024-wide activation, so a third node only adds a card that carries one each way: the plan
// takes two of the three nodes (the third leaves once the ring has formed, and the launcher
// says so) unless told to use all, and the printed plan shows each node's card time.
#[test]
fn the_ring_planner_counts_links_and_leaves_a_node_out_when_fewer_train_faster() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "--strategy",
        "ring",
        "--nodes",
        "3",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--eval-every",
        "0",
        "--bandwidth-mbit",
        "100",
        "--latency-ms",
        "1",
    ];
    let out = tmp.path().join("fewer");
    let output = train_into(&base, &out);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("the plan uses 2 of the 3 nodes"), "{err}");
    assert!(
        err.contains("3 local node processes (2 in the ring; the one it leaves idle leaves"),
        "{err}"
    );
    assert!(err.contains("its card"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["per_node"].as_array().unwrap().len(),
        2,
        "{summary}"
    );
    let mut all = base.to_vec();
    all.push("--use-all-nodes");
    let out = tmp.path().join("all");
    let output = train_into(&all, &out);
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(!err.contains("the plan uses"), "{err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["per_node"].as_array().unwrap().len(),
        3,
        "{summary}"
    );
}

// Under an external launcher every node times the model on its own hardware at
// rendezvous, rank 0 plans from the figures and prints each node's speed; a restart answers
// from the cache; `--no-node-profile` keeps the rank-0-only plan.
#[test]
fn every_node_profiles_itself_at_rendezvous_and_a_restart_answers_from_its_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let config = tmp.path().join("train.toml");
    std::fs::write(
        &config,
        format!(
            "strategy = \"ring\"\ndataset = \"digits\"\nmodel = \"mlp\"\nbatch-size = 32\n\
             max-steps = 4\neval-every = 0\nout = {:?}\noverwrite = true\n",
            tmp.path().join("run").display().to_string()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let run = |rank0: &[&str], every: &[&str]| -> String {
        let outputs: Vec<_> = profiled_nodes(3, config, &cache, rank0, every)
            .into_iter()
            .map(|c| finish(c, Duration::from_secs(120)).0)
            .collect();
        for (rank, o) in outputs.iter().enumerate() {
            assert!(o.status.success(), "rank {rank}: {}", stderr(o));
        }
        // Every node started by hand says what it holds (or that the plan leaves it idle),
        // and that it is done.
        for (rank, o) in outputs.iter().enumerate().skip(1) {
            let err = stderr(o);
            assert!(
                err.contains(&format!(
                    "node: rank {rank} runs ring: a ring stage: layers "
                )) || err.contains(&format!("node: rank {rank} runs ring: idle")),
                "rank {rank}: {err}"
            );
            assert!(
                err.contains(&format!("node: rank {rank} done")),
                "rank {rank}: {err}"
            );
        }
        let rank0 = stderr(&outputs[0]);
        // The data is announced once, by rank 0 as it plans; the nodes that read it again
        // log their own line at info level only.
        assert_eq!(rank0.matches("dataset digits:").count(), 1, "{rank0}");
        rank0
    };
    let first = run(&[], &[]);
    assert!(first.contains("nodes' own profiles"), "{first}");
    for rank in [1, 2] {
        let line = first
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("node {rank}: ")) && l.contains("speed"))
            .unwrap_or_else(|| panic!("no profile line for node {rank}: {first}"));
        assert!(
            line.contains("rank 0's speed") && line.contains("measured in"),
            "{line}"
        );
    }
    let files = std::fs::read_dir(cache.join("profiles")).unwrap().count();
    assert_eq!(files, 1, "one request on one machine: one cache entry");
    let again = run(&[], &[]);
    assert_eq!(again.matches("from its cache").count(), 2, "{again}");
    let without = run(&["--no-node-profile"], &[]);
    assert!(!without.contains("own profiles"), "{without}");
    // Each node's own (emulated) card comes with its profile, and the plan counts the links.
    let cards = run(&[], &["--bandwidth-mbit", "100"]);
    assert_eq!(cards.matches("its card 100 Mbit/s,").count(), 2, "{cards}");
    assert!(
        cards.contains("links counted at each node's card"),
        "{cards}"
    );
}
