//! Recycled payload buffers, shared by a node's compute thread and its links' I/O tasks.
//!
//! A parameter-server iteration moves shard-sized payloads (12 MB for `mlp`) several times per
//! worker. Allocated fresh each time, every one is a new mapping that the kernel zeroes and faults
//! in page by page: with glibc that was a fifth of the whole run's CPU time
//! (docs/BENCHMARKS.md). Here the reader takes its payload buffer from the pool, the writer
//! returns a sent
//! payload to it, and the node returns a received payload once it has read it, so in steady state
//! no large buffer is allocated at all.
//!
//! Invariants: only buffers of at least [`MIN_POOLED_BYTES`] capacity are kept (smaller ones are
//! cheap from the allocator's own free lists), at most [`MAX_POOLED`] of them, and none larger
//! than twice the largest of the last [`DEMAND_WINDOW`] requests: the pool holds what a node's
//! steady state reuses, not the leftovers of a burst of large messages (a ring master's
//! evaluation chunks, say) that nothing will ask for again. A taken buffer is empty.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Smallest capacity worth keeping.
pub const MIN_POOLED_BYTES: usize = 1 << 20;
/// Most buffers kept.
pub const MAX_POOLED: usize = 8;
/// Requests that define the current demand.
pub const DEMAND_WINDOW: usize = 16;

#[derive(Debug, Default)]
struct Inner {
    free: Vec<Vec<u8>>,
    /// Sizes of the latest pooled-size requests.
    recent: VecDeque<usize>,
}

impl Inner {
    /// Largest buffer worth keeping now.
    fn keep_limit(&self) -> usize {
        2 * self.recent.iter().copied().max().unwrap_or(0)
    }
}

/// A shared pool of large byte buffers (cheap to clone: clones share the pool).
#[derive(Clone, Debug, Default)]
pub struct BufferPool {
    inner: Arc<Mutex<Inner>>,
}

impl BufferPool {
    /// An empty buffer with capacity for `len` bytes: the smallest pooled one that fits, or a new
    /// one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= MIN_POOLED_BYTES
            && let Ok(mut inner) = self.inner.lock()
        {
            if inner.recent.len() == DEMAND_WINDOW {
                inner.recent.pop_front();
            }
            inner.recent.push_back(len);
            let limit = inner.keep_limit();
            inner.free.retain(|b| b.capacity() <= limit);
            if let Some(best) = inner
                .free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
            {
                let mut buf = inner.free.swap_remove(best);
                buf.clear();
                return buf;
            }
        }
        Vec::with_capacity(len)
    }

    /// Gives a buffer back for reuse. Kept only if large and no larger than the current demand
    /// warrants; when the pool is full it replaces the smallest kept buffer if it is larger.
    pub fn give(&self, buf: Vec<u8>) {
        if buf.capacity() < MIN_POOLED_BYTES {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if buf.capacity() > inner.keep_limit() {
            return;
        }
        if inner.free.len() < MAX_POOLED {
            inner.free.push(buf);
        } else if let Some((i, _)) = inner
            .free
            .iter()
            .enumerate()
            .min_by_key(|(_, b)| b.capacity())
            .filter(|(_, b)| b.capacity() < buf.capacity())
        {
            inner.free[i] = buf;
        }
    }

    /// Buffers kept and their total capacity in bytes.
    pub fn held(&self) -> (usize, usize) {
        self.inner
            .lock()
            .map(|i| (i.free.len(), i.free.iter().map(Vec::capacity).sum()))
            .unwrap_or((0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn large_buffers_come_back_and_small_ones_are_not_kept() {
        let pool = BufferPool::default();
        let mut big = pool.take(2 * MIB);
        big.extend_from_slice(&[7; 100]);
        let address = big.as_ptr();
        pool.give(big);
        pool.give(Vec::with_capacity(1000));
        assert_eq!(pool.held(), (1, 2 * MIB));
        // Reused, and empty.
        let again = pool.take(MIB);
        assert_eq!((again.as_ptr(), again.len()), (address, 0));
        assert_eq!(pool.held(), (0, 0));
        // Too small a request for the pool: a fresh buffer.
        assert!(pool.take(10).capacity() >= 10);
    }

    #[test]
    fn the_smallest_buffer_that_fits_is_taken_and_the_pool_is_bounded() {
        let pool = BufferPool::default();
        let _ = pool.take(10 * MIB); // demand: buffers up to 20 MiB are worth keeping
        for mb in 1..=MAX_POOLED + 2 {
            pool.give(Vec::with_capacity(mb * MIB));
        }
        let (count, bytes) = pool.held();
        assert_eq!(count, MAX_POOLED);
        // The two smallest (1 and 2 MiB) were replaced by larger ones.
        assert_eq!(
            bytes,
            (3..=MAX_POOLED + 2).map(|mb| mb * MIB).sum::<usize>()
        );
        assert_eq!(pool.take(4 * MIB).capacity(), 4 * MIB);
        assert_eq!(pool.take(4 * MIB + 1).capacity(), 5 * MIB);
    }

    /// A burst of large messages nobody asks for again is not kept, and what a past burst left
    /// goes once demand has moved on.
    #[test]
    fn buffers_beyond_the_current_demand_are_not_kept() {
        let pool = BufferPool::default();
        let _ = pool.take(MIB);
        pool.give(Vec::with_capacity(16 * MIB));
        assert_eq!(pool.held(), (0, 0));
        let _ = pool.take(16 * MIB);
        pool.give(Vec::with_capacity(16 * MIB));
        assert_eq!(pool.held(), (1, 16 * MIB));
        for _ in 0..DEMAND_WINDOW {
            let small = pool.take(MIB);
            pool.give(small);
        }
        assert_eq!(pool.held(), (1, MIB));
    }
}
