//! `ringtmp-data`: dataset readers, checksums, deterministic shuffling, batching and sharding. No
//! networking and no async: a strategy asks for a batch of example indices and gathers the
//! normalised rows itself.
//!
//! # Layout
//! - [`idx`]: bounded IDX reader (raw or gzip) with offset-precise errors.
//! - [`dataset`]: MNIST, Fashion-MNIST and scikit-learn's digits; where they are searched; checksum
//!   verification; normalisation.
//! - [`source`]: a user's own dataset described once ([`DataSource`]) in NumPy (`arrays`), CSV
//!   (`table`), image-folder (`folder`) or CIFAR binary (`cifar`) form; [`npy`] reads and writes
//!   NumPy's files.
//! - [`rows`]: fixed-size examples stored as rows (in memory or memory-mapped), normalised per
//!   channel when a batch gathers them; [`recipe`]: how a raw example becomes the model's input.
//! - [`sampler`]: per-epoch permutations, mini-batches and shards.
//! - [`text`]: text for language models: character vocabularies, pre-tokenised `.bin` files,
//!   windows of next-token pairs drawn by a seeded sampler, a fixed validation set.

mod arrays;
mod cifar;
pub mod dataset;
pub mod description;
mod error;
mod folder;
pub mod idx;
pub mod npy;
pub mod predict;
pub mod recipe;
pub mod rows;
pub mod sampler;
pub mod source;
mod table;
pub mod text;

pub use dataset::{
    DATASETS, Dataset, FileCheck, Split, Task, TextOptions, load, load_text_dataset,
};
pub use description::{DataSource, FORMATS, Normalize};
pub use error::{Error, Result};
pub use predict::{Inputs, read_inputs};
pub use recipe::{InputRecipe, InputShape, Layout};
pub use rows::{Labels, Normalisation};
pub use sampler::{BatchPlan, epoch_permutation, shard};
pub use source::load_source;
pub use text::{TextCorpus, TextTokenizer, Tokens, Vocabulary};
