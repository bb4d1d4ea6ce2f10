//! Deterministic example order: shuffling by seed and epoch, fixed-size mini-batches, and sharding
//! a mini-batch across data-parallel ranks.
//!
//! The permutation of epoch `e` is a Fisher–Yates shuffle driven by ChaCha8 seeded with the run
//! seed on stream `e`, so every process derives the same order without communicating, and a
//! resumed run derives it again from `(seed, epoch)`. The last partial mini-batch of an epoch is
//! dropped so every optimizer step sees exactly `batch` examples (each epoch reshuffles, so no
//! example is systematically left out).
//!
//! Sharding splits each global mini-batch into `world` contiguous parts: W workers with batch b
//! together see exactly the examples of one batch of W·b, the precondition for comparing
//! synchronous data-parallel training with large-batch SGD.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// Mini-batches of one dataset for a run.
#[derive(Clone, Debug)]
pub struct BatchPlan {
    examples: usize,
    batch: usize,
    seed: u64,
    epoch: u64,
    order: Vec<u32>,
}

impl BatchPlan {
    /// A plan over `examples` examples in mini-batches of `batch`.
    pub fn new(examples: usize, batch: usize, seed: u64) -> Result<Self> {
        if batch == 0 {
            return Err(Error::Batching("the batch size must be at least 1".into()));
        }
        if batch > examples {
            return Err(Error::Batching(format!(
                "batch size {batch} exceeds the {examples} training examples"
            )));
        }
        let mut plan = Self {
            examples,
            batch,
            seed,
            epoch: 0,
            order: Vec::new(),
        };
        plan.order = epoch_permutation(examples, seed, 0);
        Ok(plan)
    }

    /// Mini-batches per epoch (the last partial one is dropped).
    pub fn batches_per_epoch(&self) -> usize {
        self.examples / self.batch
    }

    /// The mini-batch size.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Example indices of mini-batch `index` of `epoch`.
    ///
    /// # Panics
    /// If `index >= batches_per_epoch()`.
    pub fn batch(&mut self, epoch: u64, index: usize) -> &[u32] {
        assert!(
            index < self.batches_per_epoch(),
            "batch {index} out of range"
        );
        if epoch != self.epoch {
            self.order = epoch_permutation(self.examples, self.seed, epoch);
            self.epoch = epoch;
        }
        &self.order[index * self.batch..(index + 1) * self.batch]
    }
}

/// The order of `n` examples in `epoch` for `seed`.
pub fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch);
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        // Lemire's multiply-shift: unbiased enough for n ≪ 2³² and identical on every platform.
        let j = ((u64::from(rng.next_u32()) * (i as u64 + 1)) >> 32) as usize;
        order.swap(i, j);
    }
    order
}

/// The part of a mini-batch that `rank` of `world` processes: contiguous, sizes differing by at
/// most one.
pub fn shard(batch: &[u32], rank: usize, world: usize) -> Result<&[u32]> {
    if world == 0 || rank >= world {
        return Err(Error::Batching(format!(
            "rank {rank} is outside a world of {world}"
        )));
    }
    if batch.len() < world {
        return Err(Error::Batching(format!(
            "a batch of {} cannot be split over {world} ranks",
            batch.len()
        )));
    }
    let (base, extra) = (batch.len() / world, batch.len() % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    Ok(&batch[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_deterministic_and_differs_by_epoch() {
        let a = epoch_permutation(1000, 5, 0);
        assert_eq!(a, epoch_permutation(1000, 5, 0));
        assert_ne!(a, epoch_permutation(1000, 5, 1));
        assert_ne!(a, epoch_permutation(1000, 6, 0));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn plan_drops_the_partial_batch() {
        let mut p = BatchPlan::new(10, 3, 1).unwrap();
        assert_eq!(p.batches_per_epoch(), 3);
        let seen: Vec<u32> = (0..3).flat_map(|i| p.batch(0, i).to_vec()).collect();
        assert_eq!(seen, epoch_permutation(10, 1, 0)[..9]);
        assert!(BatchPlan::new(10, 0, 1).is_err());
        assert!(BatchPlan::new(10, 11, 1).is_err());
    }

    #[test]
    fn shards_partition_the_batch() {
        let batch: Vec<u32> = (0..10).collect();
        let parts: Vec<&[u32]> = (0..4).map(|r| shard(&batch, r, 4).unwrap()).collect();
        assert_eq!(parts, [&[0, 1, 2][..], &[3, 4, 5], &[6, 7], &[8, 9]]);
        assert!(shard(&batch, 4, 4).is_err());
        assert!(shard(&batch[..2], 0, 4).is_err());
    }
}
