//! What the cluster tests share: the binary with its environment, nodes started by hand, and
//! waiting on, finding and reading what runs leave behind.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ringtmp_testkit::process::{finish, free_port, stderr};

pub(crate) const SECRET: &str = "0123456789abcdef-test-secret";

pub(crate) fn ringtmp() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ringtmp"));
    c.env("RINGTMP_LOG", "warn");
    // Nodes' profile caches stay inside the build tree.
    c.env(
        "RINGTMP_CACHE_DIR",
        concat!(env!("CARGO_TARGET_TMPDIR"), "/ringtmp-cache"),
    );
    c
}

/// Starts node `rank` of `world` with a long selftest (so there is time to disturb it).
pub(crate) fn node(rank: u32, world: u32, port: u16, secret: &str, extra: &[&str]) -> Child {
    ringtmp()
        .args([
            "node",
            "--rank",
            &rank.to_string(),
            "--world-size",
            &world.to_string(),
        ])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args([
            "--job",
            "selftest",
            "--size-mib",
            "0.25",
            "--rounds",
            "1000000",
            "--pings",
            "10",
        ])
        .args([
            "--connect-timeout",
            "5",
            "--peer-timeout",
            "3",
            "--heartbeat-ms",
            "250",
        ])
        .args(extra)
        .env("RINGTMP_SECRET", secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `ringtmp train` from the repository root with piped output.
pub(crate) fn spawn_train(args: &[&str]) -> Child {
    ringtmp()
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .arg("train")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Pids of the live processes whose parent is `pid` (from /proc).
pub(crate) fn children_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid …; comm may hold spaces, so read after its closing parenthesis.
        let mut fields = stat[stat.rfind(')').unwrap() + 1..].split_whitespace();
        let (state, ppid) = (fields.next(), fields.next());
        if ppid == Some(&pid.to_string()) && state != Some("Z") {
            found.push(child);
        }
    }
    found
}

pub(crate) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s[s.rfind(')').unwrap() + 1..].trim_start().starts_with('Z'))
}

/// Waits up to `limit` for `n` node processes under the launcher `pid`.
pub(crate) fn wait_for_nodes(pid: u32, n: usize, limit: Duration) -> Vec<u32> {
    let started = Instant::now();
    loop {
        let nodes = children_of(pid);
        if nodes.len() >= n || started.elapsed() > limit {
            return nodes;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A long parameter-server run on the digits (a few seconds per epoch at most).
pub(crate) fn long_ps_run(out: &str, extra: &[&str]) -> Child {
    let mut args = vec![
        "--strategy",
        "ps",
        "--nodes",
        "3",
        "--servers",
        "1",
        "--consistency",
        "asp",
        "--dataset",
        "digits",
        "--model-file",
        "examples/models/lenet-dropout.toml",
        "--batch-size",
        "16",
        "--eval-every",
        "0",
        "--out",
        out,
    ];
    args.extend(extra);
    spawn_train(&args)
}

/// The final checkpoint's file hashes of a run in `out` (stage files, in order).
pub(crate) fn final_hashes(out: &std::path::Path) -> Vec<String> {
    let dir = out.join("checkpoints");
    let latest = std::fs::read_to_string(dir.join("latest")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(latest.trim()).join("manifest.json")).unwrap(),
    )
    .unwrap();
    manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["sha256"].as_str().unwrap().to_string())
        .collect()
}

/// The pid of the node process of `rank` under the launcher `pid`, once it is there (bounded).
pub(crate) fn node_pid(launcher: u32, rank: u32, limit: Duration) -> Option<u32> {
    let started = Instant::now();
    let flag = format!("--rank\0{rank}\0");
    while started.elapsed() < limit {
        for child in children_of(launcher) {
            let cmdline =
                std::fs::read_to_string(format!("/proc/{child}/cmdline")).unwrap_or_default();
            if cmdline.contains(&flag) {
                return Some(child);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Waits (bounded) until the run in `out` has logged mini-batch `step`.
pub(crate) fn wait_for_step(out: &std::path::Path, step: u64, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
        let reached = text.lines().any(|line| {
            serde_json::from_str::<serde_json::Value>(line).is_ok_and(|e| {
                e["event"] == "step" && e["step"].as_u64().is_some_and(|s| s >= step)
            })
        });
        if reached {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Waits for a `train` run with `--node-cpu` (bounded): `None` where it was refused because no
/// cgroup cpu controller is writable here (checking that it said so), else its pid, output and
/// stderr, after checking that it succeeded.
pub(crate) fn finish_under_quota(child: Child) -> Option<(u32, std::process::Output, String)> {
    let pid = child.id();
    let (output, _) = finish(child, Duration::from_secs(120));
    let err = stderr(&output);
    if output.status.code() == Some(2) {
        assert!(
            err.contains("needs a writable cgroup cpu controller"),
            "{err}"
        );
        return None;
    }
    assert!(output.status.success(), "{err}");
    Some((pid, output, err))
}

/// Asserts that launcher `pid` left no quota group behind (v1 or v2).
pub(crate) fn assert_no_quota_groups_left(pid: u32) {
    let prefix = format!("ringtmp-{pid}-");
    let leftovers: Vec<_> = ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup"]
        .iter()
        .filter_map(|root| std::fs::read_dir(root).ok())
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(leftovers.is_empty(), "groups left behind: {leftovers:?}");
}

/// A finished run's summary.json.
pub(crate) fn summary(out: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

/// Trains `args` into `out` and returns the output (bounded).
pub(crate) fn train_into(args: &[&str], out: &std::path::Path) -> std::process::Output {
    let mut all = args.to_vec();
    all.extend(["--out", out.to_str().unwrap()]);
    finish(spawn_train(&all), Duration::from_secs(180)).0
}

/// Starts `world` training nodes as an external launcher would (torchrun's variables), rank 0
/// with `rank0_extra` after the config; returns them in rank order.
/// `ringtmp node --job train` as rank `rank` of `world` under torchrun's variables, from the
/// repository root, its output captured.
pub(crate) fn torchrun_node(rank: u32, world: u32, port: u16, connect_timeout: &str) -> Command {
    let mut cmd = ringtmp();
    cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args([
            "node",
            "--job",
            "train",
            "--connect-timeout",
            connect_timeout,
        ])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RINGTMP_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

pub(crate) fn external_train_nodes(world: u32, config: &str, rank0_extra: &[&str]) -> Vec<Child> {
    let port = free_port();
    (0..world)
        .map(|rank| {
            let mut cmd = torchrun_node(rank, world, port, "20");
            cmd.args(["--latency-ms", "5"]);
            if rank == 0 {
                cmd.args(["--config", config]).args(rank0_extra);
            }
            if rank == 2 && rank0_extra.is_empty() {
                // The first run loses a node mid-way, as a preempted or unplugged board.
                cmd.args(["--crash-after-ms", "1500"]);
            }
            cmd.spawn().unwrap()
        })
        .collect()
}

/// `world` nodes under an external launcher's variables, training `config`, each with its
/// profile cache in `cache`.
pub(crate) fn profiled_nodes(
    world: u32,
    config: &str,
    cache: &std::path::Path,
    rank0: &[&str],
    every: &[&str],
) -> Vec<Child> {
    let port = free_port();
    (0..world)
        .map(|rank| {
            let mut cmd = torchrun_node(rank, world, port, "30");
            cmd.env("RINGTMP_CACHE_DIR", cache);
            if rank == 0 {
                cmd.args(["--config", config]).args(rank0);
            }
            cmd.args(every);
            cmd.spawn().unwrap()
        })
        .collect()
}
