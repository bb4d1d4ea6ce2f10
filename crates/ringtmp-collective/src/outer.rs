//! DiLoCo's outer loop as pure functions and state: the outer optimizer (SGD with Nesterov
//! momentum, PyTorch's `torch.optim.SGD(nesterov=True)` without dampening), the model's
//! fragments (Streaming DiLoCo) and when each one synchronises.
//!
//! Invariants (tested below): the fragments cover the parameters in order, without overlap, at
//! tensor boundaries; over any H consecutive steps every fragment synchronises exactly once, and
//! the fragments' synchronisations are spread evenly (fragment p at step counts ≡ ⌊(p+1)·H/F⌋
//! mod H); at the run's last step every fragment not synchronised there yet synchronises, so
//! the run ends on the outer model.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The outer optimizer's settings (the DiLoCo paper's defaults: lr 0.7, momentum 0.9, Nesterov).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OuterConfig {
    /// Outer learning rate.
    pub lr: f32,
    /// Momentum μ.
    pub momentum: f32,
    /// Nesterov's look-ahead (PyTorch's `nesterov=True`).
    pub nesterov: bool,
    /// The outer step follows the inner learning-rate schedule: each pseudo-gradient enters the
    /// momentum in units of the peak inner rate (divided by the interval's mean rate ρ, as a
    /// fraction of the peak), and the step applies the momentum at ρ. With a constant rate
    /// (ρ = 1) this is the paper's step; with a decaying one, a momentum gathered while the
    /// rate was high no longer drives the model on at that size once the inner steps shrink.
    #[serde(default)]
    pub follow_schedule: bool,
}

impl OuterConfig {
    /// The DiLoCo paper's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov.
    pub const PAPER: Self = Self {
        lr: 0.7,
        momentum: 0.9,
        nesterov: true,
        follow_schedule: false,
    };
}

/// The state every worker shares: the outer parameters (the model as of each fragment's last
/// synchronisation) and the outer momentum; the same bits on every worker.
#[derive(Clone, Debug, Default)]
pub struct OuterState {
    /// θ: the outer parameters.
    pub global: Vec<f32>,
    /// The outer momentum buffer.
    pub velocity: Vec<f32>,
    /// Fragment synchronisations completed.
    pub updates: u64,
    /// Set when a re-formed ring replaced this state with rank 0's (the worker's own progress
    /// since is void).
    pub replaced: bool,
}

impl OuterState {
    /// The state of a run starting from `params`.
    pub fn new(params: &[f32]) -> Self {
        Self {
            global: params.to_vec(),
            velocity: vec![0.0; params.len()],
            updates: 0,
            replaced: false,
        }
    }

    /// One outer step on `range` from the workers' mean pseudo-gradient `delta` (θ_old − θ_local,
    /// averaged): `v ← μv + Δ`, `θ ← θ − lr·(Δ + μv)` with Nesterov, `θ ← θ − lr·v` without.
    /// `rate` is the inner steps' mean learning rate over the interval, as a fraction of the
    /// peak; under [`OuterConfig::follow_schedule`] the step is taken on `g = Δ/rate` and
    /// applied at `rate` (`v ← μv + g`, `θ ← θ − lr·rate·(g + μv)`), else `rate` is unused.
    pub fn step(&mut self, config: &OuterConfig, range: Range<usize>, delta: &[f32], rate: f32) {
        let mu = config.momentum;
        let rate = if config.follow_schedule && rate > 0.0 {
            rate
        } else {
            1.0
        };
        let (lr, per_rate) = (config.lr * rate, 1.0 / rate);
        let theta = &mut self.global[range.clone()];
        let v = &mut self.velocity[range];
        for ((t, v), d) in theta.iter_mut().zip(v.iter_mut()).zip(delta) {
            let g = d * per_rate;
            *v = mu * *v + g;
            let update = if config.nesterov { g + mu * *v } else { *v };
            *t -= lr * update;
        }
    }
}

/// Cuts the parameters (`tensors`, in order, contiguous) into `f` fragments of near-equal size at
/// tensor boundaries: each boundary is the tensor edge nearest to k/f of the total. Fewer than `f`
/// come back when the model has fewer tensors; none is empty.
pub fn fragments(tensors: &[Range<usize>], f: usize) -> Vec<Range<usize>> {
    let (Some(first), Some(last)) = (tensors.first(), tensors.last()) else {
        return Vec::new();
    };
    let (start, end) = (first.start, last.end);
    let total = (end - start) as f64;
    let edges: Vec<usize> = tensors.iter().map(|t| t.end).collect();
    let mut cuts = vec![start];
    for k in 1..f {
        let target = start as f64 + total * k as f64 / f as f64;
        let nearest = edges
            .iter()
            .copied()
            .filter(|e| *e > *cuts.last().expect("a cut") && *e < end)
            .min_by(|a, b| {
                ((*a as f64) - target)
                    .abs()
                    .total_cmp(&((*b as f64) - target).abs())
            });
        if let Some(cut) = nearest {
            cuts.push(cut);
        }
    }
    cuts.push(end);
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// When each fragment synchronises: every `h` steps, fragment p of `f` at the step counts
/// ≡ ⌊(p+1)·h/f⌋ (mod h) — with one fragment, every h steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncSchedule {
    /// Inner steps between two synchronisations of one fragment.
    pub h: u64,
    /// Fragments.
    pub f: usize,
    /// The run's last step count (every fragment synchronises there).
    pub total: u64,
}

impl SyncSchedule {
    /// The step count (mod h) at which fragment `p` synchronises.
    pub fn offset(&self, p: usize) -> u64 {
        ((p as u64 + 1) * self.h / self.f as u64) % self.h
    }

    /// The fragments that synchronise once `done` steps are complete (in order).
    pub fn due(&self, done: u64) -> Vec<usize> {
        if done == 0 {
            return Vec::new();
        }
        if done >= self.total {
            return (0..self.f).collect();
        }
        (0..self.f).filter(|p| self.synced_at(*p, done)).collect()
    }

    fn synced_at(&self, p: usize, done: u64) -> bool {
        done % self.h == self.offset(p)
    }

    /// The next step count after `done` at which some fragment synchronises (the run's end at
    /// the latest).
    pub fn next_after(&self, done: u64) -> u64 {
        (done + 1..self.total)
            .find(|c| (0..self.f).any(|p| self.synced_at(p, *c)))
            .unwrap_or(self.total)
    }

    /// The step count of synchronisation number `k` (0-based) of a run that starts after
    /// `first` steps: the sequence every worker follows, so a worker that took rank 0's outer
    /// state after `k` updates knows which synchronisation rank 0 is redoing.
    pub fn nth(&self, first: u64, k: u64) -> Option<u64> {
        let mut at = first;
        for _ in 0..=k {
            if at >= self.total {
                return None;
            }
            at = self.next_after(at);
        }
        Some(at)
    }

    /// The step count after which the synchronisation at `done` follows the one before it (0
    /// at the start).
    pub fn previous_before(&self, done: u64) -> u64 {
        (1..done)
            .rev()
            .find(|c| (0..self.f).any(|p| self.synced_at(p, *c)))
            .unwrap_or(0)
    }
}

/// What a re-formed ring hands a member whose count of outer updates differs from rank 0's.
impl crate::elastic::Replica for OuterState {
    fn updates(&self) -> u64 {
        self.updates
    }

    fn flat(&self) -> Vec<f32> {
        let mut out = self.global.clone();
        out.extend_from_slice(&self.velocity);
        out
    }

    fn flat_len(&self) -> usize {
        self.global.len() + self.velocity.len()
    }

    fn load(&mut self, values: &[f32], updates: u64) -> ringtmp_contract::Result<()> {
        if values.len() != self.flat_len() {
            return Err(ringtmp_contract::Error::Config(format!(
                "diloco: rank 0's outer state holds {} values, expected {}",
                values.len(),
                self.flat_len()
            )));
        }
        let (global, velocity) = values.split_at(self.global.len());
        self.global.copy_from_slice(global);
        self.velocity.copy_from_slice(velocity);
        self.updates = updates;
        self.replaced = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesterov_matches_a_hand_computed_update() {
        // PyTorch SGD(lr=0.7, momentum=0.9, nesterov=True) on one value, two steps:
        // v1 = 1.0, θ1 = 1 − 0.7·(1 + 0.9·1) = −0.33;
        // v2 = 0.9 + 0.5 = 1.4, θ2 = −0.33 − 0.7·(0.5 + 0.9·1.4) = −1.562.
        let config = OuterConfig {
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            follow_schedule: false,
        };
        let mut state = OuterState::new(&[1.0, 2.0]);
        state.step(&config, 0..1, &[1.0], 1.0);
        assert!((state.global[0] + 0.33).abs() < 1e-6);
        state.step(&config, 0..1, &[0.5], 1.0);
        assert!(
            (state.global[0] + 1.562).abs() < 1e-6,
            "{}",
            state.global[0]
        );
        assert_eq!(state.global[1], 2.0, "outside the range nothing moves");
        // Without Nesterov: θ1 = 1 − 0.7, θ2 = 0.3 − 0.7·1.4.
        let plain = OuterConfig {
            nesterov: false,
            ..config
        };
        let mut state = OuterState::new(&[1.0]);
        state.step(&plain, 0..1, &[1.0], 1.0);
        state.step(&plain, 0..1, &[0.5], 1.0);
        assert!((state.global[0] - (0.3 - 0.98)).abs() < 1e-6);
    }

    #[test]
    fn following_the_schedule_scales_the_step_not_the_momentum() {
        // Rates 1 then 0.2: g1 = 1, v1 = 1, θ1 = 1 − 0.7·1·(1 + 0.9) = −0.33;
        // g2 = 0.1/0.2 = 0.5, v2 = 0.9 + 0.5 = 1.4, θ2 = −0.33 − 0.7·0.2·(0.5 + 0.9·1.4) =
        // −0.5764. At rate 1 throughout it is the paper's step (the test above).
        let config = OuterConfig {
            follow_schedule: true,
            ..OuterConfig::PAPER
        };
        let mut state = OuterState::new(&[1.0]);
        state.step(&config, 0..1, &[1.0], 1.0);
        assert!((state.global[0] + 0.33).abs() < 1e-6);
        state.step(&config, 0..1, &[0.1], 0.2);
        assert!((state.velocity[0] - 1.4).abs() < 1e-6);
        assert!(
            (state.global[0] + 0.5764).abs() < 1e-6,
            "{}",
            state.global[0]
        );
        // The paper's step ignores the rate: θ2 = −0.33 − 0.7·(0.1 + 0.9·1.0).
        let mut paper = OuterState::new(&[1.0]);
        paper.step(&OuterConfig::PAPER, 0..1, &[1.0], 1.0);
        paper.step(&OuterConfig::PAPER, 0..1, &[0.1], 0.2);
        assert!((paper.global[0] + 1.03).abs() < 1e-6, "{}", paper.global[0]);
    }

    #[test]
    fn outer_lr_one_without_momentum_lands_on_the_mean() {
        // θ − (θ − mean θ_i) = mean θ_i: H = 1 DiLoCo is all-reduce SGD.
        let config = OuterConfig {
            lr: 1.0,
            momentum: 0.0,
            nesterov: false,
            follow_schedule: false,
        };
        let mut state = OuterState::new(&[3.0]);
        state.step(&config, 0..1, &[3.0 - 2.5], 1.0);
        assert_eq!(state.global[0], 2.5);
    }

    #[test]
    fn fragments_cover_the_tensors_at_their_edges() {
        let tensors = vec![0..100, 100..110, 110..300, 300..310, 310..400];
        for f in 1..7 {
            let parts = fragments(&tensors, f);
            assert!(!parts.is_empty() && parts.len() <= f);
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts.last().unwrap().end, 400);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
            assert!(parts.iter().all(|p| !p.is_empty()));
            assert!(parts.iter().all(|p| tensors.iter().any(|t| t.end == p.end)));
        }
        assert_eq!(fragments(&tensors, 2), vec![0..110, 110..400]);
        assert_eq!(fragments(&tensors, 1), vec![0..400]);
    }

    #[test]
    fn every_fragment_synchronises_once_every_h_steps_and_all_at_the_end() {
        for (h, f, total) in [(1, 1, 7), (4, 1, 10), (6, 3, 40), (10, 4, 37), (5, 5, 23)] {
            let s = SyncSchedule { h, f, total };
            let mut last = vec![0u64; f];
            for done in 1..=total {
                for p in s.due(done) {
                    if done < total {
                        let first = if s.offset(p) == 0 { h } else { s.offset(p) };
                        let expected = if last[p] == 0 { first } else { h };
                        assert_eq!(
                            done - last[p],
                            expected,
                            "h {h} f {f} fragment {p} at {done}"
                        );
                    }
                    last[p] = done;
                }
            }
            assert!(
                last.iter().all(|l| *l == total),
                "all synchronise at the end"
            );
            // Spread: with f fragments no two share a step count before the end.
            for done in 1..total {
                assert!(s.due(done).len() <= 1 || f == 1);
            }
            assert_eq!(s.nth(0, 0), Some(s.next_after(0)));
            assert_eq!(s.nth(0, 1), Some(s.next_after(s.next_after(0))));
            // next_after lands on the next step count where something is due.
            let mut at = 0;
            while at < total {
                let next = s.next_after(at);
                assert!(!s.due(next).is_empty());
                assert!((at + 1..next).all(|c| s.due(c).is_empty()));
                assert_eq!(s.previous_before(next), at);
                at = next;
            }
        }
    }
}
