//! Failures per node-hour: how much of a long training's time is useful when nodes
//! fail at a given rate, with each strategy's own recovery.
//!
//! Two parts, so that a thousand simulated nodes stay affordable:
//! - [`probe_recovery`] injects one failure into the strategy's own protocol on the simulated
//!   network — the highest rank the strategy can lose ([`Job::expendable`]: a parameter-server
//!   worker under a stale consistency model, an all-reduce or gossip worker, a ring node with
//!   stage replicas), half-way through the run — and measures what it costs: detection, the
//!   protocol's recovery (the ring's heal, the survivors' new all-reduce ring, a dropped worker),
//!   redone work and the slower rest of the run. A run that does not survive it needs a restart.
//! - [`study`] then follows a long training (the horizon) through Poisson failures of every node
//!   (Monte Carlo, seeded): a failure of a node the strategy cannot lose — or of any node, where
//!   the probe did not recover — ends the attempt, loses the work since the newest checkpoint and
//!   costs the restart's downtime (the launcher's `--max-restarts`, which resumes the same run
//!   bit-identically); a failure it can lose costs what the probe measured. Checkpoints cost
//!   their write time (the largest node's state at the disk's speed) and come at Young's
//!   interval `√(2·write·MTBF)` unless given.
//!
//! Assumptions (printed by the CLI, [`ASSUMPTIONS`]): failures are independent and memoryless;
//! a lost node is replaced by the next restart (until then the run goes on without it, at the
//! cost the probe measured); nothing fails during a restart's downtime; the restarted attempt
//! runs as fast as the first.

use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtmp_data::Dataset;
use ringtmp_transport::sim::{Fault, SimConfig};
use serde::Serialize;

use crate::job::Job;
use crate::simulate::{Simulated, simulate};

/// What the failure study assumes; printed with its results.
pub const ASSUMPTIONS: &str = "failures: independent, memoryless (exponential) per node; a \
failure of a node the strategy cannot lose ends the attempt, which restarts from the newest \
checkpoint after the restart downtime (nothing fails during it); a node it can lose costs what \
one failure injected into its protocol half-way through the simulated run cost, and is replaced \
at the next restart; checkpoints cost the largest node's state at the disk's speed";

/// The failure rate and what recovery costs outside the protocol.
#[derive(Clone, Debug, Serialize)]
pub struct FailureModel {
    /// Failures per node per hour.
    pub per_node_hour: f64,
    /// Seconds from a failure that ends the attempt to the restarted attempt training again.
    pub restart_seconds: f64,
    /// Checkpoint write speed, bytes per second (each node writes its own state at once).
    pub disk_bytes_per_second: f64,
    /// Length of the training the useful fraction is estimated over, seconds.
    pub horizon_seconds: f64,
    /// Monte Carlo trials.
    pub trials: u32,
    /// Seed of the failure times.
    pub seed: u64,
    /// Seconds of training between checkpoints (`None`: Young's interval).
    pub checkpoint_seconds: Option<f64>,
}

/// One failure injected into the protocol.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryProbe {
    /// The rank that failed.
    pub rank: u32,
    /// When, in virtual seconds from the start.
    pub at_seconds: f64,
    /// Whether the run finished without it.
    pub recovered: bool,
    /// Training seconds (virtual) the run took beyond the failure-free one (when it recovered).
    pub extra_seconds: f64,
    /// Why the run ended, when it did not recover.
    pub error: Option<String>,
}

/// Injects the death of the highest rank `job` can lose half-way through a run like
/// `baseline` (`None` when it can lose none).
pub fn probe_recovery(
    job: &Job,
    world: u32,
    data: &Dataset,
    mut sim: SimConfig,
    baseline: &Simulated,
) -> Option<RecoveryProbe> {
    let rank = (1..world).rev().find(|r| job.expendable(*r))?;
    // Half-way through training (a run's final evaluation may take long after it).
    let at_seconds = baseline.training_started + baseline.summary.train_seconds / 2.0;
    sim.faults.push(Fault::Die {
        rank,
        at: Duration::from_secs_f64(at_seconds),
    });
    Some(match simulate(job, world, data, sim) {
        Ok(ran) => RecoveryProbe {
            rank,
            at_seconds,
            recovered: true,
            extra_seconds: (training_span(&ran) - training_span(baseline)).max(0.0),
            error: None,
        },
        Err(e) => RecoveryProbe {
            rank,
            at_seconds,
            recovered: false,
            extra_seconds: 0.0,
            error: Some(e.to_string()),
        },
    })
}

/// Virtual seconds from the start of training to its last step: what a failure can lengthen
/// (a run's final evaluation and goodbyes are not its cost, and a healed ring's own training
/// clock restarts at the heal). Strategies that announce no steps give their training clock.
fn training_span(ran: &Simulated) -> f64 {
    match ran.training_ended {
        Some(end) => end - ran.training_started,
        None => ran.summary.train_seconds,
    }
}

/// What a long training with failures looks like.
#[derive(Clone, Debug, Serialize)]
pub struct FailureStudy {
    /// Nodes.
    pub nodes: u32,
    /// Nodes whose failure needs a restart.
    pub critical_nodes: u32,
    /// Seconds one checkpoint takes to write.
    pub checkpoint_write_seconds: f64,
    /// Seconds of training between checkpoints.
    pub checkpoint_interval_seconds: f64,
    /// Mean fraction of the horizon spent on training that is kept (not redone, not
    /// recovering, not checkpointing).
    pub useful_fraction: f64,
    /// 5th and 95th percentiles of the useful fraction over the trials.
    pub useful_fraction_p05: f64,
    /// See `useful_fraction_p05`.
    pub useful_fraction_p95: f64,
    /// Mean failures per hour of the horizon.
    pub failures_per_hour: f64,
    /// Mean restarts per hour of the horizon.
    pub restarts_per_hour: f64,
}

/// Follows `model.trials` trainings of `model.horizon_seconds` through failures; `state_bytes`
/// is the largest node's parameters and optimizer state, `tolerated` the nodes the strategy
/// can lose and `tolerated_cost` what losing one costs (from [`probe_recovery`]).
pub fn study(
    model: &FailureModel,
    nodes: u32,
    tolerated: u32,
    tolerated_cost: f64,
    state_bytes: u64,
) -> FailureStudy {
    let rate = model.per_node_hour.max(0.0) / 3600.0;
    let critical = nodes - tolerated.min(nodes);
    let write = state_bytes as f64 / model.disk_bytes_per_second.max(1.0);
    let critical_rate = rate * f64::from(critical);
    let interval = match model.checkpoint_seconds {
        Some(c) => c,
        None if critical_rate > 0.0 => (2.0 * write / critical_rate).sqrt(),
        None => model.horizon_seconds,
    }
    .clamp(1e-3, model.horizon_seconds.max(1e-3));
    let mut rng = ChaCha8Rng::seed_from_u64(model.seed);
    let cluster_rate = rate * f64::from(nodes);
    let mut fractions = Vec::with_capacity(model.trials as usize);
    let (mut failures, mut restarts) = (0u64, 0u64);
    for _ in 0..model.trials.max(1) {
        let horizon = model.horizon_seconds;
        let (mut t, mut banked, mut unbanked) = (0.0f64, 0.0f64, 0.0f64);
        while t < horizon {
            let until_failure = if cluster_rate > 0.0 {
                // Exponential inter-arrival times of the whole cluster's failures.
                -(1.0 - rng.random::<f64>()).ln() / cluster_rate
            } else {
                f64::INFINITY
            };
            let mut left = until_failure.min(horizon - t);
            // Train (and checkpoint) until the failure or the horizon.
            while left > 0.0 {
                let to_checkpoint = interval - unbanked;
                if left >= to_checkpoint + write {
                    banked += interval;
                    unbanked = 0.0;
                    left -= to_checkpoint + write;
                    t += to_checkpoint + write;
                } else {
                    // Cut short, possibly while the checkpoint is being written.
                    unbanked += left.min(to_checkpoint);
                    t += left;
                    left = 0.0;
                }
            }
            if t >= horizon {
                break;
            }
            failures += 1;
            let critical_failure = rng.random::<f64>() * f64::from(nodes) < f64::from(critical);
            if critical_failure {
                restarts += 1;
                unbanked = 0.0;
                t += model.restart_seconds;
            } else {
                t += tolerated_cost;
            }
        }
        fractions.push(((banked + unbanked) / horizon).min(1.0));
    }
    fractions.sort_by(f64::total_cmp);
    let pick = |q: f64| fractions[((fractions.len() - 1) as f64 * q).round() as usize];
    let trials = fractions.len() as f64;
    let hours = model.horizon_seconds / 3600.0 * trials;
    FailureStudy {
        nodes,
        critical_nodes: critical,
        checkpoint_write_seconds: write,
        checkpoint_interval_seconds: interval,
        useful_fraction: fractions.iter().sum::<f64>() / trials,
        useful_fraction_p05: pick(0.05),
        useful_fraction_p95: pick(0.95),
        failures_per_hour: failures as f64 / hours,
        restarts_per_hour: restarts as f64 / hours,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(per_node_hour: f64) -> FailureModel {
        FailureModel {
            per_node_hour,
            restart_seconds: 60.0,
            disk_bytes_per_second: 50e6,
            horizon_seconds: 200.0 * 3600.0,
            trials: 40,
            seed: 7,
            checkpoint_seconds: None,
        }
    }

    /// Restarts only: the renewal model's expectation (each interval of work `C` plus its write
    /// `δ` takes `(1/Λ + R)(e^{Λ(C+δ)} − 1)` on average when a failure costs the restart `R`
    /// and the interval's work) against the Monte Carlo.
    #[test]
    fn restarts_match_the_renewal_formula() {
        let m = model(0.01);
        let nodes = 64;
        let s = study(&m, nodes, 0, 0.0, 400_000_000);
        let rate = 0.01 / 3600.0 * f64::from(nodes);
        let (c, d) = (s.checkpoint_interval_seconds, s.checkpoint_write_seconds);
        assert!((d - 8.0).abs() < 1e-9);
        // Young's interval.
        assert!((c - (2.0 * d / rate).sqrt()).abs() < 1e-6);
        let expected = c / ((1.0 / rate + m.restart_seconds) * ((rate * (c + d)).exp() - 1.0));
        assert!(
            (s.useful_fraction - expected).abs() < 0.01,
            "{} against {expected}",
            s.useful_fraction
        );
        assert!((s.failures_per_hour - 0.64).abs() < 0.05, "{s:?}");
        assert!((s.restarts_per_hour - s.failures_per_hour).abs() < 1e-9);
    }

    /// No failures: no restart, and no checkpoint needed beyond the one at the end.
    #[test]
    fn without_failures_all_of_the_time_is_useful() {
        let s = study(&model(0.0), 8, 0, 0.0, 1_000_000);
        assert_eq!(s.failures_per_hour, 0.0);
        assert!(s.useful_fraction > 0.999_999, "{s:?}");
    }

    /// Nodes the strategy can lose cost what the probe measured and never throw work away: with
    /// every node but one tolerated, the fraction is close to one minus the tolerated cost per
    /// failure times the failure rate.
    #[test]
    fn tolerated_failures_cost_their_measured_recovery() {
        let m = FailureModel {
            checkpoint_seconds: Some(60.0),
            ..model(0.05)
        };
        let nodes = 100;
        let all_restart = study(&m, nodes, 0, 0.0, 1_000_000);
        let tolerated = study(&m, nodes, nodes - 1, 30.0, 1_000_000);
        // Every failure a restart: 5 an hour × (30 s of work lost on average + 60 s down).
        assert!(
            (all_restart.useful_fraction - (1.0 - 5.0 * 90.0 / 3600.0)).abs() < 0.02,
            "{all_restart:?}"
        );
        assert!(tolerated.useful_fraction > all_restart.useful_fraction + 0.05);
        let rate = 0.05 / 3600.0 * f64::from(nodes - 1);
        let expected = 1.0 / (1.0 + rate * 30.0);
        assert!(
            (tolerated.useful_fraction - expected).abs() < 0.03,
            "{} against {expected}",
            tolerated.useful_fraction
        );
        assert_eq!(tolerated.critical_nodes, 1);
    }
}
