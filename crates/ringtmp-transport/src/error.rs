//! Transport errors. Every variant about a peer names it: rank and address.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use ringtmp_wire::DecodeError;

use crate::admission::Refusals;

/// A peer as shown in errors and logs: `rank 2 (127.0.0.1:40123)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerName {
    /// Rank, if known yet (before the handshake it is not).
    pub rank: Option<u32>,
    /// Remote address.
    pub addr: Option<SocketAddr>,
}

impl fmt::Display for PeerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.rank, self.addr) {
            (Some(r), Some(a)) => write!(f, "rank {r} ({a})"),
            (Some(r), None) => write!(f, "rank {r}"),
            (None, Some(a)) => write!(f, "unauthenticated peer {a}"),
            (None, None) => write!(f, "unknown peer"),
        }
    }
}

/// Everything that can go wrong on the links.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Could not listen.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address asked for.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Could not reach a peer within the connect timeout.
    #[error("cannot connect to {peer} within {waited:?}: {reason}")]
    Connect {
        /// The peer.
        peer: PeerName,
        /// How long we tried.
        waited: Duration,
        /// Last failure.
        reason: String,
    },
    /// A peer failed the handshake (wrong secret, version, run or rank). Nothing it sent was used.
    #[error("refused {peer}: {reason}")]
    Handshake {
        /// The peer.
        peer: PeerName,
        /// Why it was refused.
        reason: String,
    },
    /// The connection closed or broke in the middle of the greeting, before either side found
    /// anything wrong: a listener closing its oldest unfinished greetings under a flood, or a
    /// peer going away. Dialling again may succeed.
    #[error("{peer} closed the connection during the handshake: {reason}")]
    GreetingCut {
        /// The peer.
        peer: PeerName,
        /// What the socket said.
        reason: String,
    },
    /// A peer sent bytes that are not a valid frame.
    #[error("malformed frame from {peer}: {source}")]
    Decode {
        /// The peer.
        peer: PeerName,
        /// What was wrong.
        source: DecodeError,
    },
    /// A peer closed the connection (or it broke) unexpectedly.
    #[error("{peer} closed the connection: {reason}")]
    PeerClosed {
        /// The peer.
        peer: PeerName,
        /// What the socket said.
        reason: String,
    },
    /// A record on a private link failed authentication: forged, replayed, reordered or corrupted
    /// on the way. The link is closed; nothing of the record was used.
    #[error("the link from {peer} was tampered with: {reason}; the link is closed")]
    Forged {
        /// The peer the link goes to.
        peer: PeerName,
        /// What the check found.
        reason: String,
    },
    /// A peer sent nothing, not even heartbeats, for too long.
    #[error("{peer} has been silent for {silent_for:?} (no heartbeat); presumed dead")]
    PeerSilent {
        /// The peer.
        peer: PeerName,
        /// How long it was silent.
        silent_for: Duration,
    },
    /// A wait for a message ran out.
    #[error("timed out after {waited:?} waiting for {what} from {from}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// Whom it was awaited from.
        from: String,
        /// How long.
        waited: Duration,
    },
    /// Rendezvous ran out of time with ranks missing. `refused` lists the connections that
    /// failed the handshake meanwhile, with why: the usual cause of a missing rank is a node
    /// started with another shared secret.
    #[error(
        "timed out after {waited:?} waiting for registration from ranks {missing:?}{}",
        refused_note(refused)
    )]
    RendezvousIncomplete {
        /// Ranks that never registered.
        missing: Vec<u32>,
        /// How long rank 0 waited.
        waited: Duration,
        /// Connections refused while waiting (a count and the last few reasons).
        refused: Refusals,
    },
    /// A node's links did not all come up in time. `refused` lists the connections its
    /// listener refused meanwhile: a missing peer is usually one whose greeting was refused
    /// (another secret, `--insecure-plaintext` on one side only).
    #[error(
        "timed out after {waited:?} waiting for a connection from ranks {missing:?}{}",
        refused_note(refused)
    )]
    LinksIncomplete {
        /// Ranks that never connected.
        missing: Vec<u32>,
        /// How long this node waited.
        waited: Duration,
        /// Connections refused while waiting.
        refused: Refusals,
    },
    /// The peer refused this node, and said why (a rank already taken, a world size of its
    /// own): this node cannot take part in the run as started.
    #[error("{peer} refused this node: {reason}")]
    RefusedBy {
        /// The peer that refused.
        peer: PeerName,
        /// Its reason.
        reason: String,
    },
    /// The node that keeps the run's steps waited longer than its step bound
    /// ([`crate::progress`]): the run makes no progress, though every link is alive.
    #[error(
        "no step completed for {:.1} s: rank {rank} waited {:.1} s for {waiting_for} (the bound: \
         {why})",
        since_step.as_secs_f64(),
        waited.as_secs_f64()
    )]
    NoProgress {
        /// The node that keeps the steps.
        rank: u32,
        /// Time since the last step.
        since_step: Duration,
        /// How long this receive waited.
        waited: Duration,
        /// What it waited for.
        waiting_for: String,
        /// How the bound was derived.
        why: String,
    },
    /// Another node aborted the run.
    #[error("rank {origin} aborted the run: {reason}")]
    Aborted {
        /// Node that failed first.
        origin: u32,
        /// Its reason.
        reason: String,
    },
    /// A link failed while this node was waiting for something; says what.
    // `cause` is shown inline rather than as the error's source, so a printed chain does not
    // repeat it.
    #[error("{cause} (while waiting for {waiting_for})")]
    WhileWaiting {
        /// What the node was waiting for, e.g. `a message from rank 2 (127.0.0.1:4100)`.
        waiting_for: String,
        /// The failure.
        cause: Box<TransportError>,
    },
    /// A message for a rank this node has no link to.
    #[error("no link to rank {0}")]
    NoLink(u32),
    /// Any other I/O failure.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Cause.
        source: std::io::Error,
    },
}

impl TransportError {
    /// This failure of a greeting with a peer this node dialled as `rank` (from the address
    /// table, which is authenticated), named so: a dialled peer is known by the rank whose
    /// address it holds, even before its proof.
    pub fn dialled_as(self, rank: u32) -> Self {
        let name = |mut peer: PeerName| {
            peer.rank.get_or_insert(rank);
            peer
        };
        match self {
            Self::Handshake { peer, reason } => Self::Handshake {
                peer: name(peer),
                reason,
            },
            Self::GreetingCut { peer, reason } => Self::GreetingCut {
                peer: name(peer),
                reason,
            },
            other => other,
        }
    }

    /// The failure itself, without the [`TransportError::WhileWaiting`] that says what the node
    /// was waiting for when it came.
    pub fn root(&self) -> &TransportError {
        match self {
            Self::WhileWaiting { cause, .. } => cause.root(),
            other => other,
        }
    }

    /// The rank of the peer this failure says is gone (closed, broken or silent), if it names
    /// one: what a strategy that survives dead peers checks to decide whom to drop.
    pub fn failed_peer(&self) -> Option<u32> {
        match self {
            Self::WhileWaiting { cause, .. } => cause.failed_peer(),
            Self::PeerClosed { peer, .. } | Self::PeerSilent { peer, .. } => peer.rank,
            _ => None,
        }
    }
}

fn refused_note(refused: &Refusals) -> String {
    if refused.is_empty() {
        return String::new();
    }
    // Each refusal says why (a wrong secret says which settings to compare).
    format!("; meanwhile {refused}")
}
