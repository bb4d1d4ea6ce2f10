//! Stage replicas (`--stage-replicas`) under a death or a freeze at every point of a replication
//! round, for every schedule, on the seeded simulated network.
//!
//! A replication round is a protocol of its own: the master orders every node at once, each node
//! sends its snapshot to its predecessor with a token behind it, and each node tells the master
//! when its successor's token is in. Each case here places one fault at one of those messages
//! (the master's order to a node, a node's replica frame, its token, its word to the master), on
//! one node (any non-master rank, whichever end of that message), at the moment the message
//! leaves or while it is still on the link, as a death or as a freeze. Links carry a seeded
//! jitter, so orders across links differ from case to case (a node's successor's token may reach
//! it before the master's order does). Every case must heal: the master and every survivor end
//! well, one heal is recorded naming the lost node, the run's record (`summary.json`,
//! `metrics.jsonl`) covers the whole run with the heal marked, and with a synchronous schedule
//! the healed run computes what one process computes alone.
//!
//! The cases are a grid over those points (every message of the second round, every victim,
//! both kinds of fault, both offsets) for each schedule; the jitter of each case derives from
//! the test's seed (`RINGTMP_SEED` replays a failure).

use std::time::Duration;

use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_testkit::fixtures::{deep_mlp, digits, max_rel_diff};
use ringtmp_testkit::jobs::ring_job;
use ringtmp_testkit::nodes::Backend;
use ringtmp_testkit::{oracle, run};
use ringtmp_transport::sim::{Fault, SendTrigger, SimConfig, test_seed};

/// Mini-batches between replication rounds; the faults fall in the second round.
const EVERY: u64 = 5;
/// Nodes of the ring: the master and three.
const NODES: u32 = 4;
/// Stage bounds of deep_mlp(3, 16): flatten+linear | relu+linear | relu+linear | relu+linear.
const BOUNDS: [usize; 5] = [0, 2, 4, 6, 8];

fn config(out: &std::path::Path) -> TrainConfig {
    let mut cfg = ringtmp_testkit::fixtures::train_config(deep_mlp(3, 16), 32, 24, out);
    cfg.checkpoint_every = 24;
    cfg
}

/// The messages of the second replication round, as triggers.
fn round_messages() -> Vec<(SendTrigger, &'static str)> {
    let mut points = Vec::new();
    for k in 1..NODES {
        // The master's order to node k (one per round).
        points.push((
            SendTrigger {
                from: 0,
                to: Some(k),
                what: "Replicate",
                nth: 2,
            },
            "the master's order",
        ));
        // Node k's snapshot to its predecessor (one per round).
        points.push((
            SendTrigger {
                from: k,
                to: Some(k - 1),
                what: "Params tensor",
                nth: 2,
            },
            "the replica",
        ));
        // Node k's token behind it, then its word to the master (two a round).
        for (nth, what) in [(3, "the token"), (4, "the word")] {
            points.push((
                SendTrigger {
                    from: k,
                    to: None,
                    what: "Replicate",
                    nth,
                },
                what,
            ));
        }
    }
    points
}

/// SplitMix64, for the cases' seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn heals_at_every_point_of_a_round(schedule: Schedule, seed: u64) {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(&tmp.path().join("local"));
    let exact = schedule != Schedule::Async;
    let oracle = exact.then(|| oracle::local_params(&cfg, &data));
    let mut job = ring_job(&cfg, &data, &BOUNDS, schedule, 4);
    job.replica_every = EVERY;
    if schedule == Schedule::Async {
        job.in_flight = 3;
    }
    let mut cases = 0;
    // `RINGTMP_CASE=N` runs case N alone (with the seed it printed).
    let only: Option<usize> = std::env::var("RINGTMP_CASE")
        .ok()
        .and_then(|c| c.parse().ok());
    let mut failures = Vec::new();
    for (trigger, what) in round_messages() {
        for victim in 1..NODES {
            for stall in [false, true] {
                // At the moment it leaves, and while it is on the link (1 ms latency and up to 4 ms
                // of jitter).
                for after in [Duration::ZERO, Duration::from_micros(1300)] {
                    cases += 1;
                    if only.is_some_and(|o| o != cases) {
                        continue;
                    }
                    let case_seed = mix(seed ^ (cases as u64).wrapping_mul(0x1000_0001));
                    let mut sim = SimConfig::new(case_seed);
                    // A jitter larger than the latency: the order of messages on different links
                    // varies from case to case.
                    sim.jitter = Duration::from_millis(4);
                    sim.bandwidth_bps = Some(100_000_000);
                    sim.faults.push(Fault::OnSend {
                        rank: victim,
                        stall,
                        trigger,
                        after,
                    });
                    let out = tmp.path().join(format!("case-{cases}"));
                    let ran = run::healing_ring_nodes(&Backend::Sim(sim), &job, &data, &out);
                    let name = format!(
                        "{schedule:?}, case {cases} (seed {case_seed}): rank {victim} {} {after:?} \
                         after {what} from rank {} ({trigger:?})",
                        if stall { "froze" } else { "died" },
                        trigger.from
                    );
                    if let Err(e) = check(&ran.results, victim, oracle.as_deref(), &out, &cfg) {
                        eprintln!("FAILED {name}: {e}");
                        failures.push(name);
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{schedule:?}: {} of {cases} cases did not heal:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("{schedule:?}: all {cases} cases healed");
}

/// One case's outcome: the master and every survivor ended well, one heal names the victim, and
/// (synchronous schedules) the parameters are one process's.
fn check(
    results: &[Result<Option<ringtmp_metrics::Summary>, String>],
    victim: u32,
    oracle: Option<&[f32]>,
    out: &std::path::Path,
    cfg: &TrainConfig,
) -> Result<(), String> {
    for (rank, result) in results.iter().enumerate() {
        if rank as u32 != victim
            && let Err(e) = result
        {
            return Err(format!("rank {rank} failed: {e}"));
        }
    }
    let summary = results[0]
        .clone()
        .map_err(|e| format!("the master failed: {e}"))?
        .ok_or("the master wrote no summary")?;
    if summary.heals.len() != 1 || summary.heals[0].rank != victim {
        return Err(format!(
            "expected one heal around rank {victim}: {:?}",
            summary.heals
        ));
    }
    // The record covers the whole run: every mini-batch's samples (those trained again after
    // the heal too), one start and the heal in one event log.
    if summary.samples < 24 * 32 {
        return Err(format!(
            "summary.json counts {} samples of 768",
            summary.samples
        ));
    }
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).map_err(|e| e.to_string())?;
    let count = |kind: &str| log.matches(&format!("\"event\":\"{kind}\"")).count();
    if (count("start"), count("heal")) != (1, 1) {
        return Err(format!(
            "metrics.jsonl holds {} start and {} heal events",
            count("start"),
            count("heal")
        ));
    }
    if !summary.final_train_loss.is_finite() {
        return Err(format!("final training loss {}", summary.final_train_loss));
    }
    if let Some(oracle) = oracle {
        let params = oracle::checkpoint_params(out, cfg, &ringtmp_testkit::fixtures::digits());
        let diff = max_rel_diff(&params, oracle);
        if diff >= 1e-4 {
            return Err(format!("parameters {diff:.2e} from one process's"));
        }
    }
    Ok(())
}

#[test]
fn gpipe_heals_a_death_or_a_freeze_at_every_point_of_a_replication_round() {
    heals_at_every_point_of_a_round(Schedule::Gpipe, test_seed(40));
}

#[test]
fn one_f_one_b_heals_a_death_or_a_freeze_at_every_point_of_a_replication_round() {
    heals_at_every_point_of_a_round(Schedule::OneFOneB, test_seed(41));
}

#[test]
fn async_heals_a_death_or_a_freeze_at_every_point_of_a_replication_round() {
    heals_at_every_point_of_a_round(Schedule::Async, test_seed(42));
}
