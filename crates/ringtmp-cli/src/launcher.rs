//! The local launcher: starts N node processes of this same binary on loopback, streams their
//! output into one display (each line prefixed with its node), and brings every one of them down
//! with it, whatever happens.
//!
//! Invariants:
//! - **Every wait is bounded.** Once the run is over (rank 0 exited successfully), the other
//!   nodes get [`AFTER_RUN_GRACE`] to exit; one still there then (stopped, hung) is killed and
//!   named. After a failure they get [`AFTER_FAILURE_GRACE`] to report it themselves.
//! - **No orphans.** SIGINT, SIGTERM and SIGHUP sent to the launcher alone (as `kill`, `timeout`
//!   and service managers do) are forwarded to every node, which then get [`AFTER_SIGNAL_GRACE`]
//!   before they are killed; the launcher exits with 128 + the signal's number. Each node also
//!   asks the kernel for SIGTERM should the launcher die without a word (SIGKILL, a crash).
//! - On the first failure the launcher stops the others and reports which node failed and why.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::error::{Interrupted, NodeFailed, UsageError};

/// How long the other nodes may take to exit after rank 0 finished the run successfully.
pub const AFTER_RUN_GRACE: Duration = Duration::from_secs(5);
/// How long the other nodes may take to notice a failure and report it themselves.
pub const AFTER_FAILURE_GRACE: Duration = Duration::from_secs(10);
/// How long the nodes may take to exit after a forwarded signal.
pub const AFTER_SIGNAL_GRACE: Duration = Duration::from_secs(5);

/// Set in the environment of the nodes this launcher starts.
pub const LOCAL_LAUNCHER_ENV: &str = "RINGTMP_LOCAL_LAUNCHER";

/// What to launch.
pub struct Launch<'a> {
    /// Node processes to start.
    pub nodes: u32,
    /// Pin node r to core r (ignored, with a notice, when there are fewer cores than nodes).
    pub pin: bool,
    /// Show the nodes' informational log lines (otherwise warnings and errors only).
    pub verbose: bool,
    /// Each node's command line after `ringtmp node --rank … --master-port …`.
    pub args: &'a dyn Fn(u32) -> Vec<String>,
    /// Nodes that may fail without failing the run (a parameter server that drops dead workers
    /// keeps going without them).
    pub expendable: &'a dyn Fn(u32) -> bool,
    /// Called with each node's rank and pid right after it starts (to put it under a CPU
    /// quota); an error stops the launch.
    pub on_spawn: &'a dyn Fn(u32, u32) -> Result<()>,
    /// Why node `rank` died, when the launcher's side knows better than its exit status (it
    /// exceeded an enforced memory limit).
    pub explain: &'a dyn Fn(u32) -> Option<String>,
    /// Pass rank 0's standard output through as it comes, byte for byte and unprefixed (what
    /// `generate` prints, token by token), instead of line by line with its node's prefix.
    pub raw_rank0_stdout: bool,
}

/// How a launch ended when it did not fail.
#[derive(Debug, Default)]
pub struct Ended {
    /// Expendable nodes that failed during the run: `(rank, exit status)`.
    pub failed_expendable: Vec<(u32, String)>,
    /// Nodes that had not exited [`AFTER_RUN_GRACE`] after the run ended and were killed.
    pub killed_after_run: Vec<u32>,
}

/// Runs `nodes` local node processes; `args(rank)` is each one's command line after the binary.
pub fn launch(nodes: u32, pin: bool, args: impl Fn(u32) -> Vec<String>) -> Result<Ended> {
    run(&Launch {
        nodes,
        pin,
        verbose: false,
        args: &args,
        expendable: &|_| false,
        on_spawn: &|_, _| Ok(()),
        explain: &|_| None,
        raw_rank0_stdout: false,
    })
}

/// Starts the nodes, waits for them (bounded, as the module header says) and reports.
pub fn run(launch: &Launch<'_>) -> Result<Ended> {
    let nodes = launch.nodes;
    let exe = std::env::current_exe().context("locating the ringtmp binary")?;
    let cores = thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pin = if launch.pin && cores < nodes as usize {
        eprintln!("launcher: --pin ignored: {nodes} nodes but only {cores} cores");
        false
    } else {
        launch.pin
    };
    // Before any node exists, so that no signal can fall between a spawn and the handler.
    let signal = forward_signals()?;
    let port = free_port()?;
    let secret = hex::encode(rand::random::<[u8; 32]>());
    if launch.verbose {
        eprintln!("launcher: starting {nodes} local node(s); rendezvous at 127.0.0.1:{port}");
    }
    // The nodes log warnings and errors unless asked for more (or RINGTMP_LOG says otherwise).
    let log_level = std::env::var("RINGTMP_LOG")
        .unwrap_or_else(|_| if launch.verbose { "info" } else { "warn" }.into());
    let last_errors: Arc<Mutex<Vec<String>>> =
        Arc::new(Mutex::new(vec![String::new(); nodes as usize]));
    let mut running: Vec<(u32, Child)> = Vec::new();
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
            .args((launch.args)(rank))
            .env("RINGTMP_SECRET", &secret)
            .env("RINGTMP_LOG", &log_level)
            .env(LOCAL_LAUNCHER_ENV, "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if pin {
            cmd.args(["--cpu", &rank.to_string()]);
        }
        die_with_parent(&mut cmd);
        let spawned = cmd.spawn().with_context(|| format!("starting node {rank}"));
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut running, libc::SIGTERM, AFTER_SIGNAL_GRACE);
                return Err(e);
            }
        };
        if launch.raw_rank0_stdout && rank == 0 {
            pass_through(child.stdout.take());
        } else {
            stream(rank, child.stdout.take(), false, last_errors.clone());
        }
        stream(rank, child.stderr.take(), true, last_errors.clone());
        let pid = child.id();
        running.push((rank, child));
        if let Err(e) = (launch.on_spawn)(rank, pid) {
            stop_all(&mut running, libc::SIGTERM, AFTER_SIGNAL_GRACE);
            return Err(e);
        }
    }

    let mut ended = Ended::default();
    let mut failed: Option<(u32, ExitStatus)> = None;
    let mut usage_errors = vec![false; nodes as usize];
    let mut run_over_at: Option<Instant> = None;
    while !running.is_empty() {
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait() {
                Ok(Some(status)) => {
                    usage_errors[rank as usize] = status.code() == Some(2);
                    if status.success() {
                        if rank == 0 {
                            run_over_at = Some(Instant::now());
                        }
                    } else if run_over_at.is_some() {
                        // Rank 0 wrote the run's results after every node had reported: the run
                        // is complete, whatever this node did on its way out.
                        eprintln!(
                            "launcher: node {rank} failed ({status}) after the run had ended; \
                             its results were already in"
                        );
                    } else if (launch.expendable)(rank) && failed.is_none() {
                        let why = (launch.explain)(rank).unwrap_or_else(|| status.to_string());
                        eprintln!(
                            "launcher: node {rank} failed ({why}); the run continues without it"
                        );
                        ended.failed_expendable.push((rank, status.to_string()));
                    } else if failed.is_none() {
                        failed = Some((rank, status));
                    }
                }
                Ok(None) => still.push((rank, child)),
                Err(e) => {
                    still.push((rank, child));
                    stop_all(&mut still, libc::SIGTERM, AFTER_SIGNAL_GRACE);
                    bail!("waiting for node {rank}: {e}");
                }
            }
        }
        running = still;
        let sig = signal.load(Ordering::SeqCst);
        if sig != 0 {
            // Forward what we were sent; whoever sent it meant the whole run.
            stop_all(&mut running, sig, AFTER_SIGNAL_GRACE);
            return Err(Interrupted { signal: sig }.into());
        }
        if failed.is_some() && !running.is_empty() {
            // The others learn of the failure within seconds through the abort; give them that
            // long to report it themselves, then stop them.
            wait_all(&mut running, AFTER_FAILURE_GRACE, &signal);
            stop_all(&mut running, libc::SIGKILL, Duration::ZERO);
        }
        if let Some(at) = run_over_at
            && at.elapsed() >= AFTER_RUN_GRACE
            && !running.is_empty()
        {
            for (rank, _) in &running {
                eprintln!(
                    "launcher: node {rank} had not exited {}s after the run ended (stopped or \
                     hung); killed it",
                    AFTER_RUN_GRACE.as_secs()
                );
                ended.killed_after_run.push(*rank);
            }
            stop_all(&mut running, libc::SIGKILL, Duration::ZERO);
        }
        thread::sleep(Duration::from_millis(20));
    }
    if let Some((rank, status)) = failed {
        // A node the kernel killed for its memory says nothing itself; the others only saw it
        // go. Its limit is the cause.
        if let Some((rank, message)) = (0..nodes).find_map(|r| Some((r, (launch.explain)(r)?))) {
            return Err(NodeFailed { rank, message }.into());
        }
        let errors = last_errors.lock().map(|e| e.clone()).unwrap_or_default();
        let (culprit, why) = culprit(rank, &status, &errors);
        let message = format!("node {culprit} failed{why}");
        // A node that refused its options makes this a usage error too (exit status 2).
        if usage_errors[culprit as usize] {
            return Err(UsageError(message).into());
        }
        return Err(NodeFailed {
            rank: culprit,
            message,
        }
        .into());
    }
    Ok(ended)
}

/// Waits until every child has exited or `limit` has passed (or a signal arrived).
fn wait_all(children: &mut Vec<(u32, Child)>, limit: Duration, signal: &AtomicI32) {
    let started = Instant::now();
    while started.elapsed() < limit && signal.load(Ordering::SeqCst) == 0 {
        children.retain_mut(|(_, c)| matches!(c.try_wait(), Ok(None)));
        if children.is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` to every child, gives them `grace` to exit, then kills and reaps them all.
fn stop_all(children: &mut Vec<(u32, Child)>, signal: i32, grace: Duration) {
    for (_, child) in children.iter() {
        // SAFETY: kill(2) on the pid of a child we have not reaped yet (so not reused).
        unsafe { libc::kill(child.id() as i32, signal) };
    }
    wait_all(children, grace, &AtomicI32::new(0));
    for (_, child) in children.iter_mut() {
        // SIGKILL ends a stopped process too, so the wait that follows is bounded.
        let _ = child.kill();
        let _ = child.wait();
    }
    children.clear();
}

/// Catches SIGINT, SIGTERM and SIGHUP for the launcher: the first one received is stored in the
/// returned flag (the main loop forwards it to the nodes) instead of ending the process.
fn forward_signals() -> Result<Arc<AtomicI32>> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let received = Arc::new(AtomicI32::new(0));
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("catching signals")?;
    let flag = received.clone();
    thread::spawn(move || {
        for sig in signals.forever() {
            let _ = flag.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
        }
    });
    Ok(received)
}

/// Makes the kernel send the child SIGTERM when the launcher dies, however it dies.
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid, prctl and getppid are async-signal-safe, as pre_exec requires.
    let parent = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || {
            // The death signal follows the thread that spawned the child; the launcher spawns
            // from its main thread, which lives as long as the process.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before the prctl took effect.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the launcher has exited"));
            }
            Ok(())
        });
    }
}

/// Which node caused the failure, and why. Nodes that fail because a peer died name that peer
/// (`rank K …`) in their error; a node named by another's error is the culprit even when it
/// printed nothing itself (killed, crashed). The naming is followed as a chain (node 0 names node
/// 1, which failed because node 2 died): the culprit is where it ends. Otherwise the first node
/// seen failing.
fn culprit(first: u32, status: &ExitStatus, errors: &[String]) -> (u32, String) {
    let names = |reporter: usize| -> Option<u32> {
        let error = &errors[reporter];
        if error.contains("aborted the run") {
            return None;
        }
        error
            .split("rank ")
            .skip(1)
            .filter_map(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse::<u32>()
                    .ok()
            })
            .find(|r| *r as usize != reporter && (*r as usize) < errors.len())
    };
    for reporter in 0..errors.len() {
        let Some(mut rank) = names(reporter) else {
            continue;
        };
        let mut seen = vec![reporter as u32];
        while let Some(next) = names(rank as usize).filter(|n| !seen.contains(n)) {
            seen.push(rank);
            rank = next;
        }
        let own = &errors[rank as usize];
        let own = if own.is_empty() {
            String::new()
        } else {
            format!(": {own}")
        };
        return (
            rank,
            format!("{own} (node {reporter} reports: {})", errors[reporter]),
        );
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

/// Copies a node's standard output to ours as it comes (no line buffering, no prefix).
fn pass_through(pipe: Option<impl std::io::Read + Send + 'static>) {
    let Some(mut pipe) = pipe else { return };
    thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        let mut out = std::io::stdout();
        while let Ok(n) = std::io::Read::read(&mut pipe, &mut buffer) {
            if n == 0 {
                break;
            }
            use std::io::Write;
            let _ = out.write_all(&buffer[..n]);
            let _ = out.flush();
        }
    });
}

/// A port that was free a moment ago, for rank 0 to bind right away. Taken below the kernel's
/// ephemeral range when there is room: a port the kernel handed out for `:0` goes back to the
/// pool that outgoing connections draw their local ports from, so between this check and rank
/// 0's bind any connection on the machine could take it (seen as "Address already in use" when
/// tests launch runs side by side); below that range only an explicit bind competes.
fn free_port() -> Result<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const LOWEST: u16 = 10_000;
    if ephemeral_low > LOWEST + 1000 {
        for _ in 0..64 {
            let port = rand::random_range(LOWEST..ephemeral_low);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn the_culprit_is_where_the_chain_of_names_ends() {
        let status = ExitStatus::from_raw(1 << 8);
        // Node 0 saw node 1 go, node 1 saw node 2 go, node 2 said nothing (it crashed).
        let errors = [
            "rank 1 (127.0.0.1:1) closed the connection".to_string(),
            "rank 2 (127.0.0.1:2) closed the connection".to_string(),
            String::new(),
        ];
        assert_eq!(culprit(0, &status, &errors).0, 2);
        // Two nodes naming each other: the chain stops instead of going round.
        let errors = ["rank 1 went".to_string(), "rank 0 went".to_string()];
        assert_eq!(culprit(0, &status, &errors).0, 1);
        // Nobody names anybody: the first seen failing.
        let errors = [String::new(), "out of memory".to_string()];
        assert_eq!(culprit(1, &status, &errors).0, 1);
    }
}
