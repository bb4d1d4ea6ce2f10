//! Recycled payload buffers, shared by a node's compute thread and its links' I/O tasks.
//!
//! A parameter-server iteration moves shard-sized payloads (12 MB for `mlp`) several times per
//! worker. Allocated fresh each time, every one is a new mapping that the kernel zeroes and faults
//! in page by page: with glibc that was a fifth of the whole run's CPU time (docs/BENCHMARKS.md,
//! issue 5). Here the reader takes its payload buffer from the pool, the writer returns a sent
//! payload to it, and the node returns a received payload once it has read it, so in steady state
//! no large buffer is allocated at all.
//!
//! Invariants: only buffers of at least [`MIN_POOLED_BYTES`] capacity are kept (smaller ones are
//! cheap from the allocator's own free lists), at most [`MAX_POOLED`] of them, so the pool holds
//! at most what a node's steady state already used; a taken buffer is empty.

use std::sync::{Arc, Mutex};

/// Smallest capacity worth keeping.
pub const MIN_POOLED_BYTES: usize = 1 << 20;
/// Most buffers kept.
pub const MAX_POOLED: usize = 8;

/// A shared pool of large byte buffers (cheap to clone: clones share the pool).
#[derive(Clone, Debug, Default)]
pub struct BufferPool {
    free: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl BufferPool {
    /// An empty buffer with capacity for `len` bytes: the smallest pooled one that fits, or a new
    /// one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= MIN_POOLED_BYTES
            && let Ok(mut free) = self.free.lock()
            && let Some(best) = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
        {
            let mut buf = free.swap_remove(best);
            buf.clear();
            return buf;
        }
        Vec::with_capacity(len)
    }

    /// Gives a buffer back for reuse (kept only if large; when the pool is full it replaces the
    /// smallest kept buffer if it is larger).
    pub fn give(&self, buf: Vec<u8>) {
        if buf.capacity() < MIN_POOLED_BYTES {
            return;
        }
        let Ok(mut free) = self.free.lock() else {
            return;
        };
        if free.len() < MAX_POOLED {
            free.push(buf);
        } else if let Some((i, _)) = free
            .iter()
            .enumerate()
            .min_by_key(|(_, b)| b.capacity())
            .filter(|(_, b)| b.capacity() < buf.capacity())
        {
            free[i] = buf;
        }
    }

    /// Buffers kept and their total capacity in bytes.
    pub fn held(&self) -> (usize, usize) {
        self.free
            .lock()
            .map(|f| (f.len(), f.iter().map(Vec::capacity).sum()))
            .unwrap_or((0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_and_small_ones_are_not_kept() {
        let pool = BufferPool::default();
        let mut big = pool.take(2 << 20);
        big.extend_from_slice(&[7; 100]);
        let address = big.as_ptr();
        pool.give(big);
        pool.give(Vec::with_capacity(1000));
        assert_eq!(pool.held(), (1, 2 << 20));
        // Reused, and empty.
        let again = pool.take(1 << 20);
        assert_eq!((again.as_ptr(), again.len()), (address, 0));
        assert_eq!(pool.held(), (0, 0));
        // Too small a request for the pool: a fresh buffer.
        assert!(pool.take(10).capacity() >= 10);
    }

    #[test]
    fn the_smallest_buffer_that_fits_is_taken_and_the_pool_is_bounded() {
        let pool = BufferPool::default();
        for mb in 1..=MAX_POOLED + 2 {
            pool.give(Vec::with_capacity(mb << 20));
        }
        let (count, bytes) = pool.held();
        assert_eq!(count, MAX_POOLED);
        // The two smallest (1 and 2 MiB) were replaced by larger ones.
        assert_eq!(
            bytes,
            (3..=MAX_POOLED + 2).map(|mb| mb << 20).sum::<usize>()
        );
        assert_eq!(pool.take(4 << 20).capacity(), 4 << 20);
        assert_eq!(pool.take((4 << 20) + 1).capacity(), 5 << 20);
    }
}
