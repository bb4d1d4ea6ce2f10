//! The one error type of `ringtmp-strategy`.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model could not be built, run or checkpointed.
    #[error(transparent)]
    Model(#[from] ringtmp_model::Error),
    /// The dataset could not be read or batched.
    #[error(transparent)]
    Data(#[from] ringtmp_data::Error),
    /// A link to another node failed.
    #[error(transparent)]
    Transport(#[from] ringtmp_transport::TransportError),
    /// The configuration is inconsistent (with itself, the dataset or a checkpoint).
    #[error("{0}")]
    Config(String),
    /// Writing an output file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Ring with stage replicas: the master re-formed the ring while this node was training; the
    /// node goes on in the new generation (not a failure: the healing loop takes it).
    #[error("the master re-formed the ring (generation {generation}) around a node that left")]
    Regroup {
        /// The new generation.
        generation: u64,
        /// Its members, physical ranks in ring order.
        members: Vec<u32>,
        /// The mini-batch it starts from.
        step: u64,
    },
    /// Training diverged (a non-finite loss).
    #[error("training diverged: the loss is {loss} at step {step}; lower the learning rate")]
    Diverged {
        /// Step at which the loss stopped being finite.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

impl Error {
    /// A peer sent `what`, which `strategy`'s protocol does not allow at this point: the error
    /// names the peer (a node never acts on a message it cannot place).
    pub fn protocol(
        strategy: &str,
        net: &dyn ringtmp_transport::Transport,
        from: u32,
        what: &str,
    ) -> Self {
        Self::Transport(ringtmp_transport::TransportError::Io {
            context: format!("{strategy}: unexpected {what} from {}", net.peer_name(from)),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not part of the protocol",
            ),
        })
    }

    /// Whether the error is the user's input (exit status 2) rather than a runtime failure.
    pub fn is_usage(&self) -> bool {
        match self {
            Self::Model(e) => e.is_usage(),
            Self::Data(_) | Self::Config(_) => true,
            Self::Io { .. } | Self::Diverged { .. } | Self::Transport(_) | Self::Regroup { .. } => {
                false
            }
        }
    }
}
