//! The run recorder: the one piece every strategy's reporting rank writes its run through —
//! `metrics.jsonl` (start, steps, evaluations, checkpoints, end), the evaluation cadence, the
//! first time the target accuracy was reached, the mean loss of the last epoch, and
//! `summary.json` with the fields every summary shares.
//!
//! Invariants: evaluations happen at every `eval_every`-th step, at every epoch end and at the
//! last step (so `time_to_target` means the same in every strategy); the event log is flushed per
//! line, so a crashed run keeps everything up to its last event; a resumed run appends to it.

use std::path::PathBuf;

use ringtmp_metrics::{EventLog, Summary};
use ringtmp_model::OptimizerConfig;
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::spec::RunSpec;

/// First attainment of the target accuracy, and the best and latest accuracy.
#[derive(Clone, Debug)]
pub struct Tracker {
    target: f64,
    /// Latest evaluation.
    pub last: f64,
    /// Best evaluation.
    pub best: f64,
    /// `(step, training seconds)` of the first evaluation at or above the target.
    pub reached: Option<(u64, f64)>,
}

impl Tracker {
    /// Tracks attainment of `target`.
    pub fn new(target: f64) -> Self {
        Self {
            target,
            last: 0.0,
            best: 0.0,
            reached: None,
        }
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
        let log = EventLog::create(&path, spec.first_step() > 0).map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })?;
        let mut recorder = Self {
            log,
            path,
            out,
            tracker: Tracker::new(spec.target_accuracy),
            spec: spec.clone(),
            steps_per_epoch: spec.steps_per_epoch.max(1),
            epoch_loss: 0.0,
            epoch_steps: 0,
            last_epoch_loss: f64::NAN,
        };
        let mut event = json!({"event": "start", "strategy": strategy, "model": spec.model.name,
            "dataset": spec.dataset, "batch_size": spec.batch_size, "seed": spec.seed,
            "threads": spec.threads, "first_step": spec.first_step(),
            "total_steps": spec.total_steps, "unix_time": unix_now()});
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

    /// Records a finished step (`done` steps complete) and its mean training loss.
    pub fn step(&mut self, done: u64, loss: f64, lr: f32, train_seconds: f64) -> Result<()> {
        let epoch = (done - 1) / self.steps_per_epoch;
        self.epoch_loss += loss;
        self.epoch_steps += 1;
        if done % self.steps_per_epoch == 0 {
            self.last_epoch_loss = self.epoch_loss / self.epoch_steps as f64;
            (self.epoch_loss, self.epoch_steps) = (0.0, 0);
        }
        self.write(
            json!({"event": "step", "step": done, "epoch": epoch, "loss": loss, "lr": lr,
            "train_seconds": train_seconds}),
        )
    }

    /// Records an evaluation after `done` steps.
    pub fn eval(
        &mut self,
        done: u64,
        accuracy: f64,
        test_loss: Option<f64>,
        train_seconds: f64,
        wall_seconds: f64,
    ) -> Result<()> {
        self.tracker.record(accuracy, done, train_seconds);
        let epoch = done.saturating_sub(1) / self.steps_per_epoch;
        self.write(json!({"event": "eval", "step": done, "epoch": epoch,
            "test_accuracy": accuracy, "test_loss": test_loss, "train_seconds": train_seconds,
            "wall_seconds": wall_seconds}))
    }

    /// Records a complete checkpoint.
    pub fn checkpoint(&mut self, done: u64, path: &std::path::Path) -> Result<()> {
        self.write(json!({"event": "checkpoint", "step": done, "path": path}))
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
            },
            lr: spec.lr,
            threads: spec.threads as u32,
            final_train_loss,
            final_test_accuracy: self.tracker.last,
            best_test_accuracy: self.tracker.best,
            target_accuracy: spec.target_accuracy,
            time_to_target_seconds: self.tracker.reached.map(|(_, t)| t),
            steps_to_target: self.tracker.reached.map(|(s, _)| s),
            ..Default::default()
        }
    }

    /// Writes `summary.json` and the end event.
    pub fn finish(mut self, summary: &Summary) -> Result<()> {
        let path = self.out.join("summary.json");
        summary
            .write(&path)
            .map_err(|e| Error::Io { path, source: e })?;
        self.write(json!({"event": "end", "steps": summary.steps,
            "final_test_accuracy": summary.final_test_accuracy}))
    }
}
