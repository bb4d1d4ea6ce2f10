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

/// A child that is killed when dropped unfinished: where a test runs several processes at once,
/// a failed assertion on one must not leave the others running.
pub struct Running(Option<Child>);

impl Running {
    /// Takes charge of `child`.
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// [`finish`]: waits for the child at most `limit`, killing it then.
    ///
    /// # Panics
    /// If waiting for the process fails.
    pub fn finish(mut self, limit: Duration) -> (Output, Duration) {
        finish(self.0.take().expect("a child not yet finished"), limit)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
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
    // Below the kernel's ephemeral range, as the launcher does: a port handed out for `:0` and
    // released may be taken by any outgoing connection before the node binds it.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32768);
    if low > 11_000 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        let mut x = nanos ^ (u64::from(std::process::id()) << 20);
        for _ in 0..64 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) | 1);
            let port = 10_000 + (x >> 33) % (low - 10_000);
            if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
