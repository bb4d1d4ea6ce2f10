//! The ring's settings, resolved once from the run's configuration, the ring's options and the
//! cluster: how the nodes form rings, how the copies of a stage keep together, the schedule, the
//! micro-batches and the window in flight, and the defaults that follow (threads per node, the
//! learning rate of rings of rings, the async schedule's momentum). The plan and the profile
//! every node times at rendezvous both start from here, so they time and plan the same thing.

use ringtmp_data::Dataset;

use super::RingOptions;
use super::profile::InFlight;
use super::replica_sync::ReplicaSync;
use crate::run::schedule::Schedule;
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, PlanReport};
use ringtmp_contract::error::{Error, Result};

/// SGD momentum of the async schedule when the user gives none.
///
/// A micro-batch's gradient is a few steps stale by the time it is applied, and staleness acts
/// as momentum of its own (Mitliagkas et al., "Asynchrony begets momentum", 2016): on top of
/// SGD's usual 0.9 it made short runs of deep models unstable. Measured (docs/BENCHMARKS.md):
/// digits, mlp-deep, 230 steps: 0.9 ended at 57–85% over three runs, 0.8 at 91.3–91.9%; MNIST
/// mlp, 2 epochs: 97.6% against 97.4%; MNIST mlp-deep, 1 epoch: 96.0% against 96.1%.
pub const ASYNC_MOMENTUM: f32 = 0.8;

/// Rows (positions) a micro-batch of a flushed schedule keeps at least when the default splits a
/// mini-batch into more micro-batches than nodes.
const MIN_MICRO_BATCH_ROWS: usize = 64;

/// What the ring's plan starts from.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Nodes in the run.
    pub all_nodes: u32,
    /// Rings (`--replicas`), each of `nodes` nodes.
    pub replicas: usize,
    /// Nodes per ring: the partition is planned once, for the first ring's.
    pub nodes: u32,
    /// Rings of rings: average the copies' parameters every this many mini-batches (0: their
    /// gradients before every step).
    pub average_every: u64,
    /// Rings of rings: start a gossip exchange every this many mini-batches (0: no gossip).
    pub gossip_every: u64,
    /// Rings of rings under `--replica-sync diloco:H`: the outer optimizer the copies' averages
    /// go through every `average_every` mini-batches.
    pub outer_sync: Option<ringtmp_collective::outer::OuterConfig>,
    /// The pipeline schedule.
    pub schedule: Schedule,
    /// Micro-batches per mini-batch.
    pub micro_batches: usize,
    /// Rows a micro-batch holds.
    pub rows: usize,
    /// Micro-batches in flight at the first stage (the async default is refined by the plan).
    pub in_flight: usize,
    /// The window memory is planned for.
    pub in_flight_planned: InFlight,
    /// Optimizer steps per micro-batch (1 under async, 1/M under the flushed schedules).
    pub steps_per_micro_batch: f64,
}

impl Settings {
    /// Whether the copies of a stage gossip.
    pub fn gossip(&self) -> bool {
        self.gossip_every > 0
    }
}

/// Threads per node: the user's, or the machine's cores shared by the local nodes.
fn threads(cfg: &mut TrainConfig, cluster: &Cluster) {
    if cluster.threads.is_none() {
        // The local nodes share this machine's cores: split them instead of oversubscribing.
        cfg.threads = (cluster.cores / cluster.nodes.max(1) as usize).max(1);
    }
}

/// The schedule for these options with `replicas` rings, before its checks.
fn chosen_schedule(args: &RingOptions, replicas: usize, clipping: bool) -> Schedule {
    let syncing = replicas > 1
        && args
            .replica_sync
            .is_some_and(|s| s != ReplicaSync::Gradients);
    match (args.schedule, replicas) {
        (s, _) if syncing => s.unwrap_or(Schedule::Async),
        (None, r) if r > 1 || clipping => Schedule::OneFOneB,
        (s, _) => s.unwrap_or(Schedule::Async),
    }
}

/// Micro-batches per mini-batch when the user names none. Async pipelines whole mini-batches
/// (each its own step, `nodes` of them in flight), so one micro-batch per mini-batch keeps the
/// GEMMs at full size. The flushed schedules need several per mini-batch to fill the pipeline:
/// one per node; for a language model more, while each still holds at least 64 positions
/// (`gpt-cpu`'s 12 windows of 64 become 12 micro-batches, which on two shared cores trained at
/// 0.95× of `local` where 2 gave 0.69×).
fn default_micro_batches(
    schedule: Schedule,
    nodes: usize,
    batch: usize,
    positions: usize,
) -> usize {
    // Never more micro-batches than the batch has rows: a ring of more nodes than a language
    // model's 12 windows then runs 12 micro-batches of one window.
    match schedule {
        Schedule::Async => 1,
        Schedule::Gpipe | Schedule::OneFOneB if positions > 1 => nodes
            .max(batch * positions / MIN_MICRO_BATCH_ROWS)
            .min(batch),
        Schedule::Gpipe | Schedule::OneFOneB => nodes.min(batch),
    }
}

/// The rows a micro-batch of this ring holds, and its threads, without the plan's checks: what
/// every node times at rendezvous before the plan is made.
pub fn profiled_rows(
    cfg: &mut TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
) -> Result<usize> {
    threads(cfg, cluster);
    let nodes = cluster.nodes.max(1);
    let replicas = args.rings(nodes)?.max(1);
    let micro_batches = args
        .micro_batches
        .unwrap_or(default_micro_batches(
            chosen_schedule(args, replicas, cfg.clip_grad_norm.is_some()),
            nodes as usize / replicas,
            cfg.batch_size,
            ringtmp_contract::sequence_of(data).unwrap_or(1),
        ))
        .max(1);
    Ok(cfg.batch_size.div_ceil(micro_batches))
}

/// Resolves the ring's settings, adjusting `cfg`'s defaults that depend on them (threads, the
/// learning rate of rings that step together, the async momentum), and says in `report` what it
/// chose.
#[expect(
    clippy::too_many_lines,
    reason = "every ring option resolved against the others in order; goes with typed arguments"
)]
pub fn resolve(
    cfg: &mut TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<Settings> {
    threads(cfg, cluster);
    let all_nodes = cluster.nodes;
    if all_nodes < 2 {
        return Err(Error::Config(
            "--strategy ring needs --nodes of at least 2".into(),
        ));
    }
    args.check()?;
    // Rings of rings: the partition is planned once for one ring of `nodes / R`.
    let replicas = args.rings(all_nodes)?;
    if replicas == 0
        || !(all_nodes as usize).is_multiple_of(replicas)
        || all_nodes as usize / replicas < 2
    {
        return Err(Error::Config(format!(
            "--replicas {replicas}: --nodes {all_nodes} must split into rings of at least 2 \
             nodes each"
        )));
    }
    let nodes = all_nodes / replicas as u32;
    let (average_every, gossip_every, outer_sync) =
        args.replica_sync.map_or((0, 0, None), ReplicaSync::periods);
    let (average_every, gossip_every, outer_sync) =
        if (average_every > 0 || gossip_every > 0) && replicas < 2 {
            // One ring (a sweep's smallest count under --ring-nodes): nothing to keep together.
            report.note("--replica-sync: one ring, no copies to keep together");
            (0, 0, None)
        } else {
            (average_every, gossip_every, outer_sync)
        };
    let gossip = gossip_every > 0;
    if gossip && replicas % 2 != 0 {
        return Err(Error::Config(format!(
            "--replica-sync adpsgd: the copies of a stage gossip on AD-PSGD's bipartite graph \
             (copies in even rings ask, those in odd rings answer), which needs an even number \
             of rings, not {replicas}; use every:K for an odd number"
        )));
    }
    let clipping = cfg.clip_grad_norm.is_some();
    let chosen = chosen_schedule(args, replicas, clipping);
    if clipping && chosen == Schedule::Async {
        return Err(Error::Config(
            "--clip-grad-norm needs a flushed schedule on the ring (--schedule 1f1b or gpipe): \
             under async every micro-batch updates each stage at its own time, so no step has \
             one gradient whose global norm all stages could share without stopping the \
             pipeline (--clip-grad-norm 0 trains without clipping)"
                .into(),
        ));
    }
    let schedule = match (args.schedule, replicas) {
        (s, r) if r > 1 && (average_every > 0 || gossip) => {
            let schedule = s.unwrap_or(Schedule::Async);
            let how = if gossip {
                format!(
                    "gossip their parameters (AD-PSGD's pairs, an exchange started every \
                     {gossip_every} mini-batch(es), nobody waiting) and average at the end"
                )
            } else if let Some(outer) = outer_sync {
                format!(
                    "take one DiLoCo outer step together every {average_every} mini-batch(es) \
                     (the mean of their pseudo-gradients through SGD lr {} momentum {}{}{})",
                    outer.lr,
                    outer.momentum,
                    if outer.nesterov { ", Nesterov" } else { "" },
                    if outer.follow_schedule {
                        ", following the inner schedule"
                    } else {
                        ""
                    }
                )
            } else {
                format!("average their parameters every {average_every} mini-batch(es)")
            };
            report.note(format!(
                "--replicas {r}: each ring trains on its own ({} schedule) and the copies of a \
                 stage {how}",
                schedule.name()
            ));
            schedule
        }
        (Some(Schedule::Async), r) if r > 1 => {
            return Err(Error::Config(
                "--replicas averages each stage's gradients at a flush: it needs --schedule \
                 1f1b or gpipe, or --replica-sync every:K (rings that train on their own and \
                 average their parameters every K mini-batches)"
                    .into(),
            ));
        }
        (None, r) if r > 1 => {
            report.note(format!(
                "--replicas {r}: schedule 1f1b (rings of rings step together)"
            ));
            Schedule::OneFOneB
        }
        (None, _) if clipping => {
            report.note(concat!(
                "schedule 1f1b: clipping by the global norm needs every stage's gradient of a ",
                "step before any stage updates (a flush)"
            ));
            Schedule::OneFOneB
        }
        (s, _) => s.unwrap_or(Schedule::Async),
    };
    debug_assert_eq!(
        schedule, chosen,
        "profile_request must time what the plan runs"
    );
    if replicas > 1 && args.master_holds_head == Some(true) {
        return Err(Error::Config(
            "--replicas does not go together with --master-holds-head yet".into(),
        ));
    }
    if replicas > 1
        && let Some(every) = args.stage_replicas
    {
        if average_every == 0 || gossip {
            return Err(Error::Config(
                "--stage-replicas with --replicas heals a ring while the others go on, which \
                 needs rings that train on their own between synchronisations (--replica-sync \
                 every:K or diloco:H): under --replica-sync gradients every ring would have to \
                 go back with the healed one, and gossip has no synchronisation to go back to"
                    .into(),
            ));
        }
        if every != average_every {
            report.note(format!(
                "--stage-replicas with --replicas: a replication round follows every \
                 synchronisation (every {average_every} mini-batches, not {every}), so a healed \
                 ring never goes back past one"
            ));
        }
    }
    if replicas > 1
        && average_every == 0
        && !gossip
        && let Some(note) = ringtmp_contract::batch_scaling::scale_defaults(
            cfg,
            replicas,
            ringtmp_contract::batch_scaling::Updates::Synchronous,
        )
    {
        // The defaults are one ring's batch's; a step here averages R of them, as the
        // data-parallel strategies' steps do.
        report.note(format!("rings of rings: {note}"));
    }
    if schedule == Schedule::Async
        && cfg.momentum == ringtmp_contract::Origin::Default
        && let ringtmp_model::OptimizerConfig::Sgd { momentum, .. } = &mut cfg.optimizer
    {
        *momentum = ASYNC_MOMENTUM;
        report.note(format!(
            "async schedule: SGD momentum {ASYNC_MOMENTUM} (the default for stale updates; \
             --momentum sets it)"
        ));
    }
    let micro_batches = args.micro_batches.unwrap_or(default_micro_batches(
        schedule,
        nodes as usize,
        cfg.batch_size,
        ringtmp_contract::sequence_of(data).unwrap_or(1),
    ));
    if micro_batches == 0 || micro_batches > cfg.batch_size {
        return Err(Error::Config(format!(
            "--micro-batches must be between 1 and the batch size {}",
            cfg.batch_size
        )));
    }
    let rows = cfg.batch_size.div_ceil(micro_batches);
    let in_flight = match schedule {
        Schedule::Gpipe => micro_batches,
        // The first stage's window (`StagePolicy::in_flight_limit`), the largest.
        Schedule::OneFOneB => (nodes as usize + 1).min(micro_batches),
        Schedule::Async => args.in_flight.unwrap_or(nodes as usize + 1),
    };
    // Memory is planned for the window the chosen ring keeps: the async default, one
    // micro-batch per node and one more (`Plan::window`), follows the number of nodes used, so
    // idle nodes cost the others nothing.
    let in_flight_planned = match (schedule, args.in_flight) {
        (Schedule::Async, None) => InFlight::PerNode { plus: 1 },
        (Schedule::OneFOneB, None) => InFlight::OneFOneB { micro_batches },
        _ => InFlight::Fixed(in_flight),
    };
    let steps_per_micro_batch = match schedule {
        Schedule::Async => 1.0,
        Schedule::Gpipe | Schedule::OneFOneB => 1.0 / micro_batches as f64,
    };
    Ok(Settings {
        all_nodes,
        replicas,
        nodes,
        average_every,
        gossip_every,
        outer_sync,
        schedule,
        micro_batches,
        rows,
        in_flight,
        in_flight_planned,
        steps_per_micro_batch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flushed ring splits its batch into at least one micro-batch per node, never into more
    /// than the batch has rows (16 nodes and a language model's 12 windows: 12).
    #[test]
    fn default_micro_batches_never_exceed_the_batch() {
        assert_eq!(default_micro_batches(Schedule::OneFOneB, 4, 64, 1), 4);
        assert_eq!(default_micro_batches(Schedule::Gpipe, 128, 64, 1), 64);
        assert_eq!(default_micro_batches(Schedule::OneFOneB, 16, 12, 64), 12);
        // 12 windows of 64 positions: a window (64 rows) a micro-batch already at 2 nodes.
        assert_eq!(default_micro_batches(Schedule::OneFOneB, 2, 12, 64), 12);
        assert_eq!(default_micro_batches(Schedule::Async, 16, 12, 64), 1);
    }
}
