//! The all-reduce strategy's job and options: what `ringtmp train --strategy allreduce` takes,
//! and what every worker runs.

use serde::{Deserialize, Serialize};

use ringtmp_contract::options_merge;
use ringtmp_contract::spec::RunSpec;

/// `--strategy` name.
pub const NAME: &str = "allreduce";

pub use ringtmp_collective::reduce::DEFAULT_BUCKET_MB;

/// `ringtmp train --strategy allreduce` options (flags, and keys of a `--config` file).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(rename_all = "kebab-case")]
pub struct AllReduceOptions {
    /// All-reduce: MB of gradients per bucket, reduced while backward goes on [default: 25].
    #[cfg_attr(feature = "cli", arg(long, value_name = "MB"))]
    pub bucket_mb: Option<f64>,
    /// All-reduce: overlap the reduction with the backward pass [default: true].
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub overlap: Option<bool>,
}

options_merge!(AllReduceOptions, bucket_mb, overlap);

/// The all-reduce strategy's job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllReduceJob {
    /// What every job shares; `batch_size` is one worker's share of each global batch.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Workers (every node is one).
    pub workers: usize,
    /// Bytes of gradients per bucket.
    pub bucket_bytes: usize,
    /// Whether buckets are reduced during the backward pass (else after it).
    pub overlap: bool,
    /// Emulated relative speed per rank.
    pub node_speeds: Vec<f64>,
}
