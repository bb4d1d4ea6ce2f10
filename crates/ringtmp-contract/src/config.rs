//! The validated configuration of a training run. The CLI turns flags and TOML into this; after
//! construction through [`TrainConfig::validate`] every field is usable as is. Every strategy's
//! job carries it (inside [`crate::RunSpec`]), so what strategies share is declared here once.

use std::path::PathBuf;

use ringtmp_model::{LrSchedule, ModelSpec, OptimizerConfig};
use serde::{Deserialize, Serialize};

use crate::defaulted::{Defaulted, Origin};
use crate::error::{Error, Result};

/// Seconds a node waits for any one message during training unless told otherwise (liveness is
/// the heartbeats' job; this only bounds a protocol that stopped making progress).
pub const DEFAULT_RECV_TIMEOUT_SECS: f64 = 300.0;

fn f32_on_the_wire() -> ringtmp_wire::Dtype {
    ringtmp_wire::Dtype::F32
}

fn given() -> Origin {
    Origin::Given
}

fn default_recv_timeout() -> f64 {
    DEFAULT_RECV_TIMEOUT_SECS
}

/// A `checkpoint_every` that falls due only at the run's last step (no step count but 0 is a
/// multiple of it): the default, so that every finished run can be predicted from, exported and
/// generated with.
pub const CHECKPOINT_AT_END: u64 = u64::MAX;

/// Everything a training run needs besides the dataset itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// The model description.
    pub model: ModelSpec,
    /// Element type of the tensors strategies send (activations and gradients on the ring;
    /// gradients and models for the others): converted on the wire only, computation stays f32.
    #[serde(default = "f32_on_the_wire")]
    pub wire_dtype: ringtmp_wire::Dtype,
    /// Dataset name (recorded in outputs and checkpoints).
    pub dataset: String,
    /// Directory the dataset's files are read from (`None`: the bundled copy and the usual
    /// places), so every node that needs the data finds the same files.
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Epochs to train.
    pub epochs: u32,
    /// Examples per optimizer step.
    pub batch_size: usize,
    /// Base learning rate; a default is one node's batch's, which data-parallel strategies
    /// scale with their workers.
    pub lr: Defaulted<f32>,
    /// Learning-rate schedule; strategies whose updates are stale replace a default with the
    /// one they were tuned with.
    #[serde(rename = "lr_schedule")]
    pub schedule: Defaulted<LrSchedule>,
    /// Steps of linear warm-up; a default warms up over the same examples in fewer steps when a
    /// step averages several batches.
    pub warmup_steps: Defaulted<u64>,
    /// Where SGD's momentum in `optimizer` came from: the asynchronous ring and stale
    /// parameter servers lower a default one (staleness adds momentum of its own).
    #[serde(skip, default = "given")]
    pub momentum: Origin,
    /// Optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Compute threads.
    pub threads: usize,
    /// Whether `threads` is a default rather than the user's choice: a node started by hand
    /// (not by the local launcher, whose nodes share one machine and were planned for it) then
    /// uses its own machine's cores, shared by the run's nodes on that machine.
    #[serde(default)]
    pub threads_from_machine: bool,
    /// Seed of initialisation, shuffling and dropout.
    pub seed: u64,
    /// Test accuracy whose first attainment is timed.
    pub target_accuracy: f64,
    /// Evaluate every this many steps (and at the end of every epoch); 0 = epoch ends only.
    pub eval_every: u64,
    /// Output directory.
    pub out: PathBuf,
    /// Checkpoint every this many steps (and at the end); 0 = never; [`CHECKPOINT_AT_END`]:
    /// at the end only.
    pub checkpoint_every: u64,
    /// Keep only this many newest checkpoints (`None`: all).
    pub keep_checkpoints: Option<usize>,
    /// Checkpoint (or run directory) to resume from.
    pub resume: Option<PathBuf>,
    /// Stop after this many optimizer steps in total (for tests and benchmarks).
    pub max_steps: Option<u64>,
    /// Train on this many examples in all instead of `epochs` (rounded up to whole steps); the
    /// learning-rate schedule spans them. One budget for strategies whose steps differ in size.
    #[serde(default)]
    pub train_samples: Option<u64>,
    /// A floor on the examples a run whose length is the default (`epochs` not given) trains
    /// on, rounded up to whole steps: two epochs of a small table are a handful of steps. In
    /// examples, not steps, so every strategy trains on as many whatever its global batch.
    /// `None`: `epochs` alone decide.
    #[serde(default)]
    pub min_samples: Option<u64>,
    /// Keep the checkpoint of the evaluation with the lowest validation loss, marked
    /// `checkpoints/best`: what `predict`, `export`, `eval` and `generate` use of a finished run.
    #[serde(default)]
    pub keep_best: bool,
    /// Stop once this many evaluations in a row have not lowered the validation loss.
    #[serde(default)]
    pub early_stop: Option<u32>,
    /// Seconds a node waits for any one message before it gives up on the run.
    #[serde(default = "default_recv_timeout")]
    pub recv_timeout_secs: f64,
    /// Seconds rank 0 may go without a step before it ends the run (or 20 × the slowest step,
    /// if longer); `None`: 30, and at least six times the links' peer timeout.
    #[serde(default)]
    pub stall_timeout_secs: Option<f64>,
    /// Clip each step's gradient to this global L2 norm (over the whole model, every stage's
    /// share included); `None`: no clipping.
    #[serde(default)]
    pub clip_grad_norm: Option<f32>,
    /// Where a text dataset's tokens come from and how they are windowed (`None` for the image
    /// datasets), so every node that reads the data reads the same windows.
    #[serde(default)]
    pub text: Option<TextSource>,
    /// A user's own dataset (`npy`, `csv`, `images`, …) as every node that reads data reads it;
    /// `None` for the bundled datasets and text.
    #[serde(default)]
    pub source: Option<ringtmp_data::DataSource>,
    /// A checkpoint directory of step 0 whose parameters (by name, any partition) start the
    /// run instead of the seeded initialisation: weights trained elsewhere, converted by
    /// `--init-from`; or a pretrained model's `.gguf` file or Hugging Face directory
    /// (`--pretrained`), from which each stage reads its own layers. A resumed run loads its
    /// checkpoint instead.
    #[serde(default)]
    pub init_from: Option<PathBuf>,
}

/// Whether `path` is a pretrained model's files (a `.gguf` file, or a directory with a
/// `config.json` that is no checkpoint) rather than a checkpoint of ringtmp's.
pub fn is_pretrained(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || (path.join("config.json").is_file() && !path.join("manifest.json").is_file())
}

/// A text dataset as the run reads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextSource {
    /// The files (empty: the bundled corpus).
    pub files: Vec<PathBuf>,
    /// Positions per window.
    pub seq_len: usize,
    /// Fraction of the text that validates.
    pub validation: f64,
    /// Tokens of validation windows each evaluation scores.
    pub eval_tokens: usize,
    /// Vocabulary size of `.bin` files.
    pub bin_vocab: usize,
    /// The `tokenizer.json` that encodes the text (`None`: characters).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
}

impl TextSource {
    /// The data crate's reading options.
    pub fn options(&self) -> ringtmp_data::TextOptions {
        ringtmp_data::TextOptions {
            files: self.files.clone(),
            seq_len: self.seq_len,
            validation: self.validation,
            eval_tokens: self.eval_tokens,
            bin_vocab: self.bin_vocab,
            tokenizer: self.tokenizer.clone(),
        }
    }
}

impl TrainConfig {
    /// Steps the learning-rate schedule spans, and the run takes unless `max_steps` stops it
    /// first, when every step consumes `global_batch` examples: `epochs` epochs of
    /// `steps_per_epoch` (at least `min_samples` examples), or `train_samples` rounded up to whole steps.
    pub fn schedule_steps(&self, steps_per_epoch: u64, global_batch: usize) -> u64 {
        match self.train_samples {
            Some(samples) => samples.div_ceil(global_batch.max(1) as u64).max(1),
            None => (steps_per_epoch * u64::from(self.epochs)).max(
                self.min_samples
                    .unwrap_or(0)
                    .div_ceil(global_batch.max(1) as u64),
            ),
        }
    }

    /// A training stage of `layers[range]` on `threads` threads: the seeded initial parameters,
    /// or `init_from`'s when the run does not resume (`resuming`: its checkpoint is loaded
    /// next). The one place a training stage is made, so weights trained elsewhere reach every
    /// strategy and every partition.
    pub fn initial_stage(
        &self,
        layers: &[ringtmp_model::Layer],
        range: std::ops::Range<usize>,
        threads: usize,
        resuming: bool,
    ) -> Result<ringtmp_model::Stage> {
        if let (Some(path), false) = (&self.init_from, resuming)
            && is_pretrained(path)
        {
            let model = ringtmp_pretrained::model::Pretrained::open(path)
                .map_err(|e| Error::Config(e.to_string()))?;
            return model
                .stage(layers, range, threads)
                .map_err(|e| Error::Config(e.to_string()));
        }
        let mut stage = ringtmp_model::Stage::new(layers, range, self.seed, threads);
        if let (Some(dir), false) = (&self.init_from, resuming) {
            let manifest = ringtmp_model::checkpoint::read_manifest(dir)?;
            ringtmp_model::checkpoint::read_params(dir, &manifest, &mut stage)?;
        }
        Ok(stage)
    }

    /// Checks the ranges of the numeric settings.
    pub fn validate(self) -> Result<Self> {
        let bad = |msg: String| Err(Error::Config(msg));
        if self.epochs == 0 {
            return bad("--epochs must be at least 1".into());
        }
        if self.batch_size == 0 {
            return bad("--batch-size must be at least 1".into());
        }
        if self.train_samples == Some(0) {
            return bad("--train-samples must be at least 1".into());
        }
        if self.early_stop == Some(0) {
            return bad("--early-stop must be at least 1 evaluation".into());
        }
        if !(self.lr.is_finite() && *self.lr > 0.0) {
            return bad(format!("--lr must be a positive number, got {}", self.lr));
        }
        if !(self.recv_timeout_secs.is_finite() && self.recv_timeout_secs > 0.0) {
            return bad(format!(
                "--recv-timeout must be a positive number of seconds, got {}",
                self.recv_timeout_secs
            ));
        }
        if let Some(s) = self.stall_timeout_secs
            && !(s.is_finite() && s > 0.0)
        {
            return bad(format!(
                "--stall-timeout must be a positive number of seconds, got {s}"
            ));
        }
        if self.keep_checkpoints == Some(0) {
            return bad("--keep-checkpoints must be at least 1".into());
        }
        if self.threads == 0 {
            return bad("--threads must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.target_accuracy) {
            return bad(format!(
                "--target-accuracy must be in [0, 1], got {}",
                self.target_accuracy
            ));
        }
        match self.optimizer {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
            } => {
                if !(0.0..1.0).contains(&momentum) || weight_decay < 0.0 {
                    return bad(format!(
                        "--momentum must be in [0, 1) and --weight-decay ≥ 0, got {momentum} and {weight_decay}"
                    ));
                }
            }
            OptimizerConfig::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                if !(0.0..1.0).contains(&beta1)
                    || !(0.0..1.0).contains(&beta2)
                    || eps <= 0.0
                    || weight_decay < 0.0
                {
                    return bad("Adam needs 0 ≤ β₁, β₂ < 1, ε > 0 and weight decay ≥ 0".into());
                }
            }
        }
        if let Some(clip) = self.clip_grad_norm
            && !(clip > 0.0 && clip.is_finite())
        {
            return bad(format!("--clip-grad-norm must be positive, got {clip}"));
        }
        Ok(self)
    }
}
