//! The node runtime and the local launcher: selftest rings, dead, stopped and unauthenticated nodes, signals, and the step bound.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use ringtmp_testkit::process::{finish, free_port, stderr};

use super::common::*;

#[test]
fn local_launcher_runs_a_selftest_ring() {
    let child = ringtmp()
        .args([
            "selftest",
            "--nodes",
            "3",
            "--size-mib",
            "0.5",
            "--rounds",
            "3",
            "--pings",
            "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, _) = finish(child, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout.contains("[node 0] selftest ok: 3 node(s)"),
        "{stdout}"
    );
}

// With `--pin`, selftest also says what the nodes' cores cost each other computing at once.
#[test]
fn pinned_selftest_also_reports_what_its_cores_cost_each_other() {
    if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
        return;
    }
    let child = ringtmp()
        .args([
            "selftest",
            "--nodes",
            "2",
            "--pin",
            "--size-mib",
            "0.25",
            "--rounds",
            "2",
            "--pings",
            "10",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, _) = finish(child, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout.contains("selftest ok: 2 node(s)"), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("[selftest] cores [0, 1] computing at once"))
        .unwrap_or_else(|| panic!("no cores line in {stdout}"));
    assert!(
        line.contains("arithmetic") && line.contains("memory"),
        "{line}"
    );
    assert!(
        stdout.contains("[selftest] 2 ring nodes pinned to CPUs 0,1 compute at"),
        "{stdout}"
    );
}

#[test]
fn launcher_reports_a_crashed_node_and_exits_non_zero() {
    let child = ringtmp()
        .args([
            "selftest",
            "--nodes",
            "3",
            "--size-mib",
            "0.25",
            "--rounds",
            "1000000",
            "--pings",
            "10",
        ])
        .args(["--crash-rank", "2", "--crash-after-ms", "1500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, took) = finish(child, Duration::from_secs(60));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("node 2 failed"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn killed_node_is_detected_by_its_neighbours_within_ten_seconds() {
    let port = free_port();
    let mut nodes: Vec<Child> = (0..3).map(|r| node(r, 3, port, SECRET, &[])).collect();
    std::thread::sleep(Duration::from_millis(2000));
    let mut victim = nodes.pop().unwrap();
    victim.kill().unwrap();
    let killed_at = Instant::now();
    let _ = victim.wait();
    for (rank, child) in nodes.into_iter().enumerate() {
        let (out, _) = finish(child, Duration::from_secs(15));
        let err = stderr(&out);
        let after = killed_at.elapsed();
        assert_eq!(out.status.code(), Some(1), "rank {rank}: {err}");
        assert!(
            err.contains("rank 2"),
            "rank {rank} must name the dead node: {err}"
        );
        assert!(
            after < Duration::from_secs(10),
            "rank {rank} stopped {after:?} after the kill"
        );
    }
}

#[test]
fn stopped_node_is_detected_by_heartbeat() {
    let port = free_port();
    let mut nodes: Vec<Child> = (0..3).map(|r| node(r, 3, port, SECRET, &[])).collect();
    std::thread::sleep(Duration::from_millis(2000));
    let frozen = nodes.remove(1);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(frozen.id() as i32, libc::SIGSTOP) };
    let stopped_at = Instant::now();
    for child in nodes {
        let (out, _) = finish(child, Duration::from_secs(15));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("rank 1"), "must name the frozen node: {err}");
        assert!(
            stopped_at.elapsed() < Duration::from_secs(10),
            "{:?}",
            stopped_at.elapsed()
        );
    }
    // Once it runs again, the frozen node does not blame the live peers it could not hear: it
    // hears why they ended (its own silence).
    // SAFETY: signalling our own child.
    unsafe { libc::kill(frozen.id() as i32, libc::SIGCONT) };
    let (out, _) = finish(frozen, Duration::from_secs(15));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for live in [0, 2] {
        assert!(
            !names_silent(&err, live),
            "the resumed node blames live rank {live}: {err}"
        );
    }
}

/// Whether `err` says that `rank` fell silent (`rank R (ADDR) has been silent`).
fn names_silent(err: &str, rank: u32) -> bool {
    let name = format!("rank {rank} (");
    err.match_indices(&name).any(|(i, _)| {
        err[i..]
            .split_once(')')
            .is_some_and(|(_, rest)| rest.starts_with(" has been silent"))
    })
}

// A flood of idle connections at the open-file limit neither ends the rendezvous nor keeps
// the real node out: greetings past the bound close the oldest, failed accepts are retried.
#[test]
fn idle_connections_at_the_file_limit_do_not_stop_the_rendezvous() {
    use std::os::unix::process::CommandExt;
    let port = free_port();
    let mut rank_0 = short_selftest_node(0, port);
    // SAFETY: setrlimit only, in the child before exec.
    unsafe {
        rank_0.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 48,
                rlim_max: 48,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let rank_0 = rank_0.spawn().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    let mut idle = Vec::new();
    while idle.len() < 200 && Instant::now() < until {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => idle.push(s),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    assert_eq!(idle.len(), 200, "rank 0 never listened");
    let started = Instant::now();
    let real = short_selftest_node(1, port).spawn().unwrap();
    let (out, _) = finish(real, Duration::from_secs(45));
    assert!(out.status.success(), "{}", stderr(&out));
    let (host, _) = finish(rank_0, Duration::from_secs(20));
    assert!(host.status.success(), "{}", stderr(&host));
    println!("rank 1 joined past the flood in {:?}", started.elapsed());
    drop(idle);
}

/// Rank `rank` of a 2-node selftest of three rounds, waiting up to 40 s for the others.
fn short_selftest_node(rank: u32, port: u16) -> std::process::Command {
    let mut node = ringtmp();
    node.args(["node", "--rank", &rank.to_string(), "--world-size", "2"])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args([
            "--job",
            "selftest",
            "--rounds",
            "3",
            "--size-mib",
            "0.25",
            "--pings",
            "3",
        ])
        .args(["--connect-timeout", "40"])
        .env("RINGTMP_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    node
}

// A timeout too large to add to the clock is bad input, not a panic.
#[test]
fn timeouts_past_a_week_are_usage_errors() {
    for flag in ["--connect-timeout", "--peer-timeout", "--recv-timeout"] {
        let out = ringtmp()
            .args(["node", "--rank", "0", "--world-size", "2", flag, "1e19"])
            .env("RINGTMP_SECRET", SECRET)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
        assert!(stderr(&out).contains("at most"), "{flag}: {}", stderr(&out));
    }
}

#[test]
fn node_with_the_wrong_secret_is_refused() {
    let port = free_port();
    let host = node(0, 2, port, SECRET, &[]);
    let intruder = node(1, 2, port, "fedcba9876543210-wrong-secret", &[]);
    let (intruder_out, _) = finish(intruder, Duration::from_secs(20));
    let (host_out, _) = finish(host, Duration::from_secs(20));
    assert_eq!(intruder_out.status.code(), Some(1));
    assert!(
        stderr(&intruder_out).contains("secret"),
        "{}",
        stderr(&intruder_out)
    );
    assert_eq!(host_out.status.code(), Some(1));
    let host_err = stderr(&host_out);
    assert!(
        host_err.contains("refused") && host_err.contains("127.0.0.1"),
        "refusal logged with address: {host_err}"
    );
}

#[test]
fn missing_secret_is_a_usage_error() {
    let out = ringtmp()
        .args(["node", "--rank", "0", "--world-size", "2"])
        .env_remove("RINGTMP_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no shared secret"));
}

// A worker frozen mid-run is dropped by the server, the run ends, and the launcher
// must not wait for the frozen process forever.
#[test]
fn r10_launcher_kills_a_node_still_frozen_after_the_run_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("asp").display().to_string();
    let child = long_ps_run(
        &out,
        &[
            "--epochs",
            "100",
            "--freeze-rank",
            "2",
            "--freeze-after-ms",
            "1000",
        ],
    );
    let (output, took) = finish(child, Duration::from_secs(90));
    let err = stderr(&output);
    assert!(took < Duration::from_secs(80), "the launcher hung: {err}");
    assert!(output.status.success(), "{err}");
    assert!(
        err.contains("launcher: node 2 had not exited"),
        "the frozen node is named: {err}"
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("asp/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["strategy"], "ps");
}

// SIGTERM, SIGINT or SIGHUP sent to the launcher alone stops every node.
#[test]
fn r10_a_signal_to_the_launcher_alone_stops_every_node() {
    for (signal, code) in [
        (libc::SIGTERM, 143),
        (libc::SIGINT, 130),
        (libc::SIGHUP, 129),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("run").display().to_string();
        let child = long_ps_run(&out, &["--epochs", "100000"]);
        let nodes = wait_for_nodes(child.id(), 3, Duration::from_secs(20));
        assert_eq!(nodes.len(), 3, "nodes {nodes:?}");
        // Let them get past rendezvous and into training.
        std::thread::sleep(Duration::from_millis(1500));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let (output, took) = finish(child, Duration::from_secs(30));
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(code), "{err}");
        assert!(err.contains("interrupted by SIG"), "{err}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let lingering: Vec<u32> = nodes.into_iter().filter(|p| alive(*p)).collect();
        assert!(lingering.is_empty(), "nodes still running: {lingering:?}");
    }
}

// No orphans even when the launcher dies without a word: the kernel sends the nodes SIGTERM.
#[test]
fn r10_nodes_die_with_a_killed_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run").display().to_string();
    let mut child = long_ps_run(&out, &["--epochs", "100000"]);
    let nodes = wait_for_nodes(child.id(), 3, Duration::from_secs(20));
    assert_eq!(nodes.len(), 3, "nodes {nodes:?}");
    child.kill().unwrap();
    let _ = child.wait();
    let started = Instant::now();
    while nodes.iter().any(|p| alive(*p)) && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let lingering: Vec<u32> = nodes.into_iter().filter(|p| alive(*p)).collect();
    for p in &lingering {
        // SAFETY: cleaning up after a failed assertion; these are our grandchildren.
        unsafe { libc::kill(*p as i32, libc::SIGKILL) };
    }
    assert!(lingering.is_empty(), "orphaned nodes: {lingering:?}");
}

// A node whose training thread hangs while its links stay alive (heartbeats go on,
// so no link fails) stopped every run until the 300 s receive timeout. Rank 0 now ends a run
// that completes no step within its step bound (here --stall-timeout 3), naming what it waited
// for, and every other node says what it was waiting for when the abort came.
#[test]
fn a_run_that_makes_no_progress_ends_at_the_step_bound_naming_every_wait() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str], &[u32]); 2] = [
        ("ring", &["--nodes", "4", "--use-all-nodes"], &[1, 3]),
        ("ps", &["--nodes", "4", "--servers", "1"], &[1, 3]),
    ];
    for (strategy, extra, waiting) in cases {
        let out = tmp.path().join(strategy);
        let mut args = vec![
            "--strategy",
            strategy,
            "--dataset",
            "digits",
            "--epochs",
            "500",
            "--eval-every",
            "0",
            "--hang-rank",
            "2",
            "--hang-after-ms",
            "1500",
            "--stall-timeout",
            "3",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let started = std::time::Instant::now();
        let (output, _) = finish(spawn_train(&args), Duration::from_secs(120));
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{strategy}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(100),
            "{strategy}: {err}"
        );
        assert!(
            err.contains("[node 0] error: no step completed for") && err.contains("rank 0 waited"),
            "{strategy}: {err}"
        );
        for rank in waiting {
            let line = err
                .lines()
                .find(|l| l.starts_with(&format!("[node {rank}] error:")))
                .unwrap_or_else(|| panic!("{strategy}: node {rank} said nothing: {err}"));
            assert!(
                line.contains("rank 0 aborted the run: no step completed")
                    && line.contains("(while waiting for a message from"),
                "{strategy}: {line}"
            );
        }
    }
}
