//! `ringtmp-transport`: authenticated, accounted, optionally shaped TCP links between nodes, with
//! liveness. One full-duplex connection per neighbour pair; a reader and a writer task per
//! connection on a small tokio runtime; the node's compute runs on its own threads and talks to the
//! links through a blocking API whose every wait has a timeout.
//!
//! Invariants:
//! - Nothing a peer sends is acted on before the handshake has verified its protocol version, run
//!   id, rank and proof of the shared secret (see `ringtmp_wire::auth`).
//! - Every wait — connect, handshake, send, receive — ends within its configured timeout, and the
//!   error names the peer (rank and address) and what was awaited.
//! - A peer that closes its connection or stops sending (heartbeats included) for longer than
//!   `peer_timeout` is reported to the node; an `Abort` from any peer is forwarded to every other
//!   peer, so one failure stops the whole run.
//!
//! # Layout
//! - [`admission`]: what a stranger may cost a listener before its greeting verifies.
//! - [`config`]: timeouts, limits, shaping.
//! - [`link_cost`]: what a link costs a node's CPU per byte (framing, sealing, opening).
//! - [`framed`]: reading and writing frames on a socket.
//! - [`handshake`]: the authenticated greeting.
//! - [`network`]: establishing links and the blocking node-facing API ([`Network`]).
//! - [`pool`]: recycled payload buffers shared by the node and its links.
//! - [`transport`]: the [`Transport`] trait strategies program against, and node [`Clock`]s.
//! - [`sim`]: an in-memory network on a seeded virtual clock, for deterministic protocol tests
//!   and simulation.

pub mod admission;
pub mod config;
mod error;
pub mod framed;
pub mod handshake;
pub mod link_cost;
pub mod network;
pub mod pool;
pub mod progress;
pub mod secure;
pub mod shaper;
pub mod sim;
mod sim_card;
pub mod transport;

pub use config::{Shaping, TransportConfig};
pub use error::{PeerName, TransportError};
pub use network::{Network, SentRecord, bind_listener};
pub use pool::BufferPool;
pub use progress::{StepBound, StepWatch};
pub use transport::{Clock, LinkStats, Transport, WallClock};
