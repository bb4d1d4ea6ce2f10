//! The bandwidth-optimal ring all-reduce as a pure plan (Patarasuk and Yuan, 2009; Gloo's and
//! NCCL's ring): a buffer is cut into N near-equal chunks; in N − 1 reduce-scatter steps each
//! worker sends one chunk to its successor and adds the chunk it receives from its predecessor,
//! after which worker r holds the complete sum of chunk r + 1; in N − 1 all-gather steps the
//! complete chunks travel once more around the ring. Every worker sends 2(N − 1)/N of the buffer.
//!
//! Invariants (tested below): every chunk's sum is accumulated in one fixed order (starting at
//! the worker whose index is the chunk's, going round), so the result is reproducible; after the
//! all-gather every worker holds the same bits; any length works, also one not divisible by N
//! (chunks differ by at most one element) and one shorter than N (some chunks are empty).

use std::ops::Range;

/// The chunks of a buffer of `len` values over `n` workers: near-equal, in order.
pub fn chunks(len: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let (base, extra) = (len / n, len % n);
    let mut at = 0;
    (0..n)
        .map(|c| {
            let size = base + usize::from(c < extra);
            let r = at..at + size;
            at += size;
            r
        })
        .collect()
}

/// What worker `rank` of `n` does at each of the 2(n − 1) steps of one all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingPlan {
    /// This worker.
    pub rank: usize,
    /// Workers in the ring.
    pub n: usize,
}

impl RingPlan {
    /// Steps of one all-reduce: reduce-scatter then all-gather.
    pub fn steps(&self) -> usize {
        2 * (self.n - 1)
    }

    /// The chunk sent to the successor at step `s`.
    pub fn send_chunk(&self, s: usize) -> usize {
        let (r, n) = (self.rank, self.n);
        if s < n - 1 {
            (r + n - s) % n
        } else {
            (r + 1 + n - (s - (n - 1))) % n
        }
    }

    /// The chunk received from the predecessor at step `s`.
    pub fn recv_chunk(&self, s: usize) -> usize {
        let (r, n) = (self.rank, self.n);
        if s < n - 1 {
            (r + 2 * n - s - 1) % n
        } else {
            (r + n - (s - (n - 1))) % n
        }
    }

    /// Whether the chunk received at step `s` is added (reduce-scatter) or replaces the local
    /// one (all-gather).
    pub fn adds(&self, s: usize) -> bool {
        s < self.n - 1
    }
}

/// All-reduces `buffers` (one per worker) in memory by the plan, step by step as the ring would:
/// the reference the distributed runs are tested against.
pub fn simulate(buffers: &mut [Vec<f32>]) {
    let n = buffers.len();
    if n < 2 {
        return;
    }
    let parts = chunks(buffers[0].len(), n);
    for s in 0..2 * (n - 1) {
        // Every worker sends first, then every worker receives: one synchronous step.
        let sent: Vec<Vec<f32>> = (0..n)
            .map(|r| buffers[r][parts[RingPlan { rank: r, n }.send_chunk(s)].clone()].to_vec())
            .collect();
        for (r, buffer) in buffers.iter_mut().enumerate() {
            let plan = RingPlan { rank: r, n };
            let c = plan.recv_chunk(s);
            let from = &sent[(r + n - 1) % n];
            let target = &mut buffer[parts[c].clone()];
            if plan.adds(s) {
                target.iter_mut().zip(from).for_each(|(t, v)| *t += v);
            } else {
                target.copy_from_slice(from);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_any_length_nearly_equally() {
        for (len, n) in [(10, 3), (3, 4), (0, 2), (12, 4), (7, 7), (1000, 6)] {
            let c = chunks(len, n);
            assert_eq!(c.len(), n);
            assert_eq!(c.first().map(|r| r.start), Some(0));
            assert_eq!(c.last().map(|r| r.end), Some(len));
            assert!(c.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = c.iter().map(|r| r.len()).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
        }
    }

    #[test]
    fn what_one_worker_sends_its_successor_receives() {
        for n in 2..9 {
            for r in 0..n {
                let me = RingPlan { rank: r, n };
                let succ = RingPlan {
                    rank: (r + 1) % n,
                    n,
                };
                for s in 0..me.steps() {
                    assert_eq!(
                        me.send_chunk(s),
                        succ.recv_chunk(s),
                        "n {n} rank {r} step {s}"
                    );
                    if s > 0 {
                        // What a worker sends is what it has just received (and combined).
                        assert_eq!(me.send_chunk(s), me.recv_chunk(s - 1));
                    }
                }
            }
        }
    }

    #[test]
    fn all_reduce_equals_the_sum_on_every_worker_in_the_same_bits() {
        // Ref: the oracle "all-reduce == sum".
        for (n, len) in [(2, 5), (3, 10), (4, 3), (5, 1001), (8, 64)] {
            let original: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    (0..len)
                        .map(|i| ((r * 31 + i * 7) % 13) as f32 * 0.37 - 2.0)
                        .collect()
                })
                .collect();
            let mut buffers = original.clone();
            simulate(&mut buffers);
            let sum: Vec<f32> = (0..len)
                .map(|i| original.iter().map(|b| b[i]).sum())
                .collect();
            for b in &buffers {
                assert_eq!(b, &buffers[0], "every worker holds the same bits");
                for (x, y) in b.iter().zip(&sum) {
                    assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{x} vs {y}");
                }
            }
        }
    }
}
