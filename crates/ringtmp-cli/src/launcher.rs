//! The local launcher: starts N node processes of this same binary on loopback, streams their
//! output into one display (each line prefixed with its node), forwards Ctrl-C, and on the first
//! failure stops the others and reports which node failed and why.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A finished or failed node.
struct Outcome {
    rank: u32,
    status: ExitStatus,
}

/// Runs `nodes` local node processes; `args(rank)` is each one's command line after the binary.
/// With `pin`, node r is pinned to core r when there are at least `nodes` cores.
pub fn launch(nodes: u32, pin: bool, args: impl Fn(u32) -> Vec<String>) -> Result<()> {
    launch_tolerating(nodes, pin, args, |_| false)
}

/// [`launch`], except that nodes for which `expendable(rank)` holds may fail without failing the
/// run (a parameter server that drops dead workers keeps going without them).
pub fn launch_tolerating(
    nodes: u32,
    pin: bool,
    args: impl Fn(u32) -> Vec<String>,
    expendable: impl Fn(u32) -> bool,
) -> Result<()> {
    let exe = std::env::current_exe().context("locating the ringtmp binary")?;
    let cores = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pin = if pin && cores < nodes as usize {
        eprintln!("launcher: --pin ignored: {nodes} nodes but only {cores} cores");
        false
    } else {
        pin
    };
    let port = free_port()?;
    let secret = hex::encode(rand::random::<[u8; 32]>());
    eprintln!("launcher: starting {nodes} local node(s); rendezvous at 127.0.0.1:{port}");
    let last_errors: Arc<Mutex<Vec<String>>> =
        Arc::new(Mutex::new(vec![String::new(); nodes as usize]));
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in 0..nodes {
        let mut cmd = Command::new(&exe);
        cmd.arg("node")
            .args([
                "--rank",
                &rank.to_string(),
                "--world-size",
                &nodes.to_string(),
            ])
            .args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port.to_string(),
            ])
            .args(args(rank))
            .env("RINGTMP_SECRET", &secret)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if pin {
            cmd.args(["--cpu", &rank.to_string()]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting node {rank}"))?;
        stream(rank, child.stdout.take(), false, last_errors.clone());
        stream(rank, child.stderr.take(), true, last_errors.clone());
        children.push((rank, child));
    }

    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        // Ctrl-C reaches the nodes too (same process group); we stop them if they linger.
        let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));
    }
    let mut failed: Option<Outcome> = None;
    let mut usage_errors = vec![false; nodes as usize];
    let mut interrupt_at: Option<Instant> = None;
    while !children.is_empty() {
        let mut still = Vec::new();
        for (rank, mut child) in children {
            match child.try_wait() {
                Ok(Some(status)) => {
                    usage_errors[rank as usize] = status.code() == Some(2);
                    if !status.success() && expendable(rank) {
                        eprintln!(
                            "launcher: node {rank} failed ({status}); the run continues without it"
                        );
                    } else if !status.success() && failed.is_none() {
                        failed = Some(Outcome { rank, status });
                    }
                }
                Ok(None) => still.push((rank, child)),
                Err(e) => bail!("waiting for node {rank}: {e}"),
            }
        }
        children = still;
        if interrupted.load(Ordering::SeqCst) && interrupt_at.is_none() {
            interrupt_at = Some(Instant::now());
            for (_, child) in &children {
                // SAFETY: sending a signal to our own child process.
                unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            }
        }
        let give_up =
            failed.is_some() || interrupt_at.is_some_and(|t| t.elapsed() > Duration::from_secs(5));
        if give_up && !children.is_empty() {
            // The others learn of the failure within seconds through the abort; give them that
            // long to report it themselves, then stop them.
            let grace = Instant::now();
            while grace.elapsed() < Duration::from_secs(10)
                && children
                    .iter_mut()
                    .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
            {
                thread::sleep(Duration::from_millis(50));
            }
            for (_, child) in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            children.clear();
        }
        thread::sleep(Duration::from_millis(20));
    }
    if interrupted.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    if let Some(f) = failed {
        let errors = last_errors.lock().map(|e| e.clone()).unwrap_or_default();
        let (culprit, why) = culprit(f.rank, &f.status, &errors);
        let message = format!("node {culprit} failed{why}");
        // A node that refused its options makes this a usage error too (exit status 2).
        if usage_errors[culprit as usize] {
            return Err(crate::UsageError(message).into());
        }
        bail!(message);
    }
    Ok(())
}

/// Which node caused the failure, and why. Nodes that fail because a peer died name that peer
/// (`rank K …`) in their error; a node named by another's error is the culprit even when it
/// printed nothing itself (killed, crashed). Otherwise the first node seen failing.
fn culprit(first: u32, status: &ExitStatus, errors: &[String]) -> (u32, String) {
    for (reporter, error) in errors.iter().enumerate() {
        let named = error
            .split("rank ")
            .skip(1)
            .filter_map(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse::<u32>()
                    .ok()
            })
            .find(|r| *r as usize != reporter && (*r as usize) < errors.len());
        if let Some(rank) = named
            && !error.contains("aborted the run")
        {
            let own = &errors[rank as usize];
            let own = if own.is_empty() {
                String::new()
            } else {
                format!(": {own}")
            };
            return (rank, format!("{own} (node {reporter} reports: {error})"));
        }
    }
    let own = &errors[first as usize];
    (
        first,
        format!(
            " ({status}){}",
            if own.is_empty() {
                String::new()
            } else {
                format!(": {own}")
            }
        ),
    )
}

/// Copies a child's output line by line, prefixed with its rank; remembers its last error line.
fn stream(
    rank: u32,
    pipe: Option<impl std::io::Read + Send + 'static>,
    is_err: bool,
    last_errors: Arc<Mutex<Vec<String>>>,
) {
    let Some(pipe) = pipe else { return };
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if is_err {
                if let Some(msg) = line.strip_prefix("error: ")
                    && let Ok(mut e) = last_errors.lock()
                {
                    e[rank as usize] = msg.to_string();
                }
                eprintln!("[node {rank}] {line}");
            } else {
                println!("[node {rank}] {line}");
            }
        }
    });
}

/// A port that was free a moment ago (rank 0 binds it right away).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}
