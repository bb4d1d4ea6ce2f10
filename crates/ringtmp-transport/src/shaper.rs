//! The emulated network card of a node: one sending budget shared by every outgoing link, as a
//! real NIC's is (a parameter server's server does not get a full link per worker).
//!
//! The arithmetic is a pure function of time, so it is tested without clocks: a frame of `b`
//! bytes occupies the card for `8b / rate` from the moment the card is free (or the frame is
//! ready, if later), and leaves when that time is up. Frames are served in the order they ask,
//! whichever link they are for; latency is added before a frame asks (it models the path, not the
//! card). Invariant: the card never sends faster than its rate — over any interval, the bytes
//! that finished leaving fit in `rate × interval` plus one frame, plus what `TIMER_SLACK` lets
//! a late sender make up.
//!
//! The links' writers ask for the card in pieces of 64 KiB rather than whole frames
//! (`network::write_frame_paced`), so a large frame's bytes reach the peer as they leave and
//! the links of one node take turns piece by piece, as flows do under a real card's fair queue.

use std::sync::Mutex;
use std::time::Duration;

/// How late a sender may ask for the card and still count as keeping it busy (timer overshoot).
pub const TIMER_SLACK: Duration = Duration::from_millis(2);

/// When the card is next free, as an offset from the node's epoch.
#[derive(Debug, Default)]
pub struct Nic {
    free_at: Duration,
}

impl Nic {
    /// A card that is free now.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reserves the card for a frame of `bytes` that is ready at `now`, at `bits_per_second`:
    /// returns when its last bit has left (the frame is released to the socket then).
    pub fn reserve(&mut self, now: Duration, bytes: usize, bits_per_second: u64) -> Duration {
        // A sender that wakes a little after the card came free (timers overshoot by up to a
        // millisecond) finds the card still sending: without this, every overshoot was idle
        // card time, and at 1 Gbit/s in 64 KiB pieces the card ran at a third of its rate.
        let start = if now > self.free_at && now - self.free_at <= TIMER_SLACK {
            self.free_at
        } else {
            self.free_at.max(now)
        };
        let busy = Duration::from_secs_f64(bytes as f64 * 8.0 / bits_per_second.max(1) as f64);
        self.free_at = start + busy;
        self.free_at
    }
}

/// A [`Nic`] shared by the writers of one node's links, on the I/O runtime's clock.
#[derive(Debug)]
pub struct SharedNic {
    epoch: tokio::time::Instant,
    nic: Mutex<Nic>,
}

impl SharedNic {
    /// A free card whose clock starts now.
    pub fn new() -> Self {
        Self {
            epoch: tokio::time::Instant::now(),
            nic: Mutex::new(Nic::new()),
        }
    }

    /// When a frame of `bytes` ready now may go to the socket (see [`Nic::reserve`]).
    pub fn reserve(&self, bytes: usize, bits_per_second: u64) -> tokio::time::Instant {
        let now = tokio::time::Instant::now().saturating_duration_since(self.epoch);
        let mut nic = self.nic.lock().unwrap_or_else(|e| e.into_inner());
        self.epoch + nic.reserve(now, bytes, bits_per_second)
    }
}

impl Default for SharedNic {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_frame_takes_its_size_over_the_rate() {
        let mut nic = Nic::new();
        // 125,000 bytes = 1 Mbit: 10 ms at 100 Mbit/s.
        assert_eq!(nic.reserve(Duration::ZERO, 125_000, 100_000_000), 10 * MS);
        // An idle card starts when the frame is ready.
        assert_eq!(nic.reserve(50 * MS, 125_000, 100_000_000), 60 * MS);
    }

    #[test]
    fn a_sender_that_wakes_late_keeps_the_card_busy() {
        // Pieces asked for 0.8 ms after the card came free (a timer's overshoot) follow on
        // without a gap; one asked for well after the card went idle starts when asked.
        let mut nic = Nic::new();
        let end = nic.reserve(Duration::ZERO, 125_000, 100_000_000);
        assert_eq!(end, 10 * MS);
        let late = end + Duration::from_micros(800);
        assert_eq!(nic.reserve(late, 125_000, 100_000_000), 20 * MS);
        assert_eq!(nic.reserve(50 * MS, 125_000, 100_000_000), 60 * MS);
    }

    #[test]
    fn links_share_one_card_in_the_order_frames_ask() {
        // Three workers' pushes to a server, or a server's answers to three workers: the same
        // card. Three 1 Mbit frames ready at once leave at 10, 20 and 30 ms, not all at 10.
        let mut nic = Nic::new();
        let ends: Vec<Duration> = (0..3)
            .map(|_| nic.reserve(Duration::ZERO, 125_000, 100_000_000))
            .collect();
        assert_eq!(ends, [10 * MS, 20 * MS, 30 * MS]);
    }

    #[test]
    fn the_card_never_exceeds_its_rate() {
        // Frames of varied sizes asking at varied times, from several links: over every window
        // [a, b] between departures, the bytes that left fit in rate × (b − a) plus one frame.
        let rate = 8_000_000u64; // 1 MB/s
        let mut nic = Nic::new();
        let mut departures = Vec::new();
        let mut now = Duration::ZERO;
        let mut x = 7u64;
        for _ in 0..500 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let bytes = 100 + (x >> 40) as usize % 20_000;
            now += Duration::from_micros((x >> 20) % 3_000);
            departures.push((nic.reserve(now, bytes, rate), bytes));
        }
        let largest = departures.iter().map(|d| d.1).max().unwrap() as f64;
        for i in 0..departures.len() {
            let mut sent = 0.0;
            for j in i..departures.len() {
                sent += departures[j].1 as f64;
                let window = (departures[j].0 - departures[i].0).as_secs_f64();
                let slack = TIMER_SLACK.as_secs_f64() * rate as f64 / 8.0;
                assert!(
                    sent <= window * rate as f64 / 8.0 + largest + slack + 1.0,
                    "{sent} bytes in {window} s"
                );
            }
        }
        // And it is work-conserving: with frames always waiting, it is never idle.
        let mut nic = Nic::new();
        let total: usize = (0..100)
            .map(|_| {
                nic.reserve(Duration::ZERO, 1_000, rate);
                1_000
            })
            .sum();
        assert_eq!(
            nic.reserve(Duration::ZERO, 0, rate),
            Duration::from_secs_f64(total as f64 * 8.0 / rate as f64)
        );
    }
}
