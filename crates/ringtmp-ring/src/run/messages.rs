//! The ring's own wire messages (as [`StrategyMessage`]s), and a received message as a ring node
//! reads it: one of the ring's own, or anything else of the wire.

use ringtmp_transport::Transport;
use ringtmp_wire::{Control, Message};
use serde::{Deserialize, Serialize};

use ringtmp_contract::error::Result;
use ringtmp_contract::messages::StrategyMessage;

/// The ring's own wire messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RingMessage {
    /// Gradient clipping: the squared L2 norm of mini-batch `step`'s gradient summed over the
    /// sender's stage and every stage after it, travelling from the last stage back to the
    /// master (which adds its own and so holds the whole model's).
    GradNorm {
        /// The mini-batch.
        step: u64,
        /// The partial sum, as `f64::to_bits` (exact, and `Eq`).
        sum_squares_bits: u64,
    },
    /// Gradient clipping: the factor every stage multiplies mini-batch `step`'s gradient by
    /// before its update, travelling from the master around the ring.
    ClipScale {
        /// The mini-batch.
        step: u64,
        /// The factor, as `f32::to_bits`.
        factor_bits: u32,
    },
    /// Stage replicas: the master's order to take a replication round after mini-batch `step`,
    /// a node's token after its snapshot, and a node's word to the master that its successor's
    /// replica is in.
    Replicate {
        /// The mini-batch.
        step: u64,
    },
    /// Stage replicas: a survivor's marker to every other survivor that it runs the ring of
    /// `generation` (everything it sent before belongs to an older ring).
    Rejoined {
        /// The new ring's generation.
        generation: u64,
    },
}

impl StrategyMessage for RingMessage {
    const STRATEGY: &'static str = "ring";

    fn kind(&self) -> &'static str {
        match self {
            Self::GradNorm { .. } => "GradNorm",
            Self::ClipScale { .. } => "ClipScale",
            Self::Replicate { .. } => "Replicate",
            Self::Rejoined { .. } => "Rejoined",
        }
    }
}

impl RingMessage {
    /// The ring's message in `message`, if it is one that decodes, without naming a sender:
    /// for the views that sort messages before the ring's loops see them (which report what
    /// does not decode).
    pub fn peek(message: &Message) -> Option<Self> {
        match message {
            Message::Control(Control::Strategy {
                strategy, payload, ..
            }) if strategy == Self::STRATEGY => postcard::from_bytes(payload).ok(),
            _ => None,
        }
    }
}

/// A received message as a ring node reads it.
#[derive(Debug)]
pub enum Incoming {
    /// One of the ring's own.
    Own(RingMessage),
    /// Anything else of the wire.
    Wire(Message),
}

impl Incoming {
    /// `message` from `from`, sorted: another strategy's message, or one of the ring's that does
    /// not decode, is a protocol error naming `from`.
    pub fn read(message: Message, net: &dyn Transport, from: u32) -> Result<Self> {
        if let Message::Control(control) = &message
            && let Some(own) = RingMessage::from_control(control, net, from)?
        {
            return Ok(Self::Own(own));
        }
        Ok(Self::Wire(message))
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        match self {
            Self::Own(m) => format!("{m:?}"),
            Self::Wire(m) => m.describe(),
        }
    }
}
