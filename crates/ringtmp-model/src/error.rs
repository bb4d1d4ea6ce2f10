//! The one error type of `ringtmp-model`.
//!
//! Every variant carries enough context to say *what* was wrong and *where* (which layer, which
//! file, which key), because these errors reach users through the CLI unchanged.

use std::path::PathBuf;

use crate::shape::Shape;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while describing, building, running or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A checkpoint file's SHA-256 differs from the one recorded in its manifest.
    #[error("checkpoint file {path}: SHA-256 is {got} but the manifest records {expected}")]
    CheckpointHash {
        /// The file whose content changed.
        path: PathBuf,
        /// Hash recorded in the manifest.
        expected: String,
        /// Hash of the bytes on disk.
        got: String,
    },
    /// A checkpoint is readable but does not fit the model or run it is loaded into.
    #[error("checkpoint {path}: {reason}")]
    CheckpointMismatch {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What did not fit.
        reason: String,
    },
    /// A model description (preset, TOML file) is invalid.
    #[error("model description {source_name}: {reason}")]
    Config {
        /// Where the description came from (preset name or file path).
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A layer received an input whose shape it cannot handle.
    #[error("layer {index} ({kind}): {reason} (input shape {input})")]
    Shape {
        /// Index of the layer in the whole model.
        index: usize,
        /// Layer kind, e.g. `conv2d`.
        kind: &'static str,
        /// Per-sample input shape the layer was given.
        input: Shape,
        /// Why the shape does not work.
        reason: String,
    },
    /// A buffer passed to a stage has the wrong length.
    #[error("{what}: expected {expected} values, got {got}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Expected number of f32 values.
        expected: usize,
        /// Number of values given.
        got: usize,
    },
    /// A label outside `0..classes`.
    #[error("label {label} at row {row} is outside 0..{classes}")]
    Label {
        /// Row in the batch.
        row: usize,
        /// The label value.
        label: u32,
        /// Number of classes of the model.
        classes: usize,
    },
    /// `backward` was called for a micro-batch that has no stashed forward pass.
    #[error("stage {stage}: no forward pass stashed for micro-batch {micro_batch}")]
    UnknownMicroBatch {
        /// Index of the stage's first layer.
        stage: usize,
        /// The micro-batch id given.
        micro_batch: u64,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether the error is the user's input (exit status 2) rather than a runtime failure.
    pub fn is_usage(&self) -> bool {
        match self {
            // A file the user named that is not there, or a place they named that cannot be
            // read or written, is their input; other failures of the disk are not.
            Self::Io { source, .. } => is_the_users_path(source),
            Self::UnknownMicroBatch { .. } => false,
            _ => true,
        }
    }
}

/// Whether an I/O failure is about the path itself (missing, not permitted, of the wrong
/// kind, read-only) rather than the device.
pub fn is_the_users_path(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{
        IsADirectory, NotADirectory, NotFound, PermissionDenied, ReadOnlyFilesystem,
    };
    matches!(
        e.kind(),
        NotFound | PermissionDenied | IsADirectory | NotADirectory | ReadOnlyFilesystem
    )
}
