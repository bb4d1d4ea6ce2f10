//! Jobs for the distributed strategies derived from one [`TrainConfig`], so that a test's oracle
//! (`local` on that configuration) and the strategy under test cannot disagree on the model,
//! data order, optimizer or schedule.

use ringtmp_data::Dataset;
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::param_server::driver::PsJob;
use ringtmp_strategy::ring::driver::RingJob;
use ringtmp_strategy::ring::partition::StagePlan;
use ringtmp_strategy::ring::schedule::Schedule;

fn steps(cfg: &TrainConfig, global_batch: usize, data: &Dataset) -> (u64, u64, u64) {
    let per_epoch = (data.train.len() / global_batch) as u64;
    let schedule = per_epoch * u64::from(cfg.epochs);
    (
        per_epoch,
        schedule,
        cfg.max_steps.unwrap_or(schedule).min(schedule),
    )
}

/// A ring job for `cfg` on the stages `bounds` (`[0, 3, 7, 10]`: three stages).
pub fn ring_job(
    cfg: &TrainConfig,
    data: &Dataset,
    bounds: &[usize],
    schedule: Schedule,
    micro_batches: usize,
) -> RingJob {
    let (per_epoch, schedule_steps, total_steps) = steps(cfg, cfg.batch_size, data);
    RingJob {
        model: cfg.model.clone(),
        input: data.input,
        classes: data.classes,
        dataset: cfg.dataset.clone(),
        epochs: cfg.epochs,
        batch_size: cfg.batch_size,
        micro_batches,
        schedule,
        lr: cfg.lr,
        lr_schedule: cfg.schedule.clone(),
        warmup_steps: cfg.warmup_steps,
        optimizer: cfg.optimizer.clone(),
        threads: cfg.threads,
        seed: cfg.seed,
        partition: bounds
            .windows(2)
            .enumerate()
            .map(|(r, w)| StagePlan {
                rank: r as u32,
                start: w[0],
                end: w[1],
                predicted_seconds: 0.0,
                predicted_bytes: 0,
            })
            .collect(),
        head: None,
        node_speeds: vec![1.0; bounds.len() - 1],
        total_steps,
        schedule_steps,
        steps_per_epoch: per_epoch,
        recv_timeout_secs: 30.0,
        checkpoint_every: cfg.checkpoint_every,
        keep_checkpoints: cfg.keep_checkpoints,
        defer_weight_grads: false,
        in_flight: 0,
        out: cfg.out.clone(),
        resume: None,
    }
}

/// A parameter-server job for `cfg` whose `batch_size` is the *global* batch, split over
/// `workers` (so that `local` on `cfg` is BSP's oracle).
///
/// # Panics
/// If the global batch does not split evenly.
pub fn ps_job(
    cfg: &TrainConfig,
    data: &Dataset,
    servers: usize,
    workers: usize,
    consistency: Consistency,
) -> PsJob {
    assert_eq!(
        cfg.batch_size % workers,
        0,
        "the global batch splits evenly"
    );
    let (per_epoch, schedule_steps, total_steps) = steps(cfg, cfg.batch_size, data);
    PsJob {
        model: cfg.model.clone(),
        input: data.input,
        classes: data.classes,
        servers,
        workers,
        worker_batch: cfg.batch_size / workers,
        lr: cfg.lr,
        lr_schedule: cfg.schedule.clone(),
        warmup_steps: cfg.warmup_steps,
        optimizer: cfg.optimizer.clone(),
        threads: cfg.threads,
        seed: cfg.seed,
        consistency,
        total_steps,
        schedule_steps,
        steps_per_epoch: per_epoch,
        recv_timeout_secs: 30.0,
        drop_dead_workers: false,
        node_speeds: Vec::new(),
        checkpoint_every: cfg.checkpoint_every,
        keep_checkpoints: cfg.keep_checkpoints,
        out: cfg.out.clone(),
        dataset: cfg.dataset.clone(),
        resume: None,
        first_step: 0,
    }
}
