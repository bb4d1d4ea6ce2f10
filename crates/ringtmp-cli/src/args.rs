//! Training options: one struct that is both the clap flags and the `--config` TOML file, so the
//! two cannot drift apart. Flags override the file; the file overrides the built-in defaults.
//! [`TrainArgs::resolve_for`] turns the merged options into a validated [`TrainConfig`].

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use ringtmp_model::{LrSchedule, ModelSpec, OptimizerConfig};
use ringtmp_strategy::per_node::{Bytes, PerNode, Speed};
use ringtmp_strategy::{Defaulted, Job, LocalJob, Origin, Strategy, StrategyOptions, TrainConfig};
use serde::{Deserialize, Serialize};

use crate::links::{Card, CardArgs, LinkSpec};

use crate::error::UsageError;

/// Optimizer choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// SGD with momentum and weight decay.
    Sgd,
    /// Adam (L2 weight decay added to the gradient).
    Adam,
    /// AdamW: Adam with decoupled weight decay (none on biases, norms and embeddings).
    Adamw,
}

/// `ringtmp train` options, in the sections a run is resolved into. Every field is optional so
/// that flags, the config file and the defaults can be layered; the sections are flattened, so
/// flags and config keys are the same flat names.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainArgs {
    /// TOML file with any of these options (keys as the long flags, e.g. `batch-size = 64`);
    /// flags given on the command line override it.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The strategy, its node count and every strategy's own options.
    #[command(flatten)]
    #[serde(flatten)]
    pub strategy: StrategyArgs,
    /// The emulated cluster: each node's speed, card, CPU share and memory.
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterArgs,
    /// The model: a preset or a file, and weights to start from.
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelArgs,
    /// The data: a bundled dataset or the user's files, and how they are read.
    #[command(flatten)]
    #[serde(flatten)]
    pub data: DataArgs,
    /// Training: its length, batch, rate, optimizer, threads and seed.
    #[command(flatten)]
    #[serde(flatten)]
    pub training: TrainingArgs,
    /// Output: evaluations, checkpoints, the run directory and how a run starts there.
    #[command(flatten)]
    #[serde(flatten)]
    pub output: OutputArgs,
    /// Faults and links: restarts, timeouts, encryption, and fault injection for tests.
    #[command(flatten)]
    #[serde(flatten)]
    pub faults: FaultArgs,
}

/// The strategy, its node count and every strategy's own options.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct StrategyArgs {
    /// Strategy: local, ring, ps, allreduce, dpsgd, adpsgd or diloco [default: ring].
    #[arg(id = "strategy", long = "strategy", help_heading = "Strategy", value_parser = clap::builder::PossibleValuesParser::new(Job::NAMES))]
    #[serde(rename = "strategy")]
    pub name: Option<String>,
    /// Node processes to launch locally (distributed strategies) [default: 4].
    #[arg(help_heading = "Strategy", long)]
    pub nodes: Option<u32>,
    /// Every strategy's own options, each under its heading.
    #[command(flatten)]
    #[serde(flatten)]
    pub options: StrategyOptions,
    /// What tensors travel as between nodes: f32, bf16 or f16 (computation stays f32)
    /// [default: f32].
    #[arg(help_heading = "Strategy", long, value_name = "DTYPE", value_enum)]
    pub wire_dtype: Option<WireDtype>,
}

/// The emulated cluster: each node's speed, card, CPU share and memory.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ClusterArgs {
    /// Emulate a slower node: RANK:FACTOR with 0 < FACTOR ≤ 1 (comma-separated or repeatable;
    /// a FACTOR alone slows every node).
    #[arg(help_heading = "Cluster (emulated)", long, value_name = "RANK:FACTOR")]
    pub node_speed: Option<Vec<PerNode<Speed>>>,
    /// Every local node's emulated card (`--bandwidth-mbit`, `--latency-ms`).
    #[command(flatten, next_help_heading = "Cluster (emulated)")]
    #[serde(flatten)]
    pub card: CardArgs,
    /// Per-rank card: `RANK:MBIT[:MS]`, overriding --bandwidth-mbit (and --latency-ms) for that
    /// node (repeatable or comma-separated).
    #[arg(
        help_heading = "Cluster (emulated)",
        long,
        value_name = "RANK:MBIT[:MS]",
        value_delimiter = ','
    )]
    #[serde(default, deserialize_with = "crate::links::specs_from_strings")]
    pub link: Option<Vec<LinkSpec>>,
    /// Memory of each node's process, e.g. `256M`, or per rank `1:256M,2:1G`: the ring's planner
    /// fits its stages into it (after the process's own needs); with --enforce-memory-limit
    /// the kernel holds every strategy's local nodes to it.
    #[arg(help_heading = "Cluster (emulated)", long, value_name = "BYTES")]
    pub node_memory_limit: Option<PerNode<Bytes>>,
    /// Make --node-memory-limit a hard limit on each local node process (cgroups): a node that
    /// does not fit is killed, as on a board with that much memory, and the run says so.
    #[arg(help_heading = "Cluster (emulated)", long, num_args = 0..=1, default_missing_value = "true")]
    pub enforce_memory_limit: Option<bool>,
    /// Real CPU limits: RANK:CORES puts that local node under a kernel CPU quota of CORES
    /// (fractional) cores through cgroups (repeatable or comma-separated; `all:CORES` for every
    /// node, later entries overriding it). With --strategy local, 0:CORES puts the training
    /// process itself under it: a one-board baseline on a node's share. Under `simulate` it sets
    /// the simulated nodes' speed.
    #[arg(help_heading = "Cluster (emulated)", long, value_name = "RANK:CORES")]
    pub node_cpu: Option<Vec<String>>,
    /// Pin each local node process to its own core (when there are enough cores).
    #[arg(help_heading = "Cluster (emulated)", long, num_args = 0..=1, default_missing_value = "true")]
    pub pin: Option<bool>,
}

/// The model: a preset or a file, and weights to start from.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ModelArgs {
    /// Model preset: mlp, mlp-deep, cnn, tabular (an MLP sized from a table's columns), or the
    /// language models gpt-nano, gpt-cpu and gpt-small (with --dataset text) [default: mlp;
    /// gpt-cpu on text; tabular on csv].
    #[arg(
        id = "model",
        long = "model",
        help_heading = "Model",
        conflicts_with = "model_file"
    )]
    #[serde(rename = "model")]
    pub preset: Option<String>,
    /// Model description file (TOML; see examples/).
    #[arg(
        id = "model_file",
        long = "model-file",
        help_heading = "Model",
        value_name = "FILE"
    )]
    #[serde(rename = "model-file")]
    pub file: Option<PathBuf>,
    /// A language model's head uses the token embedding's table as its weight (GPT-2's weight
    /// tying: one matrix, one update from both gradients). On the ring it needs
    /// --master-holds-head [default: the model file's `tie_embeddings`, untied for presets].
    #[arg(help_heading = "Model", long, num_args = 0..=1, default_missing_value = "true")]
    pub tie_embeddings: Option<bool>,
    /// Start from weights trained elsewhere: a .safetensors file whose tensors are matched by
    /// name (see --weight-map) and checked against the model before training starts.
    #[arg(help_heading = "Model", long, value_name = "FILE.safetensors")]
    pub init_from: Option<PathBuf>,
    /// Fine-tune a pretrained model: a `.gguf` file or a Hugging Face model directory (its
    /// architecture, its weights — each node reads only its own layers — and, with --dataset
    /// text, its tokenizer).
    #[arg(
        help_heading = "Model",
        long,
        value_name = "PATH",
        conflicts_with_all = ["model", "model_file", "init_from"]
    )]
    pub pretrained: Option<PathBuf>,
    /// The names --init-from's file uses: pytorch (an nn.Sequential of one module per layer:
    /// `3.weight`), nanogpt (nanoGPT's GPT: `transformer.h.0.attn.c_attn.weight`) or ringtmp
    /// [default: told from the names].
    #[arg(help_heading = "Model", long, value_name = "MAP")]
    #[serde(default, with = "ringtmp_strategy::text_form")]
    pub weight_map: Option<ringtmp_model::interop::NameMap>,
}

/// The data: a bundled dataset or the user's files, and how they are read.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DataArgs {
    /// Dataset: mnist, fashion-mnist, digits, text (a language model's: see --data-file), or
    /// your own in one of the formats npy, npz, csv, images (a folder per class) or
    /// cifar10/cifar100 (their binary batches) named by --data-file [default: mnist]. In a config
    /// file, a `[dataset]` table may hold `format` and the other data keys.
    #[arg(help_heading = "Data", long)]
    pub dataset: Option<String>,
    /// The data's files: the training file, then an optional test file (without one,
    /// --val-fraction of the rows is held out). With --dataset text: UTF-8 text files (raw or
    /// .gz; a character vocabulary is built from the training split), or pre-tokenised .bin files
    /// (nanoGPT's uint16 ids or llm.c's layout: TRAIN.bin, then an optional VAL.bin) [default:
    /// the bundled Shakespeare corpus]. For images and CIFAR: the folder.
    #[arg(help_heading = "Data", long, value_name = "FILE", num_args = 1..)]
    pub data_file: Option<Vec<PathBuf>>,
    /// With --dataset npy: the label array of each --data-file, in the same order (integer
    /// labels classify; float labels are regression targets).
    #[arg(help_heading = "Data", long, value_name = "FILE", num_args = 1..)]
    pub label_file: Option<Vec<PathBuf>>,
    /// With --dataset csv: the label column [default: a column named label, target, class or y].
    #[arg(help_heading = "Data", long, value_name = "COLUMN")]
    pub label: Option<String>,
    /// With --dataset csv: regression on these columns (mean squared error; RMSE and MAE are
    /// reported) instead of a class label.
    #[arg(
        help_heading = "Data",
        long,
        value_name = "COLUMNS",
        value_delimiter = ','
    )]
    pub target_columns: Option<Vec<String>>,
    /// The model's input H,W,C: images are resized to it; an array must hold as many values per
    /// row [default: what the files say].
    #[arg(help_heading = "Data", long, value_name = "H,W,C")]
    #[serde(default, with = "ringtmp_strategy::text_form")]
    pub input_shape: Option<ringtmp_data::InputShape>,
    /// How a 4-D array orders an image: nchw (PyTorch) or nhwc (NumPy, Keras) [default: the axis
    /// of 1, 3 or 4 values holds the channels].
    #[arg(help_heading = "Data", long, value_name = "LAYOUT")]
    #[serde(default, with = "ringtmp_strategy::text_form")]
    pub layout: Option<ringtmp_data::Layout>,
    /// Input normalisation: auto (each channel's mean and deviation over the training split; a
    /// table's each column), none, or MEAN[,MEAN…]/STD[,STD…] (torchvision's, in [0, 1] units
    /// for bytes) [default: auto].
    #[arg(help_heading = "Data", long, value_name = "HOW")]
    #[serde(default, with = "ringtmp_strategy::text_form")]
    pub normalize: Option<ringtmp_data::Normalize>,
    /// Positions per training window (the model's context) [default: the GPT preset's context,
    /// else 64].
    #[arg(help_heading = "Data", long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// Fraction of the text (its end) that validates, or of your rows (chosen by a seeded
    /// shuffle) held out to test when no test file is named [default: 0.1].
    #[arg(help_heading = "Data", long, value_name = "F")]
    pub val_fraction: Option<f64>,
    /// Tokens of fixed validation windows each evaluation scores [default: 16384].
    #[arg(help_heading = "Data", long, value_name = "N")]
    pub eval_tokens: Option<usize>,
    /// Vocabulary size of .bin token files [default: 50257, GPT-2's].
    #[arg(help_heading = "Data", long, value_name = "N")]
    pub vocab_size: Option<usize>,
    /// With --dataset text: encode the text with this tokenizer.json (byte-level BPE, as GPT-2's,
    /// or any model Hugging Face's tokenizers reads) instead of a character vocabulary.
    #[arg(help_heading = "Data", long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Directory holding the dataset files (searched before the bundled data/).
    #[arg(help_heading = "Data", long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// Training: its length, batch, rate, optimizer, threads and seed.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainingArgs {
    /// Epochs [default: 2].
    #[arg(help_heading = "Training", long)]
    pub epochs: Option<u32>,
    /// Examples per optimizer step [default: 64].
    #[arg(help_heading = "Training", long)]
    pub batch_size: Option<usize>,
    /// Base learning rate [default: 0.01 for SGD, 0.001 for Adam and AdamW (0.004 for the
    /// gpt-cpu preset); where a step
    /// averages W batches (ps, allreduce, dpsgd, adpsgd, rings of rings), 0.01 × W for SGD and
    /// 0.001 × √W for Adam, for their global batch of W × --batch-size].
    #[arg(help_heading = "Training", long)]
    pub lr: Option<f32>,
    /// Learning-rate schedule: constant, cosine or step:EVERY:GAMMA (epochs) [default: constant].
    #[arg(help_heading = "Training", long, value_name = "SCHEDULE")]
    #[serde(default, with = "ringtmp_strategy::text_form")]
    pub lr_schedule: Option<LrSchedule>,
    /// Steps of linear learning-rate warm-up [default: 100 for language models, else 0; where a
    /// step averages W batches, the same examples in W times fewer steps, and 10 steps for a
    /// scaled SGD rate].
    #[arg(help_heading = "Training", long)]
    pub warmup_steps: Option<u64>,
    /// Optimizer [default: sgd].
    #[arg(help_heading = "Training", long, value_enum)]
    pub optimizer: Option<OptimizerKind>,
    /// SGD momentum [default: 0.9].
    #[arg(help_heading = "Training", long)]
    pub momentum: Option<f32>,
    /// Weight decay: L2 for SGD and Adam, decoupled for AdamW [default: 0, or 0.1 with AdamW].
    #[arg(help_heading = "Training", long)]
    pub weight_decay: Option<f32>,
    /// AdamW: decay the token and position embeddings too (nanoGPT does).
    #[arg(help_heading = "Training", long, num_args = 0..=1, default_missing_value = "true")]
    pub decay_embeddings: Option<bool>,
    /// Clip each step's gradient to this global L2 norm, computed over every node's share of
    /// the model [default: 1.0 for language models, none otherwise].
    #[arg(help_heading = "Training", long, value_name = "NORM")]
    pub clip_grad_norm: Option<f32>,
    /// Compute threads [default: all cores].
    #[arg(help_heading = "Training", long, value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// Seed of initialisation, data order and dropout [default: 42].
    #[arg(help_heading = "Training", long)]
    pub seed: Option<u64>,
    /// Stop after N optimizer steps in total.
    #[arg(help_heading = "Training", long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Train on N examples in all instead of --epochs (rounded up to whole steps; the
    /// learning-rate schedule spans them): one budget for strategies whose steps differ in size.
    #[arg(help_heading = "Training", long, value_name = "N")]
    pub train_samples: Option<u64>,
}

/// Output: evaluations, checkpoints, the run directory and how a run starts there.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct OutputArgs {
    /// Test accuracy whose first attainment is timed in summary.json [default: 0.97].
    #[arg(help_heading = "Output", long)]
    pub target_accuracy: Option<f64>,
    /// Evaluate on the test split every N steps, besides every epoch end; 0 = epoch ends only
    /// [default: 200].
    #[arg(help_heading = "Output", long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Stop once N evaluations in a row have not lowered the validation loss (strategies local
    /// and ring; the last checkpoint is then that step's, the best evaluation's is kept).
    #[arg(help_heading = "Output", long, value_name = "PATIENCE")]
    pub early_stop: Option<u32>,
    /// Keep the checkpoint of the evaluation with the lowest validation loss as
    /// checkpoints/best: predict, export, eval and generate use it of a finished run (--resume
    /// goes on from the last) [default: true, but for language models, whose checkpoints are
    /// large and whose validation loss falls to the end].
    #[arg(help_heading = "Output", long, num_args = 0..=1, default_missing_value = "true")]
    pub keep_best: Option<bool>,
    /// Output directory (default: `runs/<time>-<strategy>`).
    #[arg(help_heading = "Output", long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Checkpoint every N steps and at the end; 0 = never [default: at the end only, so that
    /// predict, export and generate work on any finished run].
    #[arg(help_heading = "Output", long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Write no checkpoint, not even the last step's (as --checkpoint-every 0).
    #[arg(help_heading = "Output", long, num_args = 0..=1, default_missing_value = "true")]
    pub no_checkpoint: Option<bool>,
    /// Keep only the N newest checkpoints [default: all].
    #[arg(help_heading = "Output", long, value_name = "N")]
    pub keep_checkpoints: Option<usize>,
    /// Resume from a checkpoint directory or a previous run's output directory.
    #[arg(help_heading = "Output", long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Replace the run that --out already holds (its summary, metrics, job and checkpoints).
    #[arg(help_heading = "Output", long, num_args = 0..=1, default_missing_value = "true")]
    pub overwrite: Option<bool>,
    /// Show every node's informational log lines (otherwise progress, warnings and errors).
    #[arg(help_heading = "Output", long, num_args = 0..=1, default_missing_value = "true")]
    pub verbose: Option<bool>,
}

/// Faults and links: restarts, timeouts, encryption, and fault injection for tests.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct FaultArgs {
    /// With --max-restarts: restart without the node that failed, re-planned on the nodes that
    /// remain (a board that is gone for good), instead of starting it again.
    #[arg(help_heading = "Faults and links", long, num_args = 0..=1, default_missing_value = "true")]
    pub shrink_on_failure: Option<bool>,
    /// Send frames between nodes in the clear after the authenticated greeting (links are
    /// encrypted and authenticated by default).
    #[arg(help_heading = "Faults and links", long, num_args = 0..=1, default_missing_value = "true")]
    pub insecure_plaintext: Option<bool>,
    /// Restart the run up to K times when a node fails: the launcher stops the others and resumes
    /// from the newest checkpoint that verifies (choosing --checkpoint-every when not given).
    /// The master's failure still ends the run.
    #[arg(help_heading = "Faults and links", long, value_name = "K")]
    pub max_restarts: Option<u32>,
    /// Fault injection for tests: this rank of a local ring exits abruptly.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub crash_rank: Option<u32>,
    /// Fault injection for tests: milliseconds before the crash.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub crash_after_ms: Option<u64>,
    /// Fault injection for tests: `RANK:MS,RANK:MS,…` — entry k makes that rank of attempt k
    /// (the first run, then each restart) exit abruptly MS milliseconds after its links are up;
    /// `RANK:MS+RANK:MS` strikes several in one attempt.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub crash_plan: Option<String>,
    /// Fault injection for tests: this rank of a local run stops itself (SIGSTOP).
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub freeze_rank: Option<u32>,
    /// Fault injection for tests: milliseconds before the freeze.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub freeze_after_ms: Option<u64>,
    /// Fault injection for tests: this rank of a local run stops training (its thread blocks)
    /// while its links stay alive: the stall the step bound exists for.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub hang_rank: Option<u32>,
    /// Fault injection for tests: milliseconds before the hang.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub hang_after_ms: Option<u64>,
    /// Seconds a node waits for any one message before giving up on the run [default: 300].
    #[arg(help_heading = "Faults and links", long, value_name = "SECONDS")]
    pub recv_timeout: Option<f64>,
    /// Seconds rank 0 may wait without a step completing before it ends the run, naming what
    /// every node waits for; 20 × the slowest step so far (or the plan's predicted step) when
    /// that is longer [default: 30, and at least 6 × the links' peer timeout].
    #[arg(help_heading = "Faults and links", long, value_name = "SECONDS")]
    pub stall_timeout: Option<f64>,
}

impl StrategyArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            name: self.name.as_ref().or(file.name.as_ref()).cloned(),
            nodes: self.nodes.as_ref().or(file.nodes.as_ref()).cloned(),
            wire_dtype: self
                .wire_dtype
                .as_ref()
                .or(file.wire_dtype.as_ref())
                .cloned(),
            options: self.options.merged_over(&file.options),
        }
    }
}

impl ClusterArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            node_speed: self
                .node_speed
                .as_ref()
                .or(file.node_speed.as_ref())
                .cloned(),
            link: self.link.as_ref().or(file.link.as_ref()).cloned(),
            node_memory_limit: self
                .node_memory_limit
                .as_ref()
                .or(file.node_memory_limit.as_ref())
                .cloned(),
            enforce_memory_limit: self
                .enforce_memory_limit
                .as_ref()
                .or(file.enforce_memory_limit.as_ref())
                .cloned(),
            node_cpu: self.node_cpu.as_ref().or(file.node_cpu.as_ref()).cloned(),
            pin: self.pin.as_ref().or(file.pin.as_ref()).cloned(),
            card: self.card.merged_over(&file.card),
        }
    }
}

impl ModelArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            preset: self.preset.as_ref().or(file.preset.as_ref()).cloned(),
            file: self.file.as_ref().or(file.file.as_ref()).cloned(),
            tie_embeddings: self
                .tie_embeddings
                .as_ref()
                .or(file.tie_embeddings.as_ref())
                .cloned(),
            init_from: self.init_from.as_ref().or(file.init_from.as_ref()).cloned(),
            pretrained: self
                .pretrained
                .as_ref()
                .or(file.pretrained.as_ref())
                .cloned(),
            weight_map: self
                .weight_map
                .as_ref()
                .or(file.weight_map.as_ref())
                .cloned(),
        }
    }
}

impl DataArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            dataset: self.dataset.as_ref().or(file.dataset.as_ref()).cloned(),
            data_file: self.data_file.as_ref().or(file.data_file.as_ref()).cloned(),
            label_file: self
                .label_file
                .as_ref()
                .or(file.label_file.as_ref())
                .cloned(),
            label: self.label.as_ref().or(file.label.as_ref()).cloned(),
            target_columns: self
                .target_columns
                .as_ref()
                .or(file.target_columns.as_ref())
                .cloned(),
            input_shape: self
                .input_shape
                .as_ref()
                .or(file.input_shape.as_ref())
                .cloned(),
            layout: self.layout.as_ref().or(file.layout.as_ref()).cloned(),
            normalize: self.normalize.as_ref().or(file.normalize.as_ref()).cloned(),
            seq_len: self.seq_len.as_ref().or(file.seq_len.as_ref()).cloned(),
            val_fraction: self
                .val_fraction
                .as_ref()
                .or(file.val_fraction.as_ref())
                .cloned(),
            eval_tokens: self
                .eval_tokens
                .as_ref()
                .or(file.eval_tokens.as_ref())
                .cloned(),
            vocab_size: self
                .vocab_size
                .as_ref()
                .or(file.vocab_size.as_ref())
                .cloned(),
            tokenizer: self.tokenizer.as_ref().or(file.tokenizer.as_ref()).cloned(),
            data_dir: self.data_dir.as_ref().or(file.data_dir.as_ref()).cloned(),
        }
    }
}

impl TrainingArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            epochs: self.epochs.as_ref().or(file.epochs.as_ref()).cloned(),
            batch_size: self
                .batch_size
                .as_ref()
                .or(file.batch_size.as_ref())
                .cloned(),
            lr: self.lr.as_ref().or(file.lr.as_ref()).cloned(),
            lr_schedule: self
                .lr_schedule
                .as_ref()
                .or(file.lr_schedule.as_ref())
                .cloned(),
            warmup_steps: self
                .warmup_steps
                .as_ref()
                .or(file.warmup_steps.as_ref())
                .cloned(),
            optimizer: self.optimizer.as_ref().or(file.optimizer.as_ref()).cloned(),
            momentum: self.momentum.as_ref().or(file.momentum.as_ref()).cloned(),
            weight_decay: self
                .weight_decay
                .as_ref()
                .or(file.weight_decay.as_ref())
                .cloned(),
            decay_embeddings: self
                .decay_embeddings
                .as_ref()
                .or(file.decay_embeddings.as_ref())
                .cloned(),
            clip_grad_norm: self
                .clip_grad_norm
                .as_ref()
                .or(file.clip_grad_norm.as_ref())
                .cloned(),
            threads: self.threads.as_ref().or(file.threads.as_ref()).cloned(),
            seed: self.seed.as_ref().or(file.seed.as_ref()).cloned(),
            max_steps: self.max_steps.as_ref().or(file.max_steps.as_ref()).cloned(),
            train_samples: self
                .train_samples
                .as_ref()
                .or(file.train_samples.as_ref())
                .cloned(),
        }
    }
}

impl OutputArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            target_accuracy: self
                .target_accuracy
                .as_ref()
                .or(file.target_accuracy.as_ref())
                .cloned(),
            eval_every: self
                .eval_every
                .as_ref()
                .or(file.eval_every.as_ref())
                .cloned(),
            early_stop: self
                .early_stop
                .as_ref()
                .or(file.early_stop.as_ref())
                .cloned(),
            keep_best: self.keep_best.as_ref().or(file.keep_best.as_ref()).cloned(),
            out: self.out.as_ref().or(file.out.as_ref()).cloned(),
            checkpoint_every: self
                .checkpoint_every
                .as_ref()
                .or(file.checkpoint_every.as_ref())
                .cloned(),
            no_checkpoint: self
                .no_checkpoint
                .as_ref()
                .or(file.no_checkpoint.as_ref())
                .cloned(),
            keep_checkpoints: self
                .keep_checkpoints
                .as_ref()
                .or(file.keep_checkpoints.as_ref())
                .cloned(),
            resume: self.resume.as_ref().or(file.resume.as_ref()).cloned(),
            overwrite: self.overwrite.as_ref().or(file.overwrite.as_ref()).cloned(),
            verbose: self.verbose.as_ref().or(file.verbose.as_ref()).cloned(),
        }
    }
}

impl FaultArgs {
    /// These options over `file`'s.
    pub fn merged_over(&self, file: &Self) -> Self {
        Self {
            shrink_on_failure: self
                .shrink_on_failure
                .as_ref()
                .or(file.shrink_on_failure.as_ref())
                .cloned(),
            insecure_plaintext: self
                .insecure_plaintext
                .as_ref()
                .or(file.insecure_plaintext.as_ref())
                .cloned(),
            max_restarts: self
                .max_restarts
                .as_ref()
                .or(file.max_restarts.as_ref())
                .cloned(),
            crash_rank: self
                .crash_rank
                .as_ref()
                .or(file.crash_rank.as_ref())
                .cloned(),
            crash_after_ms: self
                .crash_after_ms
                .as_ref()
                .or(file.crash_after_ms.as_ref())
                .cloned(),
            crash_plan: self
                .crash_plan
                .as_ref()
                .or(file.crash_plan.as_ref())
                .cloned(),
            freeze_rank: self
                .freeze_rank
                .as_ref()
                .or(file.freeze_rank.as_ref())
                .cloned(),
            freeze_after_ms: self
                .freeze_after_ms
                .as_ref()
                .or(file.freeze_after_ms.as_ref())
                .cloned(),
            hang_rank: self.hang_rank.as_ref().or(file.hang_rank.as_ref()).cloned(),
            hang_after_ms: self
                .hang_after_ms
                .as_ref()
                .or(file.hang_after_ms.as_ref())
                .cloned(),
            recv_timeout: self
                .recv_timeout
                .as_ref()
                .or(file.recv_timeout.as_ref())
                .cloned(),
            stall_timeout: self
                .stall_timeout
                .as_ref()
                .or(file.stall_timeout.as_ref())
                .cloned(),
        }
    }
}

impl TrainArgs {
    /// Flags over the `--config` file (if any).
    pub fn merged(&self) -> Result<Self> {
        let Some(path) = &self.config else {
            return Ok(self.clone());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("config file {}: {e}", path.display())))?;
        let text = flatten_dataset_table(path, &text)?;
        check_config_keys(path, &text)?;
        let file: TrainArgs = toml::from_str(&text).map_err(|e| {
            UsageError(format!(
                "config file {}: {}",
                path.display(),
                e.to_string().trim_end()
            ))
        })?;
        if file.model.preset.is_some() && file.model.file.is_some() {
            return Err(UsageError(format!(
                "config file {}: sets both model and model-file; keep one",
                path.display()
            ))
            .into());
        }
        // A model chosen on the command line, by preset or file, replaces the file's choice.
        let mut file = file;
        if self.model.preset.is_some() || self.model.file.is_some() {
            (file.model.preset, file.model.file) = (None, None);
        }
        Ok(TrainArgs {
            config: self.config.clone(),
            strategy: self.strategy.merged_over(&file.strategy),
            cluster: self.cluster.merged_over(&file.cluster),
            model: self.model.merged_over(&file.model),
            data: self.data.merged_over(&file.data),
            training: self.training.merged_over(&file.training),
            output: self.output.merged_over(&file.output),
            faults: self.faults.merged_over(&file.faults),
        })
    }

    /// Refuses options that the chosen strategy would ignore (from flags and config files alike),
    /// so nothing a user asked for is silently dropped.
    pub fn check_applicable(&self) -> Result<()> {
        let strategy = self.strategy();
        // `--drop-dead-workers` is the parameter server's flag and D-PSGD's too.
        let shared = |flag: &String| !(strategy == "dpsgd" && flag == "drop-dead-workers");
        let mut own: Vec<(&str, Vec<String>)> = self
            .strategy
            .options
            .given()
            .into_iter()
            .map(|(name, flags)| (name, flags.into_iter().filter(shared).collect()))
            .collect();
        let distributed: Vec<String> = [
            ("nodes", self.strategy.nodes.is_some_and(|n| n != 1)),
            ("node-speed", self.cluster.node_speed.is_some()),
            ("bandwidth-mbit", self.cluster.card.bandwidth_mbit.is_some()),
            ("latency-ms", self.cluster.card.latency_ms.is_some()),
            ("link", self.cluster.link.is_some()),
            (
                "node-memory-limit",
                self.cluster.node_memory_limit.is_some(),
            ),
            (
                "enforce-memory-limit",
                self.cluster.enforce_memory_limit.is_some(),
            ),
            ("pin", self.cluster.pin.is_some()),
            ("max-restarts", self.faults.max_restarts.is_some()),
            ("shrink-on-failure", self.faults.shrink_on_failure.is_some()),
            (
                "insecure-plaintext",
                self.faults.insecure_plaintext.is_some(),
            ),
        ]
        .into_iter()
        .filter(|(_, set)| *set)
        .map(|(flag, _)| flag.to_string())
        .collect();
        let others = Job::NAMES
            .iter()
            .filter(|n| **n != LocalJob::NAME)
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        if strategy == LocalJob::NAME {
            own.push((&others, distributed));
        }
        for (name, flags) in own {
            if name != strategy
                && let Some(flag) = flags.first()
            {
                return Err(UsageError(format!(
                    "--{flag} applies to --strategy {name} only; this run uses {strategy}"
                ))
                .into());
            }
        }
        if self.output.early_stop.is_some() && !["local", "ring"].contains(&strategy) {
            return Err(UsageError(format!(
                "--early-stop stops local and ring runs; --strategy {strategy}'s workers \
                 would each have to be told at the same step, which it does not do"
            ))
            .into());
        }
        if self.output.early_stop.is_some()
            && self.strategy.options.ring.replicas.is_some_and(|r| r > 1)
        {
            return Err(UsageError(
                "--early-stop stops one ring; with --replicas the other rings would train on"
                    .into(),
            )
            .into());
        }
        if self.training.epochs.is_some() && self.training.train_samples.is_some() {
            return Err(UsageError(
                "--epochs and --train-samples both say how long to train; give one".into(),
            )
            .into());
        }
        if self.cluster.node_memory_limit.is_some()
            && strategy != "ring"
            && !self.cluster.enforce_memory_limit.unwrap_or(false)
        {
            return Err(UsageError(format!(
                "--node-memory-limit plans the ring's stages; for --strategy {strategy} it takes \
                 effect only with --enforce-memory-limit (a kernel limit on each node process)"
            ))
            .into());
        }
        self.strategy
            .options
            .ring
            .check()
            .map_err(|e| UsageError(e.to_string()).into())
    }

    /// Each local node's emulated card, by rank, from `--bandwidth-mbit`, `--latency-ms` and the
    /// `--link` overrides.
    pub fn node_links(&self, nodes: u32) -> Result<Vec<Card>> {
        let base = self.cluster.card.card()?;
        Ok(crate::links::node_cards(
            base,
            self.cluster.link.as_deref().unwrap_or_default(),
            nodes,
        )?)
    }

    /// Every strategy's options; `--drop-dead-workers`, declared with the parameter server's,
    /// is D-PSGD's too.
    pub fn strategy_options(&self) -> StrategyOptions {
        let mut options = self.strategy.options.clone();
        options.dpsgd.drop_dead_workers = options.ps.drop_dead_workers;
        options
    }

    /// The chosen strategy's name.
    pub fn strategy(&self) -> &str {
        self.strategy.name.as_deref().unwrap_or("ring")
    }

    /// The dataset name.
    pub fn dataset(&self) -> String {
        self.data.dataset.clone().unwrap_or_else(|| "mnist".into())
    }

    /// Applies defaults and validates for `data`: a language model's (on text) are nanoGPT's.
    pub fn resolve_for(&self, data: &ringtmp_data::Dataset) -> Result<TrainConfig> {
        let data_kind = DataKind {
            text: matches!(data.task, ringtmp_data::Task::NextToken { .. }),
            input: data.input,
            classes: data.classes,
            regression: data.task == ringtmp_data::Task::Regress,
        };
        self.resolve_with(&data_kind)
    }

    /// The preset a run trains when none is named: a GPT on text, `tabular` on a CSV table,
    /// the `cnn` on images other than MNIST's 28 × 28 greyscale (whose default, the MLP,
    /// measured 97.5% in two epochs at a fraction of the cnn's cost), else `mlp`.
    pub fn model_name(&self, text: bool, input: (usize, usize, usize)) -> &str {
        let (h, w, _) = input;
        self.model.preset.as_deref().unwrap_or(if text {
            "gpt-cpu"
        } else if self.data.dataset.as_deref() == Some("csv") {
            "tabular"
        } else if h >= CNN_SMALLEST_SIDE && w >= CNN_SMALLEST_SIDE && input != (28, 28, 1) {
            "cnn"
        } else {
            "mlp"
        })
    }

    /// Your own dataset as the flags describe it (`None` for the bundled datasets and text).
    pub fn data_source(&self) -> Result<Option<ringtmp_data::DataSource>> {
        let format = self.dataset();
        if !ringtmp_data::FORMATS.contains(&format.as_str()) {
            for (set, flag) in [
                (self.data.label_file.is_some(), "--label-file"),
                (self.data.label.is_some(), "--label"),
                (self.data.target_columns.is_some(), "--target-columns"),
                (self.data.input_shape.is_some(), "--input-shape"),
                (self.data.layout.is_some(), "--layout"),
                (self.data.normalize.is_some(), "--normalize"),
            ] {
                if set {
                    return Err(UsageError(format!(
                        "{flag} describes your own data (--dataset {}), not {format}",
                        ringtmp_data::FORMATS.join("|")
                    ))
                    .into());
                }
            }
            return Ok(None);
        }
        let mut files = self.data.data_file.clone().unwrap_or_default();
        if files.is_empty()
            && let Some(dir) = &self.data.data_dir
        {
            files.push(dir.clone());
        }
        let mut source = ringtmp_data::DataSource::new(&format, files);
        source.label_files = self.data.label_file.clone().unwrap_or_default();
        source.label = self.data.label.clone();
        source.target_columns = self.data.target_columns.clone().unwrap_or_default();
        source.input_shape = self.data.input_shape.map(ringtmp_data::InputShape::dims);
        source.layout = self.data.layout.or(source.layout);
        if let Some(how) = &self.data.normalize {
            source.normalize = how.clone();
        }
        source.validation = self.data.val_fraction.unwrap_or(0.1);
        // The held-out rows do not follow --seed: runs of several seeds test on the same rows.
        Ok(Some(source))
    }

    /// How a text run reads its data.
    pub fn text_source(&self) -> ringtmp_strategy::TextSource {
        ringtmp_strategy::TextSource {
            files: self.data.data_file.clone().unwrap_or_default(),
            seq_len: self.seq_len(),
            validation: self.data.val_fraction.unwrap_or(0.1),
            eval_tokens: self.data.eval_tokens.unwrap_or(16_384),
            bin_vocab: self
                .data
                .vocab_size
                .unwrap_or(ringtmp_data::text::GPT2_VOCAB),
            // A pretrained model's text is its own tokenizer's (token files are ids already).
            tokenizer: self.data.tokenizer.clone().or_else(|| {
                let files = self.data.data_file.as_deref().unwrap_or_default();
                let ids = !files.is_empty()
                    && files
                        .iter()
                        .all(|f| f.extension().is_some_and(|e| e == "bin"));
                self.model
                    .pretrained
                    .as_ref()
                    .filter(|_| !ids)
                    .map(|p| absolute(p))
            }),
        }
    }

    /// The node processes a distributed run launches: `--nodes`, or [`DEFAULT_NODES`].
    pub fn nodes(&self) -> u32 {
        self.strategy.nodes.unwrap_or(DEFAULT_NODES)
    }

    /// Positions per window of a text run: `--seq-len`, or the preset's context, or 64.
    pub fn seq_len(&self) -> usize {
        self.data.seq_len.unwrap_or_else(|| {
            if self.model.pretrained.is_some() {
                return PRETRAINED_SEQ_LEN;
            }
            let name = if self.model.file.is_some() {
                ""
            } else {
                self.model_name(true, (1, 1, 1))
            };
            ModelSpec::preset_context(name).unwrap_or(64)
        })
    }

    /// The model of a run on `data`: the file's, or the preset named (or chosen for the data),
    /// with `--tie-embeddings`; refused when it does not read what the data holds.
    fn model_for(&self, data: &DataKind) -> Result<ModelSpec> {
        let (text, classes) = (data.text, data.classes);
        let (h, w, c) = data.input;
        let features = h * w * c;
        let model = match (&self.model.file, &self.model.pretrained) {
            (_, Some(path)) => {
                let model = ringtmp_pretrained::model::Pretrained::open(path)
                    .map_err(|e| UsageError(format!("--pretrained {e}")))?;
                let seq = self.seq_len().min(model.config.context);
                // Every tensor there, in its shape and a type ringtmp reads, before any node
                // starts.
                model
                    .layers(seq)
                    .map_err(|e| UsageError(format!("--pretrained {e}")))?;
                model
                    .spec(seq)
                    .map_err(|e| UsageError(format!("--pretrained {e}")))?
            }
            (Some(path), None) => ModelSpec::from_file(path).map_err(|e| match e {
                // The file itself is missing or unreadable: the user's mistake, said once.
                ringtmp_model::Error::Io { source, .. } => anyhow::Error::new(UsageError(format!(
                    "--model-file {}: {source}",
                    path.display()
                ))),
                other => other.into(),
            })?,
            (None, None) => {
                ModelSpec::preset_for(self.model_name(text, data.input), classes, features)?
            }
        };
        let mut model = model;
        if let Some(tie) = self.model.tie_embeddings {
            model.tie_embeddings = tie;
        }
        if text != model.reads_tokens() {
            return Err(UsageError(if text {
                format!(
                    "model {} does not read token ids: on --dataset text, train a language model \
                     (gpt-nano, gpt-cpu, gpt-small, or a model file starting with an embedding)",
                    model.name
                )
            } else {
                format!(
                    "model {} reads token ids: train it with --dataset text",
                    model.name
                )
            })
            .into());
        }
        Ok(model)
    }

    /// The optimizer and its default rate: AdamW on text and tables of classes, SGD with
    /// momentum elsewhere, unless `--optimizer` says; `recipe_lr` is a language model's
    /// recipe rate.
    fn optimizer_for(
        &self,
        text: bool,
        table_of_classes: bool,
        recipe_lr: f32,
    ) -> Result<(OptimizerConfig, f32)> {
        let optimizer_kind = self
            .training
            .optimizer
            .unwrap_or(if text || table_of_classes {
                OptimizerKind::Adamw
            } else {
                OptimizerKind::Sgd
            });
        // A pretrained model is fine-tuned as transformers' Trainer does: no decay, β₂ 0.999.
        let pretrained = self.model.pretrained.is_some();
        let weight_decay = self.training.weight_decay.unwrap_or(match optimizer_kind {
            OptimizerKind::Adamw if !pretrained => 0.1,
            _ => 0.0,
        });
        if self.training.decay_embeddings.is_some() && optimizer_kind != OptimizerKind::Adamw {
            return Err(UsageError("--decay-embeddings applies to AdamW only".into()).into());
        }
        Ok(match optimizer_kind {
            OptimizerKind::Sgd => (
                OptimizerConfig::Sgd {
                    momentum: self.training.momentum.unwrap_or(0.9),
                    weight_decay,
                },
                0.01,
            ),
            OptimizerKind::Adam => {
                if self.training.momentum.is_some() {
                    return Err(UsageError(
                        "--momentum applies to SGD only (Adam uses its own β₁)".into(),
                    )
                    .into());
                }
                (
                    OptimizerConfig::Adam {
                        beta1: 0.9,
                        beta2: 0.999,
                        eps: 1e-8,
                        weight_decay,
                    },
                    0.001,
                )
            }
            OptimizerKind::Adamw => {
                if self.training.momentum.is_some() {
                    return Err(UsageError(
                        "--momentum applies to SGD only (AdamW uses its own β₁)".into(),
                    )
                    .into());
                }
                (
                    OptimizerConfig::AdamW {
                        beta1: 0.9,
                        // nanoGPT's choice for its small models (PyTorch's default is 0.999).
                        beta2: if text && !pretrained { 0.99 } else { 0.999 },
                        eps: 1e-8,
                        weight_decay,
                        decay_embeddings: self.training.decay_embeddings.unwrap_or(false),
                    },
                    if text { recipe_lr } else { 0.001 },
                )
            }
        })
    }

    /// Applies defaults and validates; `classes` comes from the dataset (a language model's
    /// vocabulary when `text`). On text the defaults are nanoGPT's recipe for the model: AdamW
    /// (β₂ 0.99, decay 0.1), rate 1e-3 (gpt-cpu 4e-3, measured) with 100 warm-up steps and a
    /// cosine to a tenth, clipping at norm 1, and the preset's batch and steps.
    fn resolve_with(&self, data: &DataKind) -> Result<TrainConfig> {
        let text = data.text;
        let model = self.model_for(data)?;
        // nanoGPT's recipes: (batch, steps, AdamW's rate) per preset. gpt-cpu's rate is the
        // defaults sweep's best for its 2,000 steps (validation loss 1.803 at 4e-3 against
        // 1.897 at nanoGPT's 1e-3; docs/decisions/defaults.md); the others keep nanoGPT's.
        let recipe = match model.name.as_str() {
            // A pretrained model's fine-tuning: transformers' Trainer's rate (5e-5), 200 steps
            // of 8 windows.
            _ if self.model.pretrained.is_some() => (8, 200, 5e-5),
            "gpt-nano" => (8, 200, 1e-3),
            "gpt-small" => (64, 5000, 1e-3),
            "gpt-cpu" => (12, 2000, 4e-3),
            _ => (12, 2000, 1e-3),
        };
        // AdamW on text (nanoGPT's) and on tables of classes (scikit-learn's MLP uses Adam):
        // wine 100% against SGD's 97.8% on the same split; SGD with momentum elsewhere, and on a
        // table's regression (diabetes R² 0.36 against AdamW's 0.22; benches/small_tables.sh).
        let table_of_classes = self.data.dataset.as_deref() == Some("csv") && !data.regression;
        let (optimizer, default_lr) = self.optimizer_for(text, table_of_classes, recipe.2)?;
        let schedule = Defaulted::or_else(self.training.lr_schedule.clone(), || {
            if text {
                LrSchedule::CosineTo { min_ratio: 0.1 }
            } else {
                LrSchedule::Constant
            }
        });
        let strategy = self.strategy();
        // `train` chooses (and creates) the default directory before resolving; a run that
        // writes nothing (validate-config) has nothing to choose.
        let out = self
            .output
            .out
            .clone()
            .unwrap_or_else(|| crate::run_dir::default_name(strategy));
        let threads = self.training.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let wire_dtype = self.strategy.wire_dtype.unwrap_or_default().dtype();
        for (name, value) in [
            ("recv-timeout", self.faults.recv_timeout),
            ("stall-timeout", self.faults.stall_timeout),
        ] {
            if let Some(v) = value {
                check_timeout(name, v)?;
            }
        }
        let config = TrainConfig {
            model,
            wire_dtype,
            dataset: self.dataset(),
            data_dir: self.data.data_dir.clone(),
            epochs: self.training.epochs.unwrap_or(2),
            batch_size: self
                .training
                .batch_size
                .unwrap_or(if text { recipe.0 } else { 64 }),
            lr: Defaulted::or_else(self.training.lr, || default_lr),
            schedule,
            warmup_steps: Defaulted::or_else(self.training.warmup_steps, || {
                if text { 100 } else { 0 }
            }),
            momentum: if self.training.momentum.is_some() {
                Origin::Given
            } else {
                Origin::Default
            },
            optimizer,
            threads,
            seed: self.training.seed.unwrap_or(42),
            target_accuracy: self.output.target_accuracy.unwrap_or(0.97),
            eval_every: self
                .output
                .eval_every
                .unwrap_or(if text { 250 } else { 200 }),
            out,
            checkpoint_every: match (self.output.no_checkpoint, self.output.checkpoint_every) {
                (Some(true), _) => 0,
                (_, Some(every)) => every,
                (_, None) => ringtmp_strategy::CHECKPOINT_AT_END,
            },
            keep_checkpoints: self.output.keep_checkpoints,
            resume: self.output.resume.clone(),
            max_steps: self.training.max_steps,
            // A text's epoch is every window once (millions of steps): a language model trains
            // for its recipe's steps unless told otherwise.
            train_samples: self.training.train_samples.or_else(|| {
                (text && self.training.epochs.is_none())
                    .then(|| recipe.1 * self.training.batch_size.unwrap_or(recipe.0) as u64)
            }),
            // Two epochs of a small table or image folder are a handful of steps.
            min_samples: (!text
                && self.training.epochs.is_none()
                && self.training.train_samples.is_none())
            .then(|| SMALL_DATA_STEPS * self.training.batch_size.unwrap_or(64) as u64),
            keep_best: self.output.keep_best.unwrap_or(!text),
            early_stop: self.output.early_stop,
            // 0 turns the language models' default clipping off.
            clip_grad_norm: match self.training.clip_grad_norm {
                Some(0.0) => None,
                Some(c) => Some(c),
                None => text.then_some(1.0),
            },
            text: text.then(|| self.text_source()),
            source: self.data_source()?,
            // A pretrained model's files, from which each stage reads its layers; else set once
            // --init-from's weights are converted into the run's directory (init_from.rs).
            init_from: self.model.pretrained.as_ref().map(|p| absolute(p)),
            recv_timeout_secs: self
                .faults
                .recv_timeout
                .unwrap_or(ringtmp_strategy::DEFAULT_RECV_TIMEOUT_SECS),
            stall_timeout_secs: self.faults.stall_timeout,
            threads_from_machine: self.training.threads.is_none(),
        };
        config.validate().context("invalid training options")
    }
}

/// The fewest steps (of the default batch) a run whose length is the default takes: the
/// measured need of scikit-learn's bundled tables (digits' MLP reaches its accuracy at about
/// 1,000 steps of 64; docs/BENCHMARKS.md, `benches/small_tables.sh`). MNIST's two epochs are
/// more, so the default run is as it was.
const SMALL_DATA_STEPS: u64 = 1000;

/// The smallest height and width the `cnn` preset takes (two 5 × 5 convolutions, each pooled).
const CNN_SMALLEST_SIDE: usize = 16;

/// What the defaults depend on of the data.
struct DataKind {
    /// A language model's windows of tokens.
    text: bool,
    /// Per-example input shape `(height, width, channels)`.
    input: (usize, usize, usize),
    /// Classes (a vocabulary, or a regression's targets).
    classes: usize,
    /// A regression target.
    regression: bool,
}

/// Node processes a distributed run launches when `--nodes` is not given.
pub const DEFAULT_NODES: u32 = 4;

/// The data keys a config file's `[dataset]` table may hold (besides `format`).
pub(crate) const DATASET_TABLE_KEYS: [&str; 12] = [
    "data-file",
    "data-dir",
    "label-file",
    "label",
    "target-columns",
    "input-shape",
    "layout",
    "normalize",
    "val-fraction",
    "seq-len",
    "vocab-size",
    "tokenizer",
];

/// A config file's `[dataset]` table (`format = "csv"`, `data-file = [...]`, …) as the flat
/// keys the flags have (`dataset = "csv"`, …): the data described in one place, read as the
/// flags are.
fn flatten_dataset_table(path: &std::path::Path, text: &str) -> Result<String> {
    let bad = |what: String| UsageError(format!("config file {}: {what}", path.display()));
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| bad(e.to_string().trim_end().to_string()))?;
    let Some(toml::Value::Table(dataset)) = table.get("dataset").cloned() else {
        return Ok(text.to_string());
    };
    table.remove("dataset");
    for (key, value) in dataset {
        let flat = if key == "format" {
            "dataset".to_string()
        } else if DATASET_TABLE_KEYS.contains(&key.as_str()) {
            key.clone()
        } else {
            return Err(bad(format!(
                "[dataset] has unknown key `{key}` (its keys are format, {})",
                DATASET_TABLE_KEYS.join(", ")
            ))
            .into());
        };
        if table.contains_key(&flat) {
            return Err(bad(format!("sets {flat} both in [dataset] and outside it")).into());
        }
        // A single file may be written as a string.
        let value = match (flat.as_str(), value) {
            ("data-file" | "label-file", toml::Value::String(s)) => {
                toml::Value::Array(vec![toml::Value::String(s)])
            }
            (_, v) => v,
        };
        table.insert(flat, value);
    }
    Ok(toml::to_string(&table).map_err(|e| bad(e.to_string()))?)
}

/// Refuses a config file key that is no `ringtmp train` option (a typo would otherwise be
/// ignored: the options of the strategies are flattened, which serde cannot check by itself).
fn check_config_keys(path: &std::path::Path, text: &str) -> Result<()> {
    let table: toml::Table = toml::from_str(text).map_err(|e| {
        UsageError(format!(
            "config file {}: {}",
            path.display(),
            e.to_string().trim_end()
        ))
    })?;
    let train = TrainArgs::augment_args(clap::Command::new("train"));
    let known: Vec<&str> = train
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long())
        .filter(|long| *long != "config")
        .collect();
    for key in table.keys() {
        if !known.contains(&key.as_str()) {
            return Err(UsageError(format!(
                "config file {}: unknown option `{key}` (the keys are the long flags of `ringtmp \
                 train`, e.g. batch-size)",
                path.display()
            ))
            .into());
        }
    }
    Ok(())
}

/// Longest timeout a node takes: a week. Deadlines are instants that must stay representable
/// once added to the clock, and no wait of a run is meant to be longer.
const MAX_TIMEOUT_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Refuses a timeout that is not positive or longer than a week (bad input, exit 2).
pub(crate) fn check_timeout(name: &str, v: f64) -> Result<()> {
    if !(v > 0.0 && v <= MAX_TIMEOUT_SECONDS) {
        return Err(UsageError(format!(
            "--{name} must be a positive number of seconds, at most {MAX_TIMEOUT_SECONDS} (a \
             week); got {v}"
        ))
        .into());
    }
    Ok(())
}

/// A count that must be at least 1 (`--threads`, `--limit`): clap refuses 0 as bad input.
pub fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--wire-dtype`: what tensors travel as between nodes (computation stays f32).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireDtype {
    /// 32-bit floats: exact.
    #[default]
    F32,
    /// bfloat16: f32's range, 8 bits of mantissa.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl WireDtype {
    /// The wire's dtype.
    pub fn dtype(self) -> ringtmp_wire::Dtype {
        match self {
            Self::F32 => ringtmp_wire::Dtype::F32,
            Self::Bf16 => ringtmp_wire::Dtype::Bf16,
            Self::F16 => ringtmp_wire::Dtype::F16,
        }
    }
}

/// Positions per window of a pretrained model's text run unless --seq-len says (its context
/// where that is shorter).
const PRETRAINED_SEQ_LEN: usize = 256;

/// `path` made absolute (node processes may run elsewhere in the tree).
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_data_the_cnn_for_images_other_than_mnist_s_adamw_for_tables_of_classes()
    {
        let images = TrainArgs {
            data: DataArgs {
                dataset: Some("images".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(images.model_name(false, (32, 32, 3)), "cnn");
        assert_eq!(images.model_name(false, (28, 28, 1)), "mlp");
        assert_eq!(
            images.model_name(false, (8, 8, 1)),
            "mlp",
            "too small for the cnn"
        );
        let table = TrainArgs {
            data: DataArgs {
                dataset: Some("csv".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(table.model_name(false, (1, 13, 1)), "tabular");
        let optimizer = |regression| {
            let kind = DataKind {
                text: false,
                input: (1, 13, 1),
                classes: if regression { 1 } else { 3 },
                regression,
            };
            table.resolve_with(&kind).unwrap().optimizer
        };
        assert!(matches!(optimizer(false), OptimizerConfig::AdamW { .. }));
        assert!(matches!(optimizer(true), OptimizerConfig::Sgd { .. }));
    }

    #[test]
    fn a_default_run_directory_is_named_after_the_strategy_without_quotes() {
        let args = TrainArgs {
            strategy: StrategyArgs {
                name: Some("local".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let config = args
            .resolve_with(&DataKind {
                text: false,
                input: (28, 28, 1),
                classes: 10,
                regression: false,
            })
            .unwrap();
        let name = config
            .out
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.ends_with("-local"), "{name}");
        assert!(config.out.starts_with("runs"), "{}", config.out.display());
    }
}
