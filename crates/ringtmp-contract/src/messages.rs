//! A strategy's own wire messages: each strategy declares them as an enum in its folder and
//! implements [`StrategyMessage`]; they travel as [`Control::Strategy`], tagged with the
//! strategy's name and encoded with postcard, so a new strategy's messages touch neither the
//! wire crate nor the protocol version of the others.
//!
//! Invariant: decoding is bounded (the frame already is) and never panics; a message of another
//! strategy, or one that does not decode, is a protocol error naming the sender.

use ringtmp_transport::Transport;
use ringtmp_wire::{Control, Message};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// A strategy's enum of messages.
pub trait StrategyMessage: Serialize + DeserializeOwned {
    /// The strategy's `--strategy` name, which tags its messages.
    const STRATEGY: &'static str;

    /// The message's kind (its variant's name): what descriptions, errors and fault triggers
    /// name it by.
    fn kind(&self) -> &'static str;

    /// As a frame.
    fn to_message(&self) -> Message {
        Message::Control(Control::Strategy {
            strategy: Self::STRATEGY.into(),
            kind: self.kind().into(),
            payload: postcard::to_allocvec(self).expect("strategy messages always serialise"),
        })
    }

    /// This strategy's message in `control`, if it is one: `None` for any other control
    /// message; an error for another strategy's message or one that does not decode, naming
    /// `from`.
    fn from_control(control: &Control, net: &dyn Transport, from: u32) -> Result<Option<Self>> {
        let Control::Strategy {
            strategy, payload, ..
        } = control
        else {
            return Ok(None);
        };
        if strategy != Self::STRATEGY {
            return Err(Error::protocol(
                Self::STRATEGY,
                net,
                from,
                &format!("message of strategy {strategy:?}"),
            ));
        }
        postcard::from_bytes(payload).map(Some).map_err(|e| {
            Error::protocol(
                Self::STRATEGY,
                net,
                from,
                &format!("message that does not decode ({e})"),
            )
        })
    }
}
