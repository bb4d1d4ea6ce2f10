//! Running the `ringtmp` binary as a user or a launcher would, every process bounded by a
//! deadline and killed if it outlives it.

use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// Waits for `child` at most `limit`; kills it if it is still running then. Returns its output
/// and how long it ran.
///
/// # Panics
/// If waiting for the process fails.
pub fn finish(mut child: Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    while started.elapsed() < limit {
        if child.try_wait().expect("waiting for a child").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    (
        child.wait_with_output().expect("the child's output"),
        started.elapsed(),
    )
}

/// The standard error of a finished process, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The standard output of a finished process, as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// # Panics
/// If no port can be bound.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
