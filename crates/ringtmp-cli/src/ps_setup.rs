//! Turning `ringtmp train --strategy ps` options into the [`PsJob`] every node runs.

use anyhow::Result;
use ringtmp_data::Dataset;
use ringtmp_model::OptimizerConfig;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::param_server::driver::PsJob;
use ringtmp_strategy::{ResumePoint, RunSpec, TrainConfig};

use crate::UsageError;
use crate::args::TrainArgs;

/// Builds the job for `nodes` nodes (`--servers` of them servers).
pub fn ps_job(args: &TrainArgs, data: &Dataset, nodes: u32) -> Result<(PsJob, TrainConfig)> {
    let mut cfg = args.resolve(data.classes)?;
    let servers = args.servers.unwrap_or(1);
    if servers == 0 || servers as u32 >= nodes {
        return Err(UsageError(format!(
            "--servers must be between 1 and {} (--nodes {nodes} includes the workers)",
            nodes.saturating_sub(1)
        ))
        .into());
    }
    let workers = nodes as usize - servers;
    let consistency = Consistency::parse(args.consistency.as_deref().unwrap_or("bsp"))
        .map_err(|e| UsageError(format!("--consistency: {e}")))?;
    if args.threads.is_none() {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        cfg.threads = (cores / workers).max(1);
    }
    let global = cfg.batch_size * workers;
    if global > data.train.len() {
        return Err(UsageError(format!(
            "{workers} workers × batch {} exceed the {} training examples",
            cfg.batch_size,
            data.train.len()
        ))
        .into());
    }
    if args.lr.is_none() && matches!(cfg.optimizer, OptimizerConfig::Sgd { .. }) {
        // The default SGD rate is tuned for one node's batch; a step here averages W of them.
        // Linear scaling (Goyal et al., 2017) keeps the per-example step size: measured on the
        // 4-worker mlp job, 0.04 reaches 97% in 250 iterations where 0.01 needs 600
        // (docs/BENCHMARKS.md). Adam's steps do not scale with the batch, so it keeps its default.
        cfg.lr *= workers as f32;
    }
    eprintln!(
        "parameter server: {servers} server(s), {workers} worker(s) of batch {} (global batch {global}), {}, learning rate {}",
        cfg.batch_size,
        consistency.name(),
        cfg.lr
    );
    let mut spec = RunSpec::new(cfg.clone(), data, global)?;
    spec.config.out = std::path::absolute(&cfg.out).unwrap_or_else(|_| cfg.out.clone());
    if let Some(path) = &cfg.resume {
        // The data order is that of the global batch (workers × batch), so the checkpoint must
        // have been written with that batch size, by whichever strategy.
        let global_cfg = TrainConfig {
            batch_size: global,
            ..cfg.clone()
        };
        let (dir, manifest) = ringtmp_strategy::local::check_resume(path, &global_cfg)?;
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
        node_speeds: crate::ring_setup::node_speeds(
            args.node_speed.as_deref().unwrap_or_default(),
            nodes,
        )?,
        drop_dead_workers: args.drop_dead_workers.unwrap_or(false),
    };
    Ok((job, cfg))
}
