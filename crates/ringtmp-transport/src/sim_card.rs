//! The simulated network card of one node: its egress rate shared fairly by the links that have
//! bytes queued, each link a FIFO of messages — a fluid model of what the emulated card on real
//! links does ([`crate::shaper`]: the links' writers take turns in 64 KiB pieces) and of TCP flows
//! sharing a real card. While k links have something to send, each drains at rate / k.
//!
//! Why not whole messages in the order they were sent (the simulator's first model): a stage's
//! parameters on their way to a copy (rings of rings, the parameter server) would hold every
//! activation behind them for the whole transfer, where the real card lets the activation through
//! after one piece.
//!
//! Invariants (tested below): the card never sends faster than its rate, a link's messages finish
//! in the order they were queued, and queueing a message never makes another finish earlier.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// A message on the card: bits still to send, and the caller's handle for it.
#[derive(Clone, Debug)]
struct Flight {
    bits: f64,
    id: u64,
}

/// One node's card.
#[derive(Debug, Default)]
pub(crate) struct Card {
    /// Seconds (from the epoch) up to which the queues have drained.
    clock: f64,
    /// Queued messages per link (destination rank).
    queues: BTreeMap<u32, VecDeque<Flight>>,
}

impl Card {
    /// Drains the queues up to `now` at `bps` bits per second; returns the handles of the
    /// messages that finished.
    fn advance(&mut self, now: f64, bps: f64, done: &mut Vec<u64>) {
        while self.clock < now {
            let active = self.queues.len();
            if active == 0 {
                self.clock = now;
                break;
            }
            let share = bps / active as f64;
            let first = self
                .queues
                .values()
                .filter_map(|q| q.front())
                .map(|f| f.bits)
                .fold(f64::INFINITY, f64::min);
            let span = (first / share).min(now - self.clock);
            self.drain(span * share, done);
            self.clock += span;
        }
    }

    /// Sends `bits` from the head of every queue; drops (and reports) heads that are done.
    fn drain(&mut self, bits: f64, done: &mut Vec<u64>) {
        for queue in self.queues.values_mut() {
            if let Some(head) = queue.front_mut() {
                head.bits -= bits;
                // A head within a thousandth of a bit of its end is done (rounding).
                if head.bits <= 1e-3 {
                    done.push(head.id);
                    queue.pop_front();
                }
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
    }

    /// Queues a message of `bits` on the link to `to` at `now` (seconds), at `bps`. Returns the
    /// handles of the messages that finished before `now`, and when every queued message will
    /// finish if nothing else is queued — link by link, in queue order.
    pub(crate) fn send(
        &mut self,
        now: Duration,
        bps: f64,
        to: u32,
        bits: f64,
        id: u64,
    ) -> (Vec<u64>, Vec<(u32, u64, Duration)>) {
        let mut finished = Vec::new();
        let now = now.as_secs_f64().max(self.clock);
        self.advance(now, bps, &mut finished);
        self.queues
            .entry(to)
            .or_default()
            .push_back(Flight { bits, id });
        // Play the queues out on a copy.
        let mut ahead = Card {
            clock: self.clock,
            queues: self.queues.clone(),
        };
        let link_of: BTreeMap<u64, u32> = self
            .queues
            .iter()
            .flat_map(|(to, q)| q.iter().map(move |f| (f.id, *to)))
            .collect();
        let mut times = Vec::with_capacity(link_of.len());
        let mut done = Vec::new();
        while !ahead.queues.is_empty() {
            let before = done.len();
            let until = ahead.clock + ahead.horizon(bps);
            ahead.advance(until, bps, &mut done);
            for id in &done[before..] {
                times.push((link_of[id], *id, Duration::from_secs_f64(ahead.clock)));
            }
        }
        times.sort_by_key(|(to, _, at)| (*to, *at));
        (finished, times)
    }

    /// Seconds until the next head finishes at the current sharing.
    fn horizon(&self, bps: f64) -> f64 {
        let share = bps / self.queues.len().max(1) as f64;
        self.queues
            .values()
            .filter_map(|q| q.front())
            .map(|f| f.bits / share)
            .fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn one_link_sends_at_the_rate_in_order() {
        let mut card = Card::default();
        let (_, t) = card.send(Duration::ZERO, 1e6, 1, 1e6, 0);
        assert!((secs(t[0].2) - 1.0).abs() < 1e-9, "{t:?}");
        let (_, t) = card.send(Duration::ZERO, 1e6, 1, 5e5, 1);
        assert_eq!(t.len(), 2);
        assert!((secs(t[1].2) - 1.5).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn links_share_the_card_and_a_small_message_overtakes_a_large_one() {
        let mut card = Card::default();
        // 10 Mbit to rank 1, then 100 kbit to rank 2: the small one shares the card with the
        // large one (0.2 s, not 10.1 s), which finishes when the card has sent both (10.1 s).
        card.send(Duration::ZERO, 1e6, 1, 1e7, 0);
        let (_, t) = card.send(Duration::ZERO, 1e6, 2, 1e5, 1);
        let at = |id: u64| secs(t.iter().find(|x| x.1 == id).unwrap().2);
        assert!((at(1) - 0.2).abs() < 1e-9, "{t:?}");
        assert!((at(0) - 10.1).abs() < 1e-9, "{t:?}");
    }

    /// Random sends on three links: the card never beats its rate, every link keeps its order,
    /// and no message finishes earlier than it was told it would before a later send.
    #[test]
    fn the_card_keeps_its_rate_its_order_and_its_promises() {
        let mut card = Card::default();
        let mut promised: BTreeMap<u64, Duration> = BTreeMap::new();
        let mut queued_bits = 0.0;
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        };
        let mut now = 0.0;
        for id in 0..300u64 {
            now += next() * 0.05;
            let to = (next() * 3.0) as u32;
            let bits = 1e3 + next() * 1e5;
            queued_bits += bits;
            let (_, times) = card.send(Duration::from_secs_f64(now), 1e6, to, bits, id);
            for w in times.windows(2) {
                if w[0].0 == w[1].0 {
                    assert!(w[0].1 < w[1].1, "link {} out of order: {w:?}", w[0].0);
                }
            }
            for (_, i, at) in &times {
                if let Some(before) = promised.get(i) {
                    assert!(
                        *at + Duration::from_nanos(1) >= *before,
                        "{i} moved earlier"
                    );
                }
                promised.insert(*i, *at);
            }
            let last = times.iter().map(|t| secs(t.2)).fold(0.0, f64::max);
            // Everything sent by `last` cannot exceed the rate.
            assert!(
                queued_bits / 1e6 <= last + 1e-6,
                "{queued_bits} bits by {last}"
            );
        }
    }
}
