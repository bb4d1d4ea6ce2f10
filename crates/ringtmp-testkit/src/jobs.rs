//! Jobs for the distributed strategies derived from one [`TrainConfig`], so that a test's oracle
//! (`local` on that configuration) and the strategy under test cannot disagree on the model,
//! data order, optimizer or schedule.

use ringtmp_data::Dataset;
use ringtmp_strategy::allreduce::AllReduceJob;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::param_server::driver::PsJob;
use ringtmp_strategy::ring::plan::partition::StagePlan;
use ringtmp_strategy::ring::run::driver::RingJob;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_strategy::{RunSpec, TrainConfig};

/// A ring job for `cfg` on the stages `bounds` (`[0, 3, 7, 10]`: three stages).
///
/// # Panics
/// If `cfg` does not fit the data.
pub fn ring_job(
    cfg: &TrainConfig,
    data: &Dataset,
    bounds: &[usize],
    schedule: Schedule,
    micro_batches: usize,
) -> RingJob {
    RingJob {
        spec: RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data"),
        micro_batches,
        schedule,
        partition: bounds
            .windows(2)
            .enumerate()
            .map(|(r, w)| StagePlan {
                rank: r as u32,
                start: w[0],
                end: w[1],
                predicted_seconds: 0.0,
                predicted_bytes: 0,
                predicted_link_seconds: 0.0,
            })
            .collect(),
        cuts_inside: Vec::new(),
        head: None,
        node_speeds: vec![1.0; bounds.len() - 1],
        defer_weight_grads: false,
        in_flight: 0,
        replica_every: 0,
        replicas: 1,
        average_every: 0,
        idle_nodes: 0,
        gossip_every: 0,
        outer_sync: None,
        eval_rows: 0,
        ring: 0,
    }
}

/// A parameter-server job for `cfg` whose `batch_size` is the *global* batch, split over
/// `workers` (so that `local` on `cfg` is BSP's oracle).
///
/// # Panics
/// If the global batch does not split evenly, or does not fit the data.
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
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data");
    spec.config.batch_size = cfg.batch_size / workers;
    PsJob {
        spec,
        servers,
        workers,
        consistency,
        node_speeds: Vec::new(),
        drop_dead_workers: false,
    }
}

/// An all-reduce job for `cfg` whose `batch_size` is the *global* batch, split over `workers`
/// (so that `local` on `cfg` is its oracle); buckets of `bucket_bytes`.
///
/// # Panics
/// If the global batch does not split evenly, or does not fit the data.
pub fn allreduce_job(
    cfg: &TrainConfig,
    data: &Dataset,
    workers: usize,
    bucket_bytes: usize,
    overlap: bool,
) -> AllReduceJob {
    assert_eq!(
        cfg.batch_size % workers,
        0,
        "the global batch splits evenly"
    );
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data");
    spec.config.batch_size = cfg.batch_size / workers;
    AllReduceJob {
        spec,
        workers,
        bucket_bytes,
        overlap,
        node_speeds: vec![1.0; workers],
    }
}

/// A DiLoCo job for `cfg` whose `batch_size` is the *global* batch, split over `workers`: `h`
/// inner steps between synchronisations, the outer optimizer `outer`, `fragments` fragments,
/// buckets of `bucket_bytes`, pseudo-gradients in f32.
///
/// # Panics
/// If the global batch does not split evenly, or does not fit the data.
pub fn diloco_job(
    cfg: &TrainConfig,
    data: &Dataset,
    workers: usize,
    h: u64,
    outer: ringtmp_strategy::collective::outer::OuterConfig,
    fragments: usize,
    bucket_bytes: usize,
) -> ringtmp_strategy::diloco::DilocoJob {
    assert_eq!(
        cfg.batch_size % workers,
        0,
        "the global batch splits evenly"
    );
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data");
    spec.config.batch_size = cfg.batch_size / workers;
    ringtmp_strategy::diloco::DilocoJob {
        spec,
        workers,
        inner_steps: h,
        outer,
        fragments,
        overlap: 0,
        mix: 0.5,
        outer_dtype: ringtmp_strategy::diloco::OuterDtype::F32,
        inner_seconds: None,
        bucket_bytes,
        node_speeds: vec![1.0; workers],
    }
}

/// A D-PSGD job for `cfg` whose `batch_size` is the *global* batch, split over `workers`.
///
/// # Panics
/// If the global batch does not split evenly, or does not fit the data.
pub fn dpsgd_job(
    cfg: &TrainConfig,
    data: &Dataset,
    workers: usize,
    topology: ringtmp_strategy::collective::mixing::Topology,
) -> ringtmp_strategy::gossip::DpsgdJob {
    assert_eq!(
        cfg.batch_size % workers,
        0,
        "the global batch splits evenly"
    );
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data");
    spec.config.batch_size = cfg.batch_size / workers;
    ringtmp_strategy::gossip::DpsgdJob {
        spec,
        workers,
        topology,
        node_speeds: vec![1.0; workers],
        drop_dead_workers: false,
    }
}

/// An AD-PSGD job of `workers` workers splitting `cfg.batch_size` (each worker's mini-batch is
/// its share, so N iterations cover one global batch).
pub fn adpsgd_job(
    cfg: &TrainConfig,
    data: &Dataset,
    workers: usize,
) -> ringtmp_strategy::gossip::AdpsgdJob {
    assert_eq!(
        cfg.batch_size % workers,
        0,
        "the global batch splits evenly"
    );
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size).expect("the run fits the data");
    spec.config.batch_size = cfg.batch_size / workers;
    ringtmp_strategy::gossip::AdpsgdJob {
        spec,
        workers,
        node_speeds: vec![1.0; workers],
    }
}
