//! Planning a parameter-server run: from the run's configuration, the parameter server's options
//! and the cluster to the [`PsJob`] every node runs.

use ringtmp_data::Dataset;
use ringtmp_model::OptimizerConfig;
use serde::{Deserialize, Serialize};

use crate::consistency::Consistency;
use crate::driver::PsJob;
use ringtmp_contract::contract::{Cluster, PlanReport};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::{Origin, ResumePoint, RunSpec, TrainConfig};

/// `ringtmp train --strategy ps` options (flags, and keys of a `--config` file).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(rename_all = "kebab-case")]
pub struct PsOptions {
    /// Parameter server: server nodes (the rest are workers) [default: 1].
    #[cfg_attr(feature = "cli", arg(long))]
    pub servers: Option<usize>,
    /// Parameter server: one server per K nodes (`--nodes` / K of them, at least 1): the form
    /// that stays sharded across a sweep of node counts.
    #[cfg_attr(
        feature = "cli",
        arg(long, value_name = "K", conflicts_with = "servers")
    )]
    pub server_every: Option<usize>,
    /// Parameter server: bsp, ssp:S, asp or dssp:L:U [default: bsp].
    #[cfg_attr(feature = "cli", arg(long, value_name = "MODEL"))]
    #[serde(default, with = "ringtmp_contract::text_form")]
    pub consistency: Option<Consistency>,
    /// Parameter server (even under bsp) and D-PSGD: keep training without a dead worker.
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub drop_dead_workers: Option<bool>,
}

ringtmp_contract::options_merge!(
    PsOptions,
    servers,
    server_every,
    consistency,
    drop_dead_workers
);

impl PsOptions {
    /// Server nodes of a run on `nodes` nodes: `--servers`, or one per `--server-every` nodes.
    pub fn server_count(&self, nodes: u32) -> Result<usize> {
        match (self.servers, self.server_every) {
            (Some(_), Some(_)) => Err(Error::Config(
                "--servers and --server-every say the same thing: give one".into(),
            )),
            (None, Some(0)) => Err(Error::Config("--server-every must be at least 1".into())),
            (None, Some(k)) => Ok((nodes as usize / k).max(1)),
            (s, None) => Ok(s.unwrap_or(1)),
        }
    }
}

/// Plans the job for `cluster.nodes` nodes (`--servers` of them servers).
pub fn plan(
    mut cfg: TrainConfig,
    args: &PsOptions,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<PsJob> {
    let nodes = cluster.nodes;
    let servers = args.server_count(nodes)?;
    if servers == 0 || servers as u32 >= nodes {
        return Err(Error::Config(format!(
            "--servers must be between 1 and {} (--nodes {nodes} includes the workers)",
            nodes.saturating_sub(1)
        )));
    }
    let workers = nodes as usize - servers;
    check_memory_floor(&cfg, data, cluster, servers)?;
    let consistency = args.consistency.unwrap_or(Consistency::Bsp);
    if cluster.threads.is_none() {
        cfg.threads = (cluster.cores / workers).max(1);
    }
    let global = cfg.batch_size * workers;
    if global > data.train.len() {
        return Err(Error::Config(format!(
            "{workers} workers × batch {} exceed the {} training examples",
            cfg.batch_size,
            data.train.len()
        )));
    }
    // The default rate is tuned for one node's batch; a step here averages W of them: measured
    // on the 4-worker mlp job, 0.04 reaches 97% in 250 iterations where 0.01 needs 600
    // (docs/BENCHMARKS.md).
    let updates = if consistency == Consistency::Bsp {
        ringtmp_contract::batch_scaling::Updates::Synchronous
    } else {
        ringtmp_contract::batch_scaling::Updates::Stale
    };
    let scaled = ringtmp_contract::batch_scaling::scale_defaults(&mut cfg, workers, updates);
    let stale_momentum =
        (consistency != Consistency::Bsp && cfg.momentum == Origin::Default).then(|| {
            cfg.model
                .stale_momentum
                .unwrap_or_else(|| stale_momentum(workers))
        });
    if let (Some(m), OptimizerConfig::Sgd { momentum, .. }) = (stale_momentum, &mut cfg.optimizer) {
        *momentum = m;
    }
    // Stale updates at a constant rate leave the last epoch's model noisy: 3 epochs of
    // dssp:1:4 on the 4-worker mlp job ended at 96.32% against a best of 97.56%; with the
    // rate decayed to zero (cosine) they end at 97.47% against 97.50% (docs/BENCHMARKS.md).
    let cosine = consistency != Consistency::Bsp
        && cfg.schedule.adapt(|_| ringtmp_model::LrSchedule::Cosine);
    report.note(format!(
        "parameter server: {servers} server(s), {workers} worker(s) of batch {} (global batch {global}), {}, learning rate {}{}",
        cfg.batch_size,
        consistency.name(),
        cfg.lr,
        if cosine {
            " with a cosine decay (the default for stale consistency models)"
        } else {
            ""
        }
    ));
    if let Some(note) = scaled {
        report.note(format!("parameter server: {note}"));
    }
    if let Some(m) = stale_momentum {
        report.note(format!(
            "stale updates from {workers} workers: SGD momentum {m:.1} (the default for stale \
             consistency models: {}; --momentum sets it)",
            if cfg.model.stale_momentum.is_some() {
                format!("the model {}'s own, measured for it", cfg.model.name)
            } else {
                format!(
                    "the most that keeps 30% of synchronous SGD's stability margin under a \
                     delay of {} updates",
                    workers.saturating_sub(1)
                )
            }
        ));
    }
    let mut spec = RunSpec::new(cfg.clone(), data, global)?;
    spec.config.out = std::path::absolute(&cfg.out).unwrap_or_else(|_| cfg.out.clone());
    if let Some(path) = &cfg.resume {
        // The data order is that of the global batch (workers × batch), so the checkpoint must
        // have been written with that batch size, by whichever strategy.
        let global_cfg = TrainConfig {
            batch_size: global,
            ..cfg.clone()
        };
        let (dir, manifest) = ringtmp_contract::resume::check_resume(path, &global_cfg, data)?;
        report.note(format!(
            "resuming from {} at iteration {} (written by {}, its parameters in {} file(s))",
            dir.display(),
            manifest.step,
            manifest.strategy,
            manifest.files.len()
        ));
        spec.resume_from = Some(ResumePoint {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            step: manifest.step.min(spec.total_steps),
        });
    }
    let job = PsJob {
        spec,
        servers,
        workers,
        consistency,
        node_speeds: cluster.node_speeds.clone(),
        drop_dead_workers: args.drop_dead_workers.unwrap_or(false),
    };
    Ok(job)
}

/// SGD's momentum for a stale consistency model run by `workers` workers, when the user gives
/// none.
///
/// Under ASP, SSP and DSSP each push is one update of `lr/W`, and a worker's gradient lands
/// about `W − 1` updates after the parameters it was computed from (measured: every push of the
/// 3-worker cnn at 100 Mbit/s had staleness exactly 2; on loopback 1.97 on average, spread over
/// 0–4). Delay and momentum together make SGD oscillate: on a quadratic of curvature `λ` the
/// update `x ← x + μ(x − x₋₁) − a·x₋τ` (with `a = lr·λ/W`) diverges at a much smaller `a` than
/// synchronous SGD does. The default is the largest momentum (in steps of 0.1) that keeps at
/// least 30% of synchronous SGD's margin at 0.9 under a constant delay of `W − 1`
/// ([`delayed_margin`]): 0.9 for one worker, 0.4 for two, 0.3 for three and four, 0.2 from
/// eight on. Measured on the 3-worker cnn under DSSP at 100 Mbit/s, 4 × half a core
/// (docs/BENCHMARKS.md, "stale parameter-server momentum"; seeds 42, 43, 44): at 0.7 64% and 77%
/// (diverging); at 0.5 (22% of the margin) 92.5–93.1%, 39.6% and 93.9%; at 0.3 (32%) 94.1%,
/// 90.7% and 94.4%; at 0 93.4% (seed 43). On loopback (seed 42) 0.3 against 0.7: cnn 94.0% /
/// 95.2%, mlp-deep 85.6% / 76.8%, mlp 91.3% / 93.0% — the mlp gives up 1.7 points for a
/// default that does not diverge.
pub fn stale_momentum(workers: usize) -> f32 {
    let delay = workers.saturating_sub(1);
    (0..=9)
        .rev()
        .map(|tenths| tenths as f64 / 10.0)
        .find(|&momentum| delayed_margin(momentum, delay, workers.max(1)) >= 0.3)
        .unwrap_or(0.0) as f32
}

/// How much of synchronous SGD's stability margin at momentum 0.9 is left to `workers` workers
/// whose pushes each apply `1/workers` of an iteration's rate with momentum `momentum`, `delay`
/// updates late: the largest stable `a` of `x ← x + μ(x − x₋₁) − a·x₋delay`, times `workers`,
/// over synchronous heavy-ball's `2(1 + 0.9)`. 1 for one worker at 0.9; below 1 is less margin.
pub fn delayed_margin(momentum: f64, delay: usize, workers: usize) -> f64 {
    let stable = |a: f64| delayed_recurrence_decays(momentum, delay, a);
    let (mut lo, mut hi) = (0.0f64, 4.0f64);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if stable(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * workers as f64 / (2.0 * 1.9)
}

/// Whether `x_{t+1} = (1 + μ)x_t − μ·x_{t−1} − a·x_{t−delay}` decays: its growth per step over
/// the second half of a long run, from an impulse, renormalised so that nothing overflows.
fn delayed_recurrence_decays(momentum: f64, delay: usize, a: f64) -> bool {
    const STEPS: usize = 40_000;
    let len = delay.max(1) + 1;
    // history[i] = x_{t-i}
    let mut history = vec![0.0f64; len];
    history[0] = 1.0;
    let mut log_scale = 0.0f64;
    let mut log_at_half = 0.0f64;
    for step in 0..STEPS {
        let next = (1.0 + momentum) * history[0] - momentum * history[1] - a * history[delay];
        history.rotate_right(1);
        history[0] = next;
        if step % 64 == 63 {
            let norm = history.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            if norm == 0.0 || !norm.is_finite() {
                return norm == 0.0;
            }
            log_scale += norm.ln();
            history.iter_mut().for_each(|x| *x /= norm);
        }
        if step == STEPS / 2 {
            log_at_half = log_scale;
        }
    }
    let norm = history.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    log_scale + norm.ln() < log_at_half
}

/// Refuses, before any node starts, servers or workers whose memory limit is below what they
/// hold at least: a worker the whole model's parameters and gradients, a server its shard's
/// parameters and optimizer state.
fn check_memory_floor(
    cfg: &TrainConfig,
    data: &Dataset,
    cluster: &Cluster,
    servers: usize,
) -> Result<()> {
    use ringtmp_contract::memory_floor::{Floor, check, params_of, state_copies, state_words};
    let layers = ringtmp_contract::layers_for(&cfg.model, data)?;
    let params = params_of(&layers);
    let worker = Floor {
        who: "each worker".into(),
        params,
        values: 2,
        what: " and their gradients".into(),
    };
    check("ps", &worker, servers..cluster.nodes as usize, cluster)?;
    let server = Floor {
        who: format!("each of {servers} server(s)"),
        params: params.div_ceil(servers as u64),
        values: 1 + state_copies(&cfg.optimizer),
        what: state_words(&cfg.optimizer).to_string(),
    };
    check("ps", &server, 0..servers, cluster)
}
