//! `ringtmp-data`: dataset readers, checksums, deterministic shuffling, batching and sharding. No
//! networking and no async: a strategy asks for a batch of example indices and gathers the
//! normalised rows itself.
//!
//! # Layout
//! - [`idx`]: bounded IDX reader (raw or gzip) with offset-precise errors.
//! - [`dataset`]: MNIST, Fashion-MNIST and scikit-learn's digits; where they are searched; checksum
//!   verification; normalisation.
//! - [`sampler`]: per-epoch permutations, mini-batches and shards.
//! - [`text`]: text for language models: character vocabularies, pre-tokenised `.bin` files,
//!   windows of next-token pairs drawn by a seeded sampler, a fixed validation set.

pub mod dataset;
mod error;
pub mod idx;
pub mod sampler;
pub mod text;

pub use dataset::{
    DATASETS, Dataset, FileCheck, Split, Task, TextOptions, load, load_text_dataset,
};
pub use error::{Error, Result};
pub use sampler::{BatchPlan, epoch_permutation, shard};
pub use text::{TextCorpus, TextTokenizer, Tokens, Vocabulary};
