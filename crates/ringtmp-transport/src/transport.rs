//! What a strategy sees of the network its node is on, whichever network that is: real TCP links
//! ([`crate::Network`]) or the in-memory simulated network ([`crate::sim`]). Strategies take
//! `&mut dyn Transport` and never name either, so the same protocol code runs on sockets, in
//! seeded deterministic tests, and (with compute replaced by a cost model) in the simulator.
//!
//! Contract shared by both implementations:
//! - Messages from one peer arrive in the order it sent them; every wait ends within its timeout
//!   with an error naming the peer and what was awaited.
//! - A peer that dies (closes without a goodbye) or goes silent surfaces as an error on the next
//!   receive; an `Abort` from any peer is passed on to the others and returned as
//!   [`TransportError::Aborted`].
//! - Time comes from [`Transport::clock`]: wall time on sockets, virtual time in simulation. Code
//!   that measures or emulates compute time goes through it, never through `Instant` or `sleep`.

use std::sync::Arc;
use std::time::Duration;

use ringtmp_wire::Message;

use crate::error::{PeerName, TransportError};
use crate::pool::BufferPool;

/// The blocking, node-facing API of a network.
pub trait Transport: Send {
    /// This node's rank.
    fn rank(&self) -> u32;
    /// Ranks this node has links to, in increasing order.
    fn peers(&self) -> Vec<u32>;
    /// How a peer is named in errors.
    fn peer_name(&self, rank: u32) -> PeerName;
    /// Queues `message` for `to` (bounded: a link that cannot take it in time is an error).
    fn send(&self, to: u32, message: Message) -> Result<(), TransportError>;
    /// The next message from any peer, waiting at most `wait`.
    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError>;
    /// A message that has already arrived, without waiting (`Ok(None)` when there is none).
    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError>;
    /// The next message from `from` (others are kept for later), waiting at most `wait`.
    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError>;
    /// Puts a message back so that the next receive returns it first.
    fn unread(&mut self, from: u32, message: Message);
    /// The pool payload buffers come from and go back to.
    fn buffers(&self) -> &BufferPool;
    /// Traffic and waiting per link.
    fn stats(&self) -> Vec<LinkStats>;
    /// Tells every peer this node is giving up (best effort, bounded).
    fn abort(&self, reason: &str);
    /// Orderly shutdown: goodbye to every peer, and a bounded wait for theirs.
    fn close(&mut self) -> Result<(), TransportError>;
    /// This node's clock.
    fn clock(&self) -> Arc<dyn Clock>;
    /// Arms the run-wide bound on waiting without a step ([`crate::progress`]) on the node that
    /// keeps the run's steps. A transport without one (the simulator, whose deadlocks end at
    /// its receive timeouts in virtual time) ignores it.
    fn watch_steps(&mut self, _bound: crate::progress::StepBound) {}
    /// A step of the run completed (see [`Transport::watch_steps`]).
    fn step_done(&mut self) {}
}

/// A node's clock: wall time on real networks, virtual time in simulation.
pub trait Clock: Send + Sync {
    /// Time since the node's network came up.
    fn now(&self) -> Duration;
    /// Accounts for compute the node just did, `measured` long on this machine. `speed` < 1
    /// emulates a node that many times slower: the wall clock sleeps the difference; a virtual
    /// clock advances by its cost model's figure for the work divided by `speed`.
    fn computed(&self, measured: Duration, speed: f64);
    /// Whether compute may run on another thread while the node keeps using its network, with
    /// [`Clock::computed`] called from that thread. True of the wall clock; a virtual clock
    /// accounts compute in the node's turn, so there the node computes, accounts, and only then
    /// receives again (what arrived meanwhile is handled after the compute, in virtual time).
    fn overlaps_compute(&self) -> bool {
        true
    }
    /// Whether this is a simulated network's virtual clock, where compute is priced rather than
    /// timed (wall-clock figures of the node's compute describe no simulated machine).
    fn is_virtual(&self) -> bool {
        false
    }
}

/// The wall clock of a node on a real network.
pub struct WallClock {
    started: std::time::Instant,
}

impl WallClock {
    /// A clock whose [`Clock::now`] counts from now.
    pub fn new() -> Self {
        Self {
            started: std::time::Instant::now(),
        }
    }
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for WallClock {
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn computed(&self, measured: Duration, speed: f64) {
        if speed > 0.0 && speed < 1.0 {
            std::thread::sleep(measured.mul_f64(1.0 / speed - 1.0));
        }
    }
}

/// Traffic and waiting on one link, as measured by the transport.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkStats {
    /// The peer's rank.
    pub peer: u32,
    /// Bytes written to the socket (frames, heartbeats included).
    pub bytes_sent: u64,
    /// Bytes read from the socket.
    pub bytes_received: u64,
    /// Frames sent (heartbeats excluded).
    pub messages_sent: u64,
    /// Frames received (heartbeats excluded).
    pub messages_received: u64,
    /// Time the node spent blocked handing messages to this link (back-pressure).
    pub send_wait: Duration,
    /// Time the node spent blocked waiting for a message from this peer.
    pub recv_wait: Duration,
}
