//! Transport settings. Defaults are seconds, not minutes: a dead peer must surface quickly.

use std::time::Duration;

use ringtmp_wire::Limits;

/// Emulated link properties (for studying edge clusters on one machine).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Shaping {
    /// Sending rate of the node's emulated network card in bits per second, shared by all its
    /// outgoing links ([`crate::shaper`]); `None` = unlimited.
    pub bandwidth_bps: Option<u64>,
    /// Added one-way latency of every frame the node sends.
    pub latency: Duration,
}

/// Everything a node's transport needs.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Run id; a peer from another run is refused.
    pub run_id: u64,
    /// This node's rank.
    pub rank: u32,
    /// Shared secret for the HMAC handshake.
    pub secret: Vec<u8>,
    /// Bounds on frames from peers.
    pub limits: Limits,
    /// How often each link sends a heartbeat when otherwise idle.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is declared dead.
    pub peer_timeout: Duration,
    /// Time allowed for a peer's handshake messages.
    pub handshake_timeout: Duration,
    /// Time allowed to establish all links (dialling retries until then).
    pub connect_timeout: Duration,
    /// Longest a send may wait for room in a link's queue (back-pressure from a slow peer).
    pub send_timeout: Duration,
    /// Emulated link properties.
    pub shaping: Shaping,
    /// Encrypt and authenticate every frame after the greeting ([`crate::secure`]); off only
    /// with `--insecure-plaintext`. Both ends of a link must agree.
    pub encrypt: bool,
    /// Whether this node would seal its private links with AES-256-GCM (by default: whether its
    /// CPU has AES instructions, [`crate::secure::Cipher::aes_is_fast_here`]); a link uses it
    /// when both ends would, else ChaCha20-Poly1305.
    pub aes: bool,
}

impl TransportConfig {
    /// Defaults: heartbeats every 1 s, a peer silent for 5 s is dead, 5 s handshakes, 30 s to
    /// connect, 30 s sends.
    pub fn new(run_id: u64, rank: u32, secret: Vec<u8>) -> Self {
        Self {
            run_id,
            rank,
            secret,
            limits: Limits::default(),
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(30),
            shaping: Shaping::default(),
            encrypt: true,
            aes: crate::secure::Cipher::aes_is_fast_here(),
        }
    }
}
