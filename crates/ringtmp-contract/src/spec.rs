//! What every strategy's job shares: the run's configuration as the user gave it
//! ([`TrainConfig`]) and what follows from it and the data (input shape, classes, steps per epoch,
//! where a resumed run starts). A job is planned on rank 0 and handed to every node, or read back
//! from `job.json`; [`RunSpec::validate`] checks it before any node uses it, since either way it
//! comes from outside the process.

use std::ops::Deref;
use std::path::PathBuf;
use std::time::Duration;

use ringtmp_data::{Dataset, Task};
use ringtmp_model::{Layer, Shape, checkpoint};
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};

/// The per-example input and output shapes a model must have on data of `input` (height, width,
/// channels; a window's positions for text), `classes` and `sequence` (a window's positions for
/// next-token prediction): an image to `[classes]`, or `[positions]` token ids to
/// `[positions, vocabulary]`.
pub fn model_shapes(
    input: (usize, usize, usize),
    classes: usize,
    sequence: Option<usize>,
) -> (Shape, Shape) {
    match sequence {
        Some(positions) => (Shape::flat(positions), Shape(vec![positions, classes])),
        None => (
            Shape::image(input.0, input.1, input.2),
            Shape::flat(classes),
        ),
    }
}

/// The window's positions of a language-model dataset; `None` for a classification one.
pub fn sequence_of(data: &Dataset) -> Option<usize> {
    match data.task {
        Task::NextToken { seq_len, .. } => Some(seq_len),
        Task::Classify | Task::Regress => None,
    }
}

/// A language-model dataset's vocabulary as [`ringtmp_data::Vocabulary::to_line`] writes it;
/// `None` for a classification one.
pub fn vocabulary_of(data: &Dataset) -> Option<String> {
    match &data.task {
        Task::NextToken { vocab, .. } => Some(vocab.to_line()),
        Task::Classify | Task::Regress => None,
    }
}

/// How `data`'s outputs are scored: mean squared error for regression, else cross-entropy.
pub fn objective_of(data: &Dataset) -> ringtmp_model::loss::Objective {
    match data.task {
        Task::Regress => ringtmp_model::loss::Objective::MeanSquared,
        Task::Classify | Task::NextToken { .. } => ringtmp_model::loss::Objective::CrossEntropy,
    }
}

/// The layers of `model` on `data`, with their shapes.
pub fn layers_for(model: &ringtmp_model::ModelSpec, data: &Dataset) -> Result<Vec<Layer>> {
    let (input, output) = model_shapes(data.input, data.classes, sequence_of(data));
    Ok(model.build_for(&input, &output)?)
}

/// About how many epoch-end evaluations a run of many epochs makes (see [`RunSpec::eval_due`]).
pub const EPOCH_EVALUATIONS: u64 = 50;

/// [`RunSpec::eval_due`] of a run of `total` steps in epochs of `per_epoch`, evaluating every
/// `every` steps besides.
fn eval_due_at(done: u64, total: u64, per_epoch: u64, every: u64) -> bool {
    let epoch = per_epoch.max(1);
    let epochs_apart = (total / EPOCH_EVALUATIONS).div_ceil(epoch).max(1);
    done.is_multiple_of(epoch * epochs_apart)
        || done == total
        || (every > 0 && done.is_multiple_of(every))
}

/// The checkpoint a run resumes from, resolved and checked on rank 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResumePoint {
    /// The checkpoint directory (with its manifest).
    pub dir: PathBuf,
    /// The step it was taken at: the run continues from there.
    pub step: u64,
}

/// The shared part of every strategy's job. Dereferences to its [`TrainConfig`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// The run's configuration.
    #[serde(flatten)]
    pub config: TrainConfig,
    /// Per-sample input shape `(height, width, channels)`.
    pub input: (usize, usize, usize),
    /// Classes (a language model's vocabulary size).
    pub classes: usize,
    /// For a language model, the positions of a window (each with its next token as the label);
    /// `None` for a classifier.
    #[serde(default)]
    pub sequence: Option<usize>,
    /// A language model's vocabulary as [`ringtmp_data::Vocabulary::to_line`] writes it (stored
    /// with every checkpoint, so a checkpoint never meets text it was not trained for).
    #[serde(default)]
    pub vocabulary: Option<String>,
    /// What the outputs are trained to be: class logits, or regression targets (then `classes`
    /// is the number of targets, each example's labels are its targets' bit patterns).
    #[serde(default)]
    pub objective: ringtmp_model::loss::Objective,
    /// How a raw example becomes the model's input (stored with every checkpoint, so `predict`
    /// and `export` read new data as training read it).
    #[serde(default)]
    pub recipe: Option<ringtmp_data::InputRecipe>,
    /// Optimizer steps (global iterations) per epoch.
    pub steps_per_epoch: u64,
    /// Steps the learning-rate schedule spans (every epoch, even when `max_steps` stops early).
    pub schedule_steps: u64,
    /// Steps this run takes in total (after `max_steps`).
    pub total_steps: u64,
    /// Where a resumed run starts.
    #[serde(default)]
    pub resume_from: Option<ResumePoint>,
}

impl Deref for RunSpec {
    type Target = TrainConfig;

    fn deref(&self) -> &TrainConfig {
        &self.config
    }
}

impl RunSpec {
    /// The spec of `config` on `data` when every step consumes `global_batch` examples (the
    /// mini-batch, or the data-parallel workers' batches together).
    pub fn new(config: TrainConfig, data: &Dataset, global_batch: usize) -> Result<Self> {
        if global_batch == 0 || global_batch > data.train.len() {
            return Err(Error::Config(format!(
                "a step of {global_batch} examples does not fit the {} training examples",
                data.train.len()
            )));
        }
        let steps_per_epoch = (data.train.len() / global_batch) as u64;
        let schedule_steps = config.schedule_steps(steps_per_epoch, global_batch);
        let total_steps = config.max_steps.unwrap_or(u64::MAX).min(schedule_steps);
        Ok(Self {
            config,
            input: data.input,
            classes: data.classes,
            sequence: sequence_of(data),
            vocabulary: vocabulary_of(data),
            objective: objective_of(data),
            // A language model's input is token ids: its vocabulary describes it.
            recipe: (!matches!(data.task, Task::NextToken { .. })).then(|| data.recipe.clone()),
            steps_per_epoch,
            schedule_steps,
            total_steps,
            resume_from: None,
        })
    }

    /// Checks a spec that came from a file or the network before anything uses it: every
    /// division and loop bound it feeds must be well defined.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("invalid job: {what}")));
        let (h, w, c) = self.input;
        if h == 0 || w == 0 || c == 0 || self.classes == 0 {
            return bad(format!("input {h}×{w}×{c} with {} classes", self.classes));
        }
        if self.steps_per_epoch == 0 {
            return bad("zero steps per epoch".into());
        }
        if self.total_steps > self.schedule_steps {
            return bad(format!(
                "{} steps but the schedule spans {}",
                self.total_steps, self.schedule_steps
            ));
        }
        if self.first_step() > self.total_steps {
            return bad(format!(
                "resumes at step {} of {}",
                self.first_step(),
                self.total_steps
            ));
        }
        self.config.clone().validate().map(|_| ())
    }

    /// The learning rate of step `step` (the schedule spans the whole run).
    pub fn lr_at(&self, step: u64) -> f32 {
        self.schedule.rate(
            *self.lr,
            step,
            self.schedule_steps,
            self.steps_per_epoch,
            *self.warmup_steps,
        )
    }

    /// Training stage `range` of `layers` and its optimizer as this run starts them: the
    /// seeded initial parameters (or `--init-from`'s), then, when it resumes, the checkpoint's
    /// parameters and optimizer state. The one opening every driver shares.
    pub fn open_stage(
        &self,
        layers: &[Layer],
        range: std::ops::Range<usize>,
    ) -> Result<(ringtmp_model::Stage, ringtmp_model::Optimizer)> {
        let mut stage =
            self.initial_stage(layers, range, self.threads, self.resume_from.is_some())?;
        let mut optimizer =
            ringtmp_model::Optimizer::new(self.optimizer.clone(), stage.params().len());
        self.restore(&mut stage, &mut optimizer)?;
        Ok((stage, optimizer))
    }

    /// The whole model as a data-parallel worker's replica starts it ([`Self::open_stage`] of
    /// every layer), with the layers.
    pub fn open_replica(
        &self,
    ) -> Result<(Vec<Layer>, ringtmp_model::Stage, ringtmp_model::Optimizer)> {
        let layers = self.layers()?;
        let (stage, optimizer) = self.open_stage(&layers, 0..layers.len())?;
        Ok((layers, stage, optimizer))
    }

    /// Reads the resumed checkpoint's parameters and optimizer state into `stage` and
    /// `optimizer` (by tensor name, whatever partition wrote it); nothing when not resuming.
    pub fn restore(
        &self,
        stage: &mut ringtmp_model::Stage,
        optimizer: &mut ringtmp_model::Optimizer,
    ) -> Result<()> {
        if let Some(ResumePoint { dir, .. }) = &self.resume_from {
            let manifest = checkpoint::read_manifest(dir)?;
            checkpoint::read_stage(dir, &manifest, stage, optimizer)?;
        }
        Ok(())
    }

    /// The model's layers with their shapes.
    pub fn layers(&self) -> Result<Vec<Layer>> {
        let (input, output) = model_shapes(self.input, self.classes, self.sequence);
        Ok(self.model.build_for(&input, &output)?)
    }

    /// The manifest of a checkpoint `strategy` takes after `step` steps: the run's model, data
    /// order, optimizer and vocabulary as the spec has them, and what only the strategy knows —
    /// the batch that fixes the data order (`global_batch`: every worker's or ring's together),
    /// which layers each file holds (`partition`), the files and any replicas beside them. The
    /// one place a manifest is made, so a field added to it reaches every strategy.
    pub fn manifest(
        &self,
        strategy: &str,
        step: u64,
        global_batch: usize,
        partition: Vec<(usize, usize)>,
        files: Vec<checkpoint::FileEntry>,
        replicas: Vec<checkpoint::FileEntry>,
    ) -> checkpoint::Manifest {
        let per_epoch = self.steps_per_epoch.max(1);
        checkpoint::Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            strategy: strategy.into(),
            step,
            epoch: step / per_epoch,
            batch_in_epoch: step % per_epoch,
            dataset: self.dataset.clone(),
            batch_size: global_batch,
            seed: self.seed,
            model: self.model.clone(),
            partition,
            optimizer: self.optimizer.clone(),
            lr: Some(*self.lr),
            files,
            replicas,
            vocabulary: self.vocabulary.clone(),
            context: self.sequence,
            objective: self.objective,
            recipe: self
                .recipe
                .as_ref()
                .and_then(|r| serde_json::to_value(r).ok()),
        }
    }

    /// Labels per example: 1, a window's positions, or a regression's targets.
    pub fn positions(&self) -> usize {
        match self.objective {
            ringtmp_model::loss::Objective::MeanSquared => self.classes,
            ringtmp_model::loss::Objective::CrossEntropy => self.sequence.unwrap_or(1),
        }
    }

    /// How long a node waits for any one message.
    pub fn recv_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.recv_timeout_secs.max(0.001))
    }

    /// The mean learning rate of steps `done − h … done − 1` (the last `h` of the `done`
    /// complete steps, fewer at the start), as a fraction of the peak rate (1 when there are
    /// none): what DiLoCo's inner steps ran at before a synchronisation after `done` steps, for
    /// its workers and for rings of rings alike.
    pub fn rate_before(&self, done: u64, h: u64) -> f32 {
        let from = done.saturating_sub(h);
        if done == from || *self.lr <= 0.0 {
            return 1.0;
        }
        let sum: f64 = (from..done).map(|s| f64::from(self.lr_at(s))).sum();
        (sum / (done - from) as f64 / f64::from(*self.lr)) as f32
    }

    /// The step training starts at (0, or the resumed checkpoint's).
    pub fn first_step(&self) -> u64 {
        self.resume_from.as_ref().map_or(0, |r| r.step)
    }

    /// Whether an evaluation is due once `done` steps are complete: every `eval_every`-th step,
    /// every epoch end and the last step (so time to target means the same in every strategy).
    /// A run of many short epochs (a small table's) evaluates at every k-th epoch end, about
    /// `EPOCH_EVALUATIONS` (50) times in all: often enough to keep its best checkpoint and stop
    /// early, not a line per epoch.
    pub fn eval_due(&self, done: u64) -> bool {
        eval_due_at(
            done,
            self.total_steps,
            self.steps_per_epoch,
            self.eval_every,
        )
    }

    /// Whether a checkpoint is due after `done` steps (every `checkpoint_every`, and at the end).
    pub fn checkpoint_due(&self, done: u64) -> bool {
        self.checkpoint_every > 0
            && (done.is_multiple_of(self.checkpoint_every) || done == self.total_steps)
    }

    /// Where the checkpoint of step `step` goes.
    pub fn checkpoint_dir(&self, step: u64) -> PathBuf {
        self.out
            .join("checkpoints")
            .join(checkpoint::checkpoint_dir_name(step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_many_short_epochs_evaluates_about_fifty_times_not_every_epoch() {
        let due = |total, per_epoch, every| {
            (1..=total)
                .filter(|&d| eval_due_at(d, total, per_epoch, every))
                .collect::<Vec<u64>>()
        };
        // MNIST's two epochs: every 200 steps and both epoch ends, as before.
        assert_eq!(
            due(1874, 937, 200),
            [200, 400, 600, 800, 937, 1000, 1200, 1400, 1600, 1800, 1874]
        );
        // A small table's 500 epochs of 2 steps: every 10th epoch end.
        let small = due(1000, 2, 200);
        assert_eq!(small.len(), 50);
        assert_eq!(&small[..3], [20, 40, 60]);
        assert_eq!(small.last(), Some(&1000));
    }
}
