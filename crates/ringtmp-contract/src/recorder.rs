//! The run recorder: the one piece every strategy's reporting rank writes its run through —
//! `metrics.jsonl` (start, steps, evaluations, checkpoints, end), the evaluation cadence, the
//! first time the target accuracy was reached, the mean loss of the last epoch, and
//! `summary.json` with the fields every summary shares.
//!
//! Invariants: evaluations happen at every `eval_every`-th step, at every epoch end and at the
//! last step (so `time_to_target` means the same in every strategy); the event log is flushed per
//! line, so a crashed run keeps everything up to its last event; a resumed run appends to it.

use std::path::PathBuf;

use ringtmp_metrics::{EventLog, LanguageSummary, RegressionSummary, Summary};
use ringtmp_model::OptimizerConfig;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::evaluation::Score;
use crate::spec::RunSpec;

/// First attainment of the target accuracy, and the best and latest accuracy.
#[derive(Clone, Debug)]
pub struct Tracker {
    target: f64,
    /// Latest evaluation.
    pub last: f64,
    /// Best evaluation (`-inf` before the first: a regression's R² may be negative).
    pub best: f64,
    /// `(step, training seconds)` of the first evaluation at or above the target.
    pub reached: Option<(u64, f64)>,
    /// Latest and lowest test (validation) loss.
    pub loss: Option<(f64, f64)>,
    /// Regression: the latest and lowest root mean squared error, and the latest mean absolute
    /// error (in the target's units).
    pub errors: Option<(f64, f64, f64)>,
    /// The step of the evaluation with the lowest loss so far.
    pub best_loss_step: Option<u64>,
    /// Evaluations since the loss last fell.
    pub since_best: u32,
}

/// What an evaluation means for the run, for its driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Verdict {
    /// `--early-stop`'s patience is spent: the driver ends the run after this step.
    pub stop: bool,
    /// The driver takes a checkpoint of this step (if none is due anyway): its validation
    /// loss is the lowest yet and the run keeps its best (recording the checkpoint marks it
    /// `best`), or the run stops here; never when the run writes no checkpoints.
    pub checkpoint: bool,
}

impl Tracker {
    /// Tracks attainment of `target`.
    pub fn new(target: f64) -> Self {
        Self {
            target,
            last: 0.0,
            best: f64::NEG_INFINITY,
            reached: None,
            loss: None,
            errors: None,
            best_loss_step: None,
            since_best: 0,
        }
    }

    /// Records an evaluation's loss after `step` steps; returns whether it is the lowest yet.
    pub fn record_loss(&mut self, loss: f64, step: u64) -> bool {
        let lowest = self.loss.is_none_or(|(_, b)| loss < b);
        let best = self.loss.map_or(loss, |(_, b)| b.min(loss));
        self.loss = Some((loss, best));
        if lowest {
            self.best_loss_step = Some(step);
            self.since_best = 0;
        } else {
            self.since_best += 1;
        }
        lowest
    }

    /// Records an evaluation.
    pub fn record(&mut self, accuracy: f64, step: u64, train_seconds: f64) {
        self.last = accuracy;
        self.best = self.best.max(accuracy);
        if self.reached.is_none() && accuracy >= self.target {
            self.reached = Some((step, train_seconds));
        }
    }
}

/// Seconds since the Unix epoch (the start event's wall-clock time: a launcher that restarted the
/// run measures its downtime from it).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the run's earlier attempts (processes a launcher restarted) recorded in its event log:
/// a resumed run's record goes on from it, so `summary.json` describes the whole run, not the
/// part after the last restart.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Carried {
    /// Training seconds already spent (steps trained again after a failure included).
    pub train_seconds: f64,
    /// Samples already trained (the same).
    pub samples: u64,
    /// Wall seconds since the run first started (downtime between attempts included).
    pub wall_seconds: f64,
}

impl Carried {
    /// Reads the events of an earlier attempt from `log` (one JSON object a line): nothing when
    /// there is none. The steps of the current attempt start after `first_step`.
    fn from_log(log: &str, tracker: &mut Tracker, epoch: &mut (f64, u64), spec: &RunSpec) -> Self {
        let mut carried = Self::default();
        let mut first_start: Option<f64> = None;
        let first_step = spec.first_step();
        let epoch_start = first_step / spec.steps_per_epoch.max(1) * spec.steps_per_epoch.max(1);
        // The latest loss of each step of the epoch being resumed (a failure's redone steps
        // appear twice; the later counts).
        let mut losses = std::collections::BTreeMap::new();
        for event in log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        {
            let seconds = event["train_seconds"].as_f64();
            match event["event"].as_str() {
                Some("start") => {
                    first_start = first_start.or(event["unix_time"].as_f64());
                }
                Some("step") => {
                    carried.train_seconds = seconds.unwrap_or(carried.train_seconds);
                    carried.samples = event["samples"].as_u64().unwrap_or(carried.samples);
                    if let (Some(step), Some(loss)) =
                        (event["step"].as_u64(), event["loss"].as_f64())
                        && step > epoch_start
                        && step <= first_step
                    {
                        losses.insert(step, loss);
                    }
                }
                Some("eval") => {
                    if let (Some(step), Some(accuracy)) =
                        (event["step"].as_u64(), event["test_accuracy"].as_f64())
                        && step <= first_step
                    {
                        tracker.record(accuracy, step, seconds.unwrap_or(carried.train_seconds));
                        if let Some(loss) = event["test_loss"].as_f64() {
                            let _ = tracker.record_loss(loss, step);
                        }
                    }
                }
                _ => {}
            }
        }
        *epoch = (losses.values().sum(), losses.len() as u64);
        if let Some(start) = first_start {
            carried.wall_seconds = (unix_now() - start).max(0.0);
        }
        carried
    }
}

/// Writes a run's events and summary (on the rank that reports the run).
pub struct RunRecorder {
    log: EventLog,
    path: PathBuf,
    out: PathBuf,
    tracker: Tracker,
    spec: RunSpec,
    steps_per_epoch: u64,
    epoch_loss: f64,
    epoch_steps: u64,
    last_epoch_loss: f64,
    carried: Carried,
    /// The best checkpoint so far when it was written only for being the best (no checkpoint
    /// was due at its step): a better one replaces it, so a run keeps one best, not each.
    best_only: Option<PathBuf>,
}

impl RunRecorder {
    /// Opens `metrics.jsonl` in the run's output directory (appending when the run resumes) and
    /// writes the start event: `strategy` and `start`'s fields beside the run's own.
    pub fn open(spec: &RunSpec, strategy: &str, start: Value) -> Result<Self> {
        let out = spec.out.clone();
        std::fs::create_dir_all(&out).map_err(|e| Error::Io {
            path: out.clone(),
            source: e,
        })?;
        let path = out.join("metrics.jsonl");
        let resumed = spec.first_step() > 0;
        let mut tracker = Tracker::new(spec.target_accuracy);
        let mut epoch = (0.0, 0);
        // A restarted attempt of this run (its log is here) goes on with its record; a run
        // resumed into a new directory starts its own.
        let carried = match resumed.then(|| std::fs::read_to_string(&path)) {
            Some(Ok(log)) => Carried::from_log(&log, &mut tracker, &mut epoch, spec),
            _ => Carried::default(),
        };
        let log = EventLog::create(&path, resumed).map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })?;
        let mut recorder = Self {
            log,
            path,
            out,
            tracker,
            spec: spec.clone(),
            steps_per_epoch: spec.steps_per_epoch.max(1),
            epoch_loss: epoch.0,
            epoch_steps: epoch.1,
            last_epoch_loss: f64::NAN,
            carried,
            best_only: None,
        };
        let mut event = json!({"event": "start", "strategy": strategy, "model": spec.model.name,
            "dataset": spec.dataset, "batch_size": spec.batch_size, "seed": spec.seed,
            "threads": spec.threads, "first_step": spec.first_step(),
            "total_steps": spec.total_steps, "unix_time": unix_now(),
            "carried_train_seconds": carried.train_seconds, "carried_samples": carried.samples,
            "carried_wall_seconds": carried.wall_seconds});
        if let (Some(e), Value::Object(extra)) = (event.as_object_mut(), start) {
            e.extend(extra);
        }
        recorder.write(event)?;
        Ok(recorder)
    }

    /// Appends one event.
    pub fn write(&mut self, event: Value) -> Result<()> {
        self.log.write(&event).map_err(|e| Error::Io {
            path: self.path.clone(),
            source: e,
        })
    }

    /// Whether an evaluation is due once `done` steps are complete.
    pub fn eval_due(&self, done: u64) -> bool {
        self.spec.eval_due(done)
    }

    /// What earlier attempts of this run recorded: the driver's clocks and counters start from
    /// it.
    pub fn carried(&self) -> Carried {
        self.carried
    }

    /// The run's training seconds and samples, from this attempt's.
    pub fn run_figures(&self, train_seconds: f64, samples: u64) -> (f64, u64) {
        (
            self.carried.train_seconds + train_seconds,
            self.carried.samples + samples,
        )
    }

    /// Records a finished step (`done` steps complete), its mean training loss, and this
    /// attempt's training seconds and samples so far (the log holds the run's).
    pub fn step(
        &mut self,
        done: u64,
        loss: f64,
        lr: f32,
        (train_seconds, samples): (f64, u64),
    ) -> Result<()> {
        let (train_seconds, samples) = self.run_figures(train_seconds, samples);
        let epoch = (done - 1) / self.steps_per_epoch;
        self.epoch_loss += loss;
        self.epoch_steps += 1;
        if done.is_multiple_of(self.steps_per_epoch) {
            self.last_epoch_loss = self.epoch_loss / self.epoch_steps as f64;
            (self.epoch_loss, self.epoch_steps) = (0.0, 0);
        }
        self.write(
            json!({"event": "step", "step": done, "epoch": epoch, "loss": loss, "lr": lr,
            "train_seconds": train_seconds, "samples": samples}),
        )
    }

    /// Records an evaluation after `done` steps, at this attempt's training and wall seconds
    /// (the log and the time to target hold the run's).
    pub fn eval(
        &mut self,
        done: u64,
        score: Score,
        train_seconds: f64,
        wall_seconds: f64,
    ) -> Result<Verdict> {
        let train_seconds = self.carried.train_seconds + train_seconds;
        let wall_seconds = self.carried.wall_seconds + wall_seconds;
        self.tracker.record(score.accuracy, done, train_seconds);
        let epoch = done.saturating_sub(1) / self.steps_per_epoch;
        let loss = score.loss;
        let mut event = json!({"event": "eval", "step": done, "epoch": epoch,
            "test_accuracy": score.accuracy, "test_loss": loss, "train_seconds": train_seconds,
            "wall_seconds": wall_seconds});
        let lowest = loss.is_finite() && self.tracker.record_loss(loss, done);
        if let (Some(rmse), Some(mae)) = (score.rmse, score.mae) {
            let best = self.tracker.errors.map_or(rmse, |e| e.1.min(rmse));
            self.tracker.errors = Some((rmse, best, mae));
            event["test_r2"] = score.accuracy.into();
            event["test_rmse"] = rmse.into();
            event["test_mae"] = mae.into();
        }
        if self.spec.sequence.is_some() {
            let (perplexity, bits) = LanguageSummary::meaning(loss);
            event["perplexity"] = perplexity.into();
            event[format!("bits_per_{}", self.unit())] = bits.into();
        }
        self.write(event)?;
        let keep = lowest && self.spec.keep_best;
        let stop = self
            .spec
            .early_stop
            .is_some_and(|patience| self.tracker.since_best >= patience);
        Ok(Verdict {
            stop,
            checkpoint: self.spec.checkpoint_every > 0 && (keep || stop),
        })
    }

    /// Records a complete checkpoint; the one of the evaluation with the lowest loss is marked
    /// `best` when the run keeps it.
    pub fn checkpoint(&mut self, done: u64, path: &std::path::Path) -> Result<()> {
        let best = self.spec.keep_best && self.tracker.best_loss_step == Some(done);
        if best {
            ringtmp_model::checkpoint::mark_best(path)?;
            if let Some(old) = self.best_only.take()
                && old != path
            {
                std::fs::remove_dir_all(&old).map_err(|e| Error::Io {
                    path: old.clone(),
                    source: e,
                })?;
            }
            self.best_only = (!self.spec.checkpoint_due(done)).then(|| path.to_path_buf());
        }
        self.write(json!({"event": "checkpoint", "step": done, "path": path, "best": best}))
    }

    /// Records a finished step as [`Self::step`] does and tells `on_event` (with this attempt's
    /// throughput): what a driver does after every step it reports live.
    pub fn announce_step(
        &mut self,
        done: u64,
        loss: f64,
        lr: f32,
        (train_seconds, samples): (f64, u64),
        on_event: &mut dyn FnMut(&crate::Event),
    ) -> Result<()> {
        self.step(done, loss, lr, (train_seconds, samples))?;
        on_event(&crate::Event::Step {
            step: done,
            epoch: (done - 1) / self.steps_per_epoch,
            loss,
            samples_per_second: samples as f64 / train_seconds.max(1e-9),
        });
        Ok(())
    }

    /// Records an evaluation as [`Self::eval`] does and tells `on_event`.
    pub fn announce_eval(
        &mut self,
        done: u64,
        score: Score,
        train_seconds: f64,
        wall_seconds: f64,
        on_event: &mut dyn FnMut(&crate::Event),
    ) -> Result<Verdict> {
        let verdict = self.eval(done, score, train_seconds, wall_seconds)?;
        on_event(&crate::Event::Eval {
            step: done,
            epoch: done.saturating_sub(1) / self.steps_per_epoch,
            accuracy: score.accuracy,
            loss: score.loss,
            rmse: score.rmse,
            mae: score.mae,
        });
        if verdict.stop {
            on_event(&crate::Event::Notice {
                text: format!(
                    "early stop after step {done}: {} evaluations without a lower validation \
                     loss than step {}'s",
                    self.tracker.since_best,
                    self.tracker.best_loss_step.unwrap_or(0)
                ),
            });
        }
        Ok(verdict)
    }

    /// Records a complete checkpoint and tells `on_event`.
    pub fn announce_checkpoint(
        &mut self,
        done: u64,
        path: PathBuf,
        on_event: &mut dyn FnMut(&crate::Event),
    ) -> Result<()> {
        self.checkpoint(done, &path)?;
        on_event(&crate::Event::Checkpoint { step: done, path });
        Ok(())
    }

    /// What a language model's token is: `char` for a character vocabulary, else `token`.
    fn unit(&self) -> &'static str {
        match &self.spec.vocabulary {
            Some(v) if v.starts_with("chars:") => "char",
            _ => "token",
        }
    }

    /// The evaluations so far.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// A summary with every field the run itself determines filled in (strategy, model, data,
    /// optimizer, steps, accuracy and time to target, final train loss); the caller adds what
    /// its nodes measured.
    pub fn summary(&self, strategy: &str, nodes: u32) -> Summary {
        let spec = &self.spec;
        let final_train_loss = if self.epoch_steps > 0 {
            self.epoch_loss / self.epoch_steps as f64
        } else {
            self.last_epoch_loss
        };
        Summary {
            strategy: strategy.into(),
            nodes,
            model: spec.model.name.clone(),
            dataset: spec.dataset.clone(),
            epochs: spec.epochs,
            train_samples: spec.train_samples,
            batch_size: spec.batch_size as u32,
            micro_batches: 1,
            seed: spec.seed,
            optimizer: match spec.optimizer {
                OptimizerConfig::Sgd { .. } => "sgd".into(),
                OptimizerConfig::Adam { .. } => "adam".into(),
                OptimizerConfig::AdamW { .. } => "adamw".into(),
            },
            lr: *spec.lr,
            threads: spec.threads as u32,
            final_train_loss,
            final_test_accuracy: self.tracker.last,
            // No evaluation yet: 0, as the latest's default.
            best_test_accuracy: if self.tracker.best.is_finite() {
                self.tracker.best
            } else {
                0.0
            },
            target_accuracy: spec.target_accuracy,
            time_to_target_seconds: self.tracker.reached.map(|(_, t)| t),
            steps_to_target: self.tracker.reached.map(|(s, _)| s),
            ..Default::default()
        }
    }

    /// Writes `summary.json` and the end event.
    pub fn finish(mut self, summary: Summary) -> Result<Summary> {
        let path = self.out.join("summary.json");
        let mut summary = summary;
        if let (Some(seq_len), Some((last, best))) = (self.spec.sequence, self.tracker.loss) {
            let (perplexity, bits) = LanguageSummary::meaning(last);
            let layers = self.spec.layers()?;
            let params: usize = layers.iter().map(|l| l.param_count()).sum();
            let attention: usize = layers
                .iter()
                .map(|l| match &l.kind {
                    ringtmp_model::LayerKind::Block(b) => 12 * b.width * b.seq,
                    ringtmp_model::LayerKind::LlamaBlock(b) => 12 * b.heads * b.head_dim * b.seq,
                    ringtmp_model::LayerKind::CausalSelfAttention(a) => 12 * a.width * a.seq,
                    _ => 0,
                })
                .sum();
            let flops_per_token = (6 * params + attention) as f64;
            let tokens_per_second = summary.samples_per_second * seq_len as f64;
            summary.language = Some(LanguageSummary {
                seq_len: seq_len as u32,
                vocab: self.spec.classes as u32,
                unit: self.unit().into(),
                final_val_loss: last,
                best_val_loss: best,
                final_perplexity: perplexity,
                final_bits_per_unit: bits,
                tokens_per_second,
                flops_per_token,
                model_gflops: flops_per_token * tokens_per_second / 1e9,
            });
        }
        if let (Some((last, _)), Some((rmse, best_rmse, mae))) =
            (self.tracker.loss, self.tracker.errors)
        {
            let targets = self
                .spec
                .recipe
                .as_ref()
                .map(|r| r.targets.clone())
                .unwrap_or_default();
            summary.regression = Some(RegressionSummary {
                targets,
                final_test_loss: last,
                final_test_rmse: rmse,
                final_test_mae: mae,
                best_test_rmse: best_rmse,
                final_test_r2: summary.final_test_accuracy,
            });
        }
        summary
            .write(&path)
            .map_err(|e| Error::Io { path, source: e })?;
        self.write(json!({"event": "end", "steps": summary.steps,
            "final_test_accuracy": summary.final_test_accuracy}))?;
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A regression's R² may be negative throughout a run: its best is the least negative, not 0.
    #[test]
    fn the_best_of_negative_scores_is_the_least_negative() {
        let mut tracker = Tracker::new(0.9);
        tracker.record(-193.8, 10, 1.0);
        tracker.record(-0.36, 20, 2.0);
        tracker.record(-4.0, 30, 3.0);
        assert_eq!(
            (tracker.best, tracker.last, tracker.reached),
            (-0.36, -4.0, None)
        );
    }

    #[test]
    fn the_lowest_loss_is_the_best_and_evaluations_since_it_count_towards_the_patience() {
        let mut tracker = Tracker::new(0.9);
        let fell: Vec<bool> = [
            (1.0, 10),
            (0.8, 20),
            (0.9, 30),
            (0.8, 40),
            (0.7, 50),
            (0.75, 60),
        ]
        .into_iter()
        .map(|(loss, step)| tracker.record_loss(loss, step))
        .collect();
        // An equal loss is no improvement.
        assert_eq!(fell, [true, true, false, false, true, false]);
        assert_eq!((tracker.best_loss_step, tracker.since_best), (Some(50), 1));
    }
}
