//! The one error type of `ringtmp-data`: every variant names the file and, for format errors, the
//! byte offset (in the decompressed stream) where reading went wrong.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while finding, reading or batching a dataset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file's content is not what its format promises.
    #[error("{path}: at byte {offset}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// Offset in the (decompressed) content where the problem was found.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
    /// Two files of one dataset disagree (e.g. image and label counts).
    #[error("dataset {dataset}: {reason}")]
    Inconsistent {
        /// Dataset name.
        dataset: String,
        /// What disagrees.
        reason: String,
    },
    /// The dataset's files were not found anywhere searched.
    #[error("dataset {dataset}: {file} not found; searched {searched}{hint}")]
    NotFound {
        /// Dataset name.
        dataset: String,
        /// The missing files (or the missing directory).
        file: String,
        /// The directories searched, in order.
        searched: String,
        /// Where to get the files (empty, or starting with `; `).
        hint: String,
    },
    /// A table's cell (or row) is not what the dataset description asks for.
    #[error("{path}: row {row}{column}: {reason}")]
    Table {
        /// The file.
        path: PathBuf,
        /// 1-based row of data (the header is row 0).
        row: u64,
        /// `, column "name"`, or empty when the whole row is wrong.
        column: String,
        /// What was wrong.
        reason: String,
    },
    /// A dataset description that cannot be read as given (missing files, conflicting options).
    #[error("dataset {dataset}: {reason}")]
    Description {
        /// The format or dataset named.
        dataset: String,
        /// What is wrong with the description.
        reason: String,
    },
    /// The dataset name is not one ringtmp knows.
    #[error(
        "unknown dataset {0:?}; known datasets are mnist, fashion-mnist, digits, text, and the \
         formats npy, npz, csv, images, cifar10, cifar100"
    )]
    UnknownDataset(String),
    /// A batching or sharding request that cannot be satisfied.
    #[error("{0}")]
    Batching(String),
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}
