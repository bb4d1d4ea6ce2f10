//! Automatic restarts (`ringtmp train --max-restarts K`), the launcher's side: where the failed
//! attempt stood (from `metrics.jsonl`), how often to checkpoint when the user did not say, and
//! the restarts recorded in `summary.json` once the run has completed.
//!
//! The restarted attempt is an ordinary resume (bit-identical to an uninterrupted run for the
//! synchronous schedules), so all that is new here is bookkeeping; every figure comes from the
//! run's own files and clocks.

use std::path::Path;

use anyhow::{Context, Result};
use ringtmp_metrics::Restart;
use ringtmp_strategy::Job;
use serde_json::Value;

use crate::args::TrainArgs;
use crate::request::RunRequest;

/// Checkpoints per run when `--max-restarts` chooses the interval: a failure then redoes at most
/// a twentieth of the run.
const CHECKPOINTS_PER_RUN: u64 = 20;
/// Checkpoints kept when `--max-restarts` chooses the interval: the newest, and one more in case
/// the newest does not verify.
const CHECKPOINTS_KEPT: usize = 2;

/// With restarts allowed and no `--checkpoint-every`, checkpoints every twentieth of the run
/// (keeping the two newest unless `--keep-checkpoints` says otherwise), in the request and in
/// `job`; says so on the `first` attempt.
pub fn choose_checkpoints(request: RunRequest, job: &mut Job, first: bool) -> RunRequest {
    let given = &request.output.args;
    if given.checkpoint_every.is_some_and(|n| n > 0) {
        return request;
    }
    let every = job.spec().total_steps.div_ceil(CHECKPOINTS_PER_RUN).max(1);
    let keep = given.keep_checkpoints.unwrap_or(CHECKPOINTS_KEPT);
    let config = &mut job.spec_mut().config;
    config.checkpoint_every = every;
    config.keep_checkpoints = Some(keep);
    if first {
        eprintln!(
            "--max-restarts without --checkpoint-every: checkpointing every {every} steps (a \
             failure redoes at most 1/{CHECKPOINTS_PER_RUN} of the run), keeping the {keep} newest"
        );
    }
    request.checkpointing(every, keep)
}

/// The crashes injected into attempt `attempt`: `(rank, milliseconds after the links are up)`,
/// from `--crash-rank` (attempt 0) or entry `attempt` of `--crash-plan` (`RANK:MS`, or several
/// joined by `+` for one attempt: `2:60000+3:120000`).
pub fn crash_for(args: &TrainArgs, attempt: usize) -> Result<Vec<(u32, u64)>> {
    if let Some(plan) = &args.faults.crash_plan {
        let Some(entry) = plan.split(',').nth(attempt) else {
            return Ok(Vec::new());
        };
        return entry
            .split('+')
            .map(|kill| {
                kill.split_once(':')
                    .and_then(|(r, ms)| Some((r.trim().parse().ok()?, ms.trim().parse().ok()?)))
                    .ok_or_else(|| anyhow::anyhow!("--crash-plan entry {kill:?}: expected RANK:MS"))
            })
            .collect();
    }
    Ok((attempt == 0)
        .then_some(args.faults.crash_rank)
        .flatten()
        .map(|rank| vec![(rank, args.faults.crash_after_ms.unwrap_or(1000))])
        .unwrap_or_default())
}

/// The last step `metrics.jsonl` in `out` records in any event (steps, evaluations,
/// checkpoints; the parameter server logs no per-step events), or the newest checkpoint's when
/// that is later (0 if neither).
pub fn last_step(out: &Path) -> u64 {
    let logged = events(out)
        .filter_map(|e| e["step"].as_u64())
        .max()
        .unwrap_or(0);
    let (newest, _) = ringtmp_model::checkpoint::newest_verified(&out.join("checkpoints"));
    logged.max(newest.map_or(0, |(_, m)| m.step))
}

/// The run's events, skipping lines that do not parse (a line cut short by the failure).
fn events(out: &Path) -> impl Iterator<Item = Value> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect::<Vec<_>>()
        .into_iter()
}

/// Adds the restarts to the completed run's `summary.json`, each with its downtime: from the
/// failure (its Unix time beside it) to the start of the first attempt that began after it.
pub fn record(out: &Path, restarts: Vec<(Restart, f64)>) -> Result<()> {
    let starts: Vec<f64> = events(out)
        .filter(|e| e["event"] == "start")
        .filter_map(|e| e["unix_time"].as_f64())
        .collect();
    let path = out.join("summary.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    // Edited as JSON, not through `Summary`: a summary may hold nulls (a NaN loss) that the
    // typed form does not read back.
    let mut summary: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let restarts: Vec<Restart> = restarts
        .into_iter()
        .map(|(mut restart, failed_at)| {
            if let Some(start) = starts.iter().find(|s| **s >= failed_at) {
                restart.downtime_seconds = start - failed_at;
            }
            restart
        })
        .collect();
    let lost: f64 = restarts
        .iter()
        .map(|r| r.work_lost_seconds + r.downtime_seconds)
        .sum();
    println!(
        "[launcher] {} restart(s); {:.1}s lost to them (work redone and downtime): see summary.json",
        restarts.len(),
        lost
    );
    if let Some(fields) = summary.as_object_mut() {
        fields.insert("restarts".into(), serde_json::to_value(&restarts)?);
    }
    ringtmp_model::checkpoint::write_atomic(
        &path,
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    Ok(())
}
