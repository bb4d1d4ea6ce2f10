//! Planning a parameter-server run: from the run's configuration, the parameter server's options
//! and the cluster to the [`PsJob`] every node runs.

use ringtmp_data::Dataset;
use ringtmp_model::OptimizerConfig;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::job::Cluster;
use crate::param_server::consistency::Consistency;
use crate::param_server::driver::PsJob;
use crate::{ResumePoint, RunSpec, TrainConfig};

/// `ringtmp train --strategy ps` options (flags, and keys of a `--config` file).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PsOptions {
    /// Parameter server: server nodes (the rest are workers) [default: 1].
    #[arg(long)]
    pub servers: Option<usize>,
    /// Parameter server: one server per K nodes (`--nodes` / K of them, at least 1): the form
    /// that stays sharded across a sweep of node counts.
    #[arg(long, value_name = "K", conflicts_with = "servers")]
    pub server_every: Option<usize>,
    /// Parameter server: bsp, ssp:S, asp or dssp:L:U [default: bsp].
    #[arg(long, value_name = "MODEL")]
    pub consistency: Option<String>,
    /// Parameter server (even under bsp) and D-PSGD: keep training without a dead worker.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub drop_dead_workers: Option<bool>,
}

crate::job::options_merge!(
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
    let consistency = Consistency::parse(args.consistency.as_deref().unwrap_or("bsp"))
        .map_err(|e| Error::Config(format!("--consistency: {e}")))?;
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
    if cfg.default_lr && matches!(cfg.optimizer, OptimizerConfig::Sgd { .. }) {
        // The default SGD rate is tuned for one node's batch; a step here averages W of them.
        // Linear scaling (Goyal et al., 2017) keeps the per-example step size: measured on the
        // 4-worker mlp job, 0.04 reaches 97% in 250 iterations where 0.01 needs 600
        // (docs/BENCHMARKS.md). Adam's steps do not scale with the batch, so it keeps its default.
        cfg.lr *= workers as f32;
    }
    let stale_momentum =
        (consistency != Consistency::Bsp && cfg.default_momentum).then(|| stale_momentum(workers));
    if let (Some(m), OptimizerConfig::Sgd { momentum, .. }) = (stale_momentum, &mut cfg.optimizer) {
        *momentum = m;
    }
    if cfg.default_schedule && consistency != Consistency::Bsp {
        // Stale updates at a constant rate leave the last epoch's model noisy: 3 epochs of
        // dssp:1:4 on the 4-worker mlp job ended at 96.32% against a best of 97.56%; with the
        // rate decayed to zero (cosine) they end at 97.47% against 97.50% (docs/BENCHMARKS.md).
        cfg.schedule = ringtmp_model::LrSchedule::Cosine;
    }
    eprintln!(
        "parameter server: {servers} server(s), {workers} worker(s) of batch {} (global batch {global}), {}, learning rate {}{}",
        cfg.batch_size,
        consistency.name(),
        cfg.lr,
        if cfg.default_schedule && consistency != Consistency::Bsp {
            " with a cosine decay (the default for stale consistency models)"
        } else {
            ""
        }
    );
    if let Some(m) = stale_momentum {
        eprintln!(
            "stale updates from {workers} workers: SGD momentum {m:.2} (the default for stale \
             consistency models, 1 - {workers}/10; --momentum sets it)"
        );
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
        let (dir, manifest) = crate::local::check_resume(path, &global_cfg)?;
        eprintln!(
            "resuming from {} at iteration {} (written by {} on {} node(s))",
            dir.display(),
            manifest.step,
            manifest.strategy,
            manifest.files.len()
        );
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
/// Under ASP, SSP and DSSP each worker's gradient lands on the server about `workers - 1`
/// updates after the parameters it was computed from, and staleness acts as momentum of its own
/// (Mitliagkas et al., "Asynchrony begets momentum", 2016: about `1 - 1/W` for W asynchronous
/// workers). SGD's 0.9 averages over the last 10 updates; with W workers in flight, the updates
/// already overlap W at a time, so the explicit momentum keeps an average over 10/W of them:
/// `1 - W/10`. Measured on 3 workers (docs/BENCHMARKS.md, "stale parameter-server momentum"):
/// at 0.9 the cnn diverged under asp and dssp (11% after 24,000 samples); at 0.7 it reached
/// 95–96% and the mlp models kept their accuracy.
pub fn stale_momentum(workers: usize) -> f32 {
    (1.0 - workers as f32 / 10.0).max(0.0)
}
