//! What a listener lets a stranger cost it before the stranger has proved the run's secret.
//!
//! Every connection a listener accepts is a stranger until its greeting verifies, so three things
//! are bounded here for the rendezvous and the peer listener alike:
//! - **how many greetings run at once**: at most [`MAX_PENDING`] in all and
//!   [`MAX_PENDING_PER_SOURCE`] from one address; a new connection past either bound closes the
//!   oldest greeting (of that address, or of all), since a peer that holds a secret completes its
//!   greeting in milliseconds and a stranger that stalls is the one still waiting. Each greeting
//!   also has a deadline of its own, and a closed one frees everything it held;
//! - **what a failed accept does**: it is logged and retried after a pause ([`accept`]), never
//!   fatal: running out of file descriptors under a flood of connections is the flood's
//!   problem, not the run's;
//! - **what is kept of the refusals**: a count and the last [`KEPT_REFUSALS`] reasons
//!   ([`Refusals`]), so that an error quoting them stays one short line however many strangers
//!   knocked.
//!
//! The greeting's frames themselves are bounded by [`ringtmp_wire::Limits::greeting`].

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, Id, JoinError, JoinSet};

/// Greetings in progress at once, from every address together.
pub const MAX_PENDING: usize = 64;
/// Greetings in progress at once from one address.
pub const MAX_PENDING_PER_SOURCE: usize = 32;
/// Refusal reasons kept word for word (the rest are counted).
pub const KEPT_REFUSALS: usize = 4;
/// Longest a quoted reason is kept (a stranger chooses what it sends).
const REASON_CHARS: usize = 300;

/// Waits for the next connection on `listener`. A failed accept (out of file descriptors, a
/// connection reset while queued) is logged and retried after `pause`, so the listener keeps
/// serving once the cause passes; only a caller's own deadline ends the wait.
pub async fn accept(listener: &TcpListener, pause: Duration) -> (TcpStream, SocketAddr) {
    let mut failures = 0u64;
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                failures += 1;
                // Once, then at every power of two: a flood must not flood the log as well.
                if failures.is_power_of_two() {
                    tracing::warn!(
                        "accepting a connection failed ({failures} time(s) so far): {e}; retrying"
                    );
                }
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// The greetings a listener is running, bounded as the module says.
pub struct Admission<T> {
    tasks: JoinSet<T>,
    /// Oldest first: each greeting's task, its abort handle and where it came from.
    order: VecDeque<(Id, AbortHandle, IpAddr)>,
    max_pending: usize,
    max_per_source: usize,
    evicted: u64,
}

impl<T: Send + 'static> Default for Admission<T> {
    fn default() -> Self {
        Self::with_bounds(MAX_PENDING, MAX_PENDING_PER_SOURCE)
    }
}

impl<T: Send + 'static> Admission<T> {
    /// Bounds other than the defaults (tests).
    pub fn with_bounds(max_pending: usize, max_per_source: usize) -> Self {
        Self {
            tasks: JoinSet::new(),
            order: VecDeque::new(),
            max_pending: max_pending.max(1),
            max_per_source: max_per_source.max(1),
            evicted: 0,
        }
    }

    /// Starts `greeting` for a connection from `from`, first closing the oldest greeting of that
    /// address (or of all) where a bound would be passed.
    pub fn admit<F>(&mut self, from: SocketAddr, greeting: F)
    where
        F: Future<Output = T> + Send + 'static,
    {
        let source = from.ip();
        if self.order.iter().filter(|(_, _, ip)| *ip == source).count() >= self.max_per_source
            && let Some(i) = self.order.iter().position(|(_, _, ip)| *ip == source)
        {
            self.evict(i);
        }
        if self.order.len() >= self.max_pending {
            self.evict(0);
        }
        let handle = self.tasks.spawn(greeting);
        self.order.push_back((handle.id(), handle, source));
    }

    fn evict(&mut self, index: usize) {
        if let Some((_, handle, ip)) = self.order.remove(index) {
            handle.abort();
            self.evicted += 1;
            if self.evicted.is_power_of_two() {
                tracing::warn!(
                    "closed the oldest unfinished greeting (from {ip}) to admit a new connection \
                     ({} so far)",
                    self.evicted
                );
            }
        }
    }

    /// Greetings in progress.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no greeting is in progress.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Greetings closed to make room for newer ones.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// The next greeting to finish (`None` when none is in progress). A greeting closed to make
    /// room is not reported.
    pub async fn next(&mut self) -> Option<Result<T, JoinError>> {
        loop {
            let done = self.tasks.join_next_with_id().await?;
            let id = match &done {
                Ok((id, _)) => *id,
                Err(e) => e.id(),
            };
            self.order.retain(|(task, _, _)| *task != id);
            match done {
                Ok((_, value)) => return Some(Ok(value)),
                Err(e) if e.is_cancelled() => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// The connections a listener refused: how many, and the last few reasons.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    count: u64,
    last: VecDeque<String>,
}

impl Refusals {
    /// Records one refusal (its reason cut to a few hundred characters).
    pub fn push(&mut self, reason: impl Into<String>) {
        self.count += 1;
        if self.last.len() == KEPT_REFUSALS {
            self.last.pop_front();
        }
        self.last.push_back(clip(&reason.into(), REASON_CHARS));
    }

    /// How many connections were refused.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The last few reasons, oldest first.
    pub fn last(&self) -> impl Iterator<Item = &str> {
        self.last.iter().map(String::as_str)
    }
}

impl fmt::Display for Refusals {
    /// `3 connection(s) refused: a; b; c`, or `2,000 connection(s) refused, the last 4: …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reasons = self.last.iter().cloned().collect::<Vec<_>>().join("; ");
        if self.count as usize <= self.last.len() {
            write!(f, "{} connection(s) refused: {reasons}", self.count)
        } else {
            write!(
                f,
                "{} connection(s) refused, the last {}: {reasons}",
                self.count,
                self.last.len()
            )
        }
    }
}

/// `text` cut to at most `chars` characters, saying how much was left out.
pub fn clip(text: &str, chars: usize) -> String {
    let total = text.chars().count();
    if total <= chars {
        return text.to_string();
    }
    let kept: String = text.chars().take(chars).collect();
    format!("{kept}… ({} more characters)", total - chars)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    #[test]
    fn refusals_keep_a_count_and_the_last_few() {
        let mut refusals = Refusals::default();
        assert!(refusals.is_empty());
        for i in 0..2_000 {
            refusals.push(format!("junk {i}"));
        }
        assert_eq!(refusals.count(), 2_000);
        assert_eq!(
            refusals.last().collect::<Vec<_>>(),
            ["junk 1996", "junk 1997", "junk 1998", "junk 1999"]
        );
        let shown = refusals.to_string();
        assert!(shown.starts_with("2000 connection(s) refused, the last 4: junk 1996"));
        assert!(shown.len() < 200, "{shown}");
        refusals = Refusals::default();
        refusals.push("x".repeat(5_000_000));
        assert!(refusals.to_string().len() < 400);
        assert!(refusals.to_string().contains("4999700 more characters"));
    }

    #[tokio::test]
    async fn the_oldest_greeting_makes_room_for_a_new_one() {
        let mut admission: Admission<u32> = Admission::with_bounds(3, 2);
        let stalled = || std::future::pending::<u32>();
        admission.admit(addr([10, 0, 0, 1], 1), stalled());
        admission.admit(addr([10, 0, 0, 1], 2), stalled());
        // A third from the same address closes that address's oldest.
        admission.admit(addr([10, 0, 0, 1], 3), stalled());
        assert_eq!((admission.len(), admission.evicted()), (2, 1));
        admission.admit(addr([10, 0, 0, 2], 1), stalled());
        // The total bound closes the oldest of all.
        admission.admit(addr([10, 0, 0, 3], 1), async { 7 });
        assert_eq!((admission.len(), admission.evicted()), (3, 2));
        // Evicted greetings are never reported; a finished one is.
        let done = tokio::time::timeout(Duration::from_secs(5), admission.next()).await;
        assert_eq!(done.unwrap().unwrap().unwrap(), 7);
        assert_eq!(admission.len(), 2);
    }
}
