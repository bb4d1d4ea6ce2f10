//! What reaches a parameter server ([`Input`], decoded from the links), what it asks to be
//! done ([`Output`]), and whether a lost link ends the run ([`Lost`]): the vocabulary of the
//! server's machine, shared by its parts.

use ringtmp_transport::Transport;
use ringtmp_wire::{Control, Message, TensorHeader, TensorTag};

use crate::driver::PsMessage;
use ringtmp_contract::error::Result;
use ringtmp_contract::messages::StrategyMessage;

/// What reached a server, decoded (ranks are the senders').
#[derive(Debug)]
pub enum Input {
    /// Worker `from` asks for the shard for its iteration `clock`.
    Pull {
        /// The sender.
        from: u32,
        /// Its pushes so far.
        clock: u64,
    },
    /// Worker `from`'s gradient of unit `header.micro_batch`.
    Push {
        /// The sender.
        from: u32,
        /// The tensor's header (its unit, dtype and count).
        header: TensorHeader,
        /// Its payload.
        bytes: Vec<u8>,
    },
    /// Worker `from` has finished.
    Finished {
        /// The sender.
        from: u32,
    },
    /// Server 0 to this one: `worker` was given `unit`; every unit below `settled` is pushed.
    Grant {
        /// The sender.
        from: u32,
        /// The worker given the unit.
        worker: u32,
        /// The unit.
        unit: u64,
        /// The settled mark.
        settled: u64,
    },
    /// Server `from`'s share of a clipped BSP iteration's squared gradient norm.
    GradNorm {
        /// The sender.
        from: u32,
        /// The global iteration.
        iteration: u64,
        /// The share.
        squared: f64,
    },
    /// Server `from`'s checkpoint file entry for `step` (server 0 collects them).
    Checkpoint {
        /// The sender.
        from: u32,
        /// The checkpoint's step.
        step: u64,
        /// The entry (one file, JSON).
        files: Vec<String>,
    },
    /// End-of-run reports (JSON) from rank `from`.
    Report {
        /// The sender.
        from: u32,
        /// The reports.
        nodes: Vec<String>,
    },
    /// Anything else: never part of a server's protocol.
    Unexpected {
        /// The sender.
        from: u32,
        /// What it was.
        what: String,
    },
}

impl Input {
    /// `message` from rank `from`, decoded (a strategy message that does not decode is the
    /// link's protocol error, named with the peer).
    pub fn decode(from: u32, message: Message, net: &dyn Transport) -> Result<Self> {
        let own = match &message {
            Message::Control(control) => PsMessage::from_control(control, net, from)?,
            Message::Tensor(..) => None,
        };
        Ok(match (own, message) {
            (Some(PsMessage::Pull { clock }), _) => Self::Pull { from, clock },
            (Some(PsMessage::Finished { .. }), _) => Self::Finished { from },
            (
                Some(PsMessage::Grant {
                    worker,
                    unit,
                    settled,
                }),
                _,
            ) => Self::Grant {
                from,
                worker,
                unit,
                settled,
            },
            (
                Some(PsMessage::GradNorm {
                    iteration,
                    squared_bits,
                }),
                _,
            ) => Self::GradNorm {
                from,
                iteration,
                squared: f64::from_bits(squared_bits),
            },
            (None, Message::Tensor(header, bytes)) if header.tag == TensorTag::ParamGrads => {
                Self::Push {
                    from,
                    header,
                    bytes,
                }
            }
            (None, Message::Control(Control::Report { nodes })) => Self::Report { from, nodes },
            (None, Message::Control(Control::Checkpoint { step, files })) => {
                Self::Checkpoint { from, step, files }
            }
            (None, Message::Control(c)) => Self::Unexpected {
                from,
                what: format!("{c:?}"),
            },
            (None, Message::Tensor(h, _)) => Self::Unexpected {
                from,
                what: format!("{:?} tensor for step {}", h.tag, h.step),
            },
        })
    }
}

impl Input {
    /// The sender's rank.
    pub fn sender(&self) -> u32 {
        match self {
            Self::Pull { from, .. }
            | Self::Push { from, .. }
            | Self::Finished { from }
            | Self::Grant { from, .. }
            | Self::GradNorm { from, .. }
            | Self::Checkpoint { from, .. }
            | Self::Report { from, .. }
            | Self::Unexpected { from, .. } => *from,
        }
    }
}

/// What a server asks to be done, in order.
#[derive(Debug)]
pub enum Output {
    /// This server's shard, as it is when carried out, to worker `worker` for its iteration
    /// `clock` with its next `unit` of work.
    Shard {
        /// Worker index (rank `servers + worker`).
        worker: usize,
        /// The worker's iteration.
        clock: u64,
        /// Its next unit (server 0's assignment; 0 from the others).
        unit: u64,
    },
    /// A message to rank `to`.
    Send {
        /// The receiver.
        to: u32,
        /// The message.
        message: Message,
    },
    /// A received payload the server is done with (back to the link's buffer pool).
    Recycle(Vec<u8>),
    /// Server 0 applied a global iteration (the run's step count, for the network's clock).
    StepDone,
}

/// Whether a lost link ends the run.
#[derive(Debug, PartialEq, Eq)]
pub enum Lost {
    /// A worker dropped (or one that had already finished or been dropped): the run goes on.
    Tolerated,
    /// Not a worker the consistency model may lose: the run ends with the link's error.
    Fatal,
}
