//! The `local` strategy: one process, one [`Stage`] holding the whole model, plain mini-batch
//! training. It is the oracle: every distributed strategy must reproduce its parameters (exactly
//! for the synchronous ones, statistically for the others) on the same seed and data order.
//!
//! Clocks: `train_seconds` runs while batches are gathered and computed and stops during
//! evaluation and checkpointing, so throughput and time-to-target do not depend on how often the
//! user asks for evaluations. `compute_seconds` covers forward, loss, backward and the optimizer
//! step; the rest of the training clock is reported as idle (data gathering, logging).

use std::path::Path;
use std::time::Instant;

use ringtmp_data::{BatchPlan, Dataset, Split};
use ringtmp_metrics::{NodeSummary, Summary, resources};
use ringtmp_model::checkpoint::{self, Manifest};
use ringtmp_model::{Optimizer, Pass, Stage, loss};
use serde_json::json;

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::job::{Cluster, NodeCx, Strategy, validate_shared};
use crate::recorder::RunRecorder;
use crate::spec::RunSpec;

/// The `local` strategy's job: the whole model in one process.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LocalJob {
    /// The run (resumes itself from `resume`).
    #[serde(flatten)]
    pub spec: RunSpec,
}

impl Strategy for LocalJob {
    const NAME: &'static str = "local";
    type Options = ();

    fn plan(config: TrainConfig, _: &(), cluster: &Cluster, data: &Dataset) -> Result<Self> {
        if cluster.nodes != 1 {
            return Err(Error::Config(
                "--strategy local trains in one process; --nodes needs a distributed strategy \
                 (check a multi-node setup with `ringtmp selftest --nodes N`)"
                    .into(),
            ));
        }
        let batch = config.batch_size;
        let mut spec = RunSpec::new(config, data, batch)?;
        // Checked here, before the run starts, so that a checkpoint that does not fit (or has
        // nothing left to train) is refused before any output is written.
        if let Some(path) = spec.config.resume.clone() {
            let (dir, manifest) = check_resume(&path, &spec.config, data)?;
            spec.resume_from = Some(crate::ResumePoint {
                dir: std::path::absolute(&dir).unwrap_or(dir),
                step: manifest.step.min(spec.total_steps),
            });
        }
        Ok(Self { spec })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, 1)
    }

    fn neighbours(&self, _: u32, _: u32) -> std::collections::BTreeSet<u32> {
        std::collections::BTreeSet::new()
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn run(&self, _: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        train_local(&self.spec.config, data, cx.on_event).map(Some)
    }
}

/// Progress reported to the caller (the CLI draws it).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Training is about to start.
    Started {
        /// Steps the run will take in total.
        total_steps: u64,
        /// Step resumed from (0 for a fresh run).
        first_step: u64,
        /// Parameters in the whole model.
        params: usize,
        /// Parameters of each stage, in ring order, when the model is split (else empty).
        stage_params: Vec<usize>,
    },
    /// An optimizer step finished.
    Step {
        /// Steps completed.
        step: u64,
        /// Epoch of that step.
        epoch: u64,
        /// Mean training loss of the step's mini-batch.
        loss: f64,
        /// Training examples per training second so far.
        samples_per_second: f64,
    },
    /// An evaluation on the test split finished.
    Eval {
        /// Steps completed.
        step: u64,
        /// Epoch in progress.
        epoch: u64,
        /// Test accuracy.
        accuracy: f64,
        /// Mean test loss.
        loss: f64,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Steps completed.
        step: u64,
        /// Its directory.
        path: std::path::PathBuf,
    },
}

/// Labels per evaluation forward pass: large enough for efficient GEMMs, small enough that the
/// activations of one pass stay a few tens of MB.
const EVAL_ROWS: usize = 250;

/// Logits an evaluation pass of a language model holds at most (16 MB), so that a vocabulary of
/// GPT-2's size evaluates in passes of a window or two rather than of 400 MB.
const EVAL_LOGITS: usize = 1 << 22;

/// Examples per evaluation forward pass of `split` for a model of `classes` outputs per
/// position: 250 images, or windows of about 2,000 positions in all and at most
/// 4 M logits (16 MB; at least one window).
pub fn eval_chunk(split: &Split, classes: usize) -> usize {
    match split.positions() {
        1 => EVAL_ROWS,
        positions => (8 * EVAL_ROWS / positions)
            .min(EVAL_LOGITS / (positions * classes.max(1)))
            .max(1),
    }
}

/// Trains `cfg.model` on `data` in this process and writes `metrics.jsonl`, `summary.json` and
/// checkpoints under `cfg.out`.
pub fn train_local(
    cfg: &TrainConfig,
    data: &Dataset,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary> {
    let wall = Instant::now();
    let layers = crate::layers_for(&cfg.model, data)?;
    let mut model = Stage::new(&layers, 0..layers.len(), cfg.seed, cfg.threads);
    // Per-layer times for the summary: two clock reads per layer and pass.
    model.set_profiling(true);
    let mut optimizer = Optimizer::new(cfg.optimizer.clone(), model.params().len());
    let mut plan = BatchPlan::new(data.train.len(), cfg.batch_size, cfg.seed)?;
    let per_epoch = plan.batches_per_epoch() as u64;
    // The schedule spans the configured epochs (or samples); `max_steps` only stops early, so a
    // run cut short and resumed follows the same learning-rate curve as one that is not.
    let schedule_steps = cfg.schedule_steps(per_epoch, cfg.batch_size);
    let total_steps = cfg.max_steps.unwrap_or(u64::MAX).min(schedule_steps);

    let mut step = 0u64;
    if let Some(resume) = &cfg.resume {
        step = resume_from(resume, cfg, data, &mut model, &mut optimizer)?;
    }
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size)?;
    if step > 0 {
        spec.resume_from = Some(crate::ResumePoint {
            dir: cfg.resume.clone().unwrap_or_default(),
            step,
        });
    }
    let mut recorder = RunRecorder::open(&spec, "local", json!({"params": model.params().len()}))?;
    on_event(&Event::Started {
        total_steps,
        first_step: step,
        params: model.params().len(),
        stage_params: Vec::new(),
    });

    let classes = data.classes;
    let (mut x, mut y, mut dlogits) = (Vec::new(), Vec::new(), Vec::new());
    let (mut train_seconds, mut compute_seconds) = (0.0f64, 0.0f64);
    let mut samples = 0u64;
    let first_step = step;
    while step < total_steps {
        let epoch = step / per_epoch;
        let index = (step % per_epoch) as usize;
        let t_batch = Instant::now();
        let batch = plan.batch(epoch, index);
        let rows = batch.len();
        data.train.gather(batch, &mut x, &mut y);
        let t_compute = Instant::now();
        let pass = Pass {
            train: true,
            seed: cfg.seed,
            step,
            row_offset: 0,
        };
        let logits = model.forward(0, &x, rows, &pass)?;
        dlogits.resize(logits.len(), 0.0);
        let out =
            loss::softmax_cross_entropy(logits, &y, classes, 1.0 / y.len() as f32, &mut dlogits)?;
        let lr = cfg
            .schedule
            .rate(cfg.lr, step, schedule_steps, per_epoch, cfg.warmup_steps);
        match cfg.clip_grad_norm {
            // The norm needs the whole gradient before any update.
            Some(max_norm) => {
                model.backward(0, &dlogits)?;
                let norm = model.grad_norm_squared().sqrt();
                model.scale_grads(clip_factor(norm, max_norm));
                model.step(&mut optimizer, lr);
            }
            None => {
                model.backward_and_step(0, &dlogits, &mut optimizer, lr, &mut || {})?;
            }
        }
        compute_seconds += t_compute.elapsed().as_secs_f64();
        train_seconds += t_batch.elapsed().as_secs_f64();

        let mean_loss = out.loss_sum / y.len() as f64;
        if !mean_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: mean_loss,
            });
        }
        step += 1;
        samples += rows as u64;
        let sps = samples as f64 / train_seconds.max(1e-9);
        recorder.step(step, mean_loss, lr, (train_seconds, samples))?;
        on_event(&Event::Step {
            step,
            epoch,
            loss: mean_loss,
            samples_per_second: sps,
        });

        let last = step == total_steps;
        if recorder.eval_due(step) {
            let (accuracy, test_loss) = evaluate(&mut model, &data.test, classes)?;
            recorder.eval(
                step,
                accuracy,
                Some(test_loss),
                train_seconds,
                wall.elapsed().as_secs_f64(),
            )?;
            on_event(&Event::Eval {
                step,
                epoch,
                accuracy,
                loss: test_loss,
            });
        }
        if cfg.checkpoint_every > 0 && (step % cfg.checkpoint_every == 0 || last) {
            let dir = save_checkpoint(&spec, &model, &optimizer, step, per_epoch)?;
            recorder.checkpoint(step, &dir)?;
            on_event(&Event::Checkpoint { step, path: dir });
        }
    }
    if step == first_step {
        // Nothing left to train (resumed at the end): still report the model's accuracy.
        let (accuracy, test_loss) = evaluate(&mut model, &data.test, classes)?;
        recorder.eval(
            step,
            accuracy,
            Some(test_loss),
            train_seconds,
            wall.elapsed().as_secs_f64(),
        )?;
    }

    let params = model.params().len() as u64;
    let node = NodeSummary {
        rank: 0,
        role: "local".into(),
        params,
        param_bytes: params * 4,
        optimizer_bytes: optimizer.state_bytes() as u64,
        peak_rss_bytes: resources::peak_rss_bytes().unwrap_or(0),
        compute_seconds,
        idle_seconds: (train_seconds - compute_seconds).max(0.0),
        cpu_seconds: resources::cpu_seconds(),
        steal_seconds: resources::steal_seconds(),
        throttled_seconds: resources::quota_throttled_seconds(),
        layer_seconds: model.layer_seconds(),
        ..Default::default()
    };
    let (run_seconds, run_samples) = recorder.run_figures(train_seconds, samples);
    let summary = Summary {
        model_params: params,
        steps: step,
        // The whole run's (a restarted run's earlier attempts included).
        samples: run_samples,
        wall_seconds: recorder.carried().wall_seconds + wall.elapsed().as_secs_f64(),
        train_seconds: run_seconds,
        samples_per_second: run_samples as f64 / run_seconds.max(1e-9),
        per_node: vec![node],
        ..recorder.summary("local", 1)
    };
    let summary = recorder.finish(summary)?;
    Ok(summary)
}

/// The factor that brings a gradient of global L2 norm `norm` down to `max_norm` (1 when it is
/// already within): PyTorch's `clip_grad_norm_`, `max_norm / (norm + 1e-6)` clamped to 1.
pub fn clip_factor(norm: f64, max_norm: f32) -> f32 {
    (f64::from(max_norm) / (norm + 1e-6)).min(1.0) as f32
}

/// Test accuracy and mean loss of `model` on `split`.
pub fn evaluate(model: &mut Stage, split: &Split, classes: usize) -> Result<(f64, f64)> {
    // Not charged to the training compute a simulated node accounts next.
    ringtmp_meter::unmetered(|| evaluate_metered(model, split, classes))
}

fn evaluate_metered(model: &mut Stage, split: &Split, classes: usize) -> Result<(f64, f64)> {
    let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
    let (mut correct, mut loss_sum) = (0usize, 0.0f64);
    let mut start = 0;
    while start < split.len() {
        let end = (start + eval_chunk(split, classes)).min(split.len());
        split.gather_range(start, end, &mut x, &mut y);
        let logits = model.infer(&x, end - start)?;
        d.resize(logits.len(), 0.0);
        let out = loss::softmax_cross_entropy(logits, &y, classes, 0.0, &mut d)?;
        correct += out.correct;
        loss_sum += out.loss_sum;
        start = end;
    }
    let n = (split.len() * split.positions()).max(1) as f64;
    Ok((correct as f64 / n, loss_sum / n))
}

fn save_checkpoint(
    spec: &RunSpec,
    model: &Stage,
    optimizer: &Optimizer,
    step: u64,
    per_epoch: u64,
) -> Result<std::path::PathBuf> {
    let cfg = &spec.config;
    let dir = cfg
        .out
        .join("checkpoints")
        .join(checkpoint::checkpoint_dir_name(step));
    let written = write_checkpoint(&dir, spec, model, optimizer, step, per_epoch);
    if written.is_err() {
        // A checkpoint is complete only with its manifest; leave no half-written one behind.
        let _ = std::fs::remove_dir_all(&dir);
    }
    written?;
    if let Some(keep) = cfg.keep_checkpoints {
        checkpoint::retain_newest(&cfg.out.join("checkpoints"), keep)?;
    }
    Ok(dir)
}

fn write_checkpoint(
    dir: &std::path::Path,
    spec: &RunSpec,
    model: &Stage,
    optimizer: &Optimizer,
    step: u64,
    per_epoch: u64,
) -> Result<()> {
    let cfg = &spec.config;
    let file = checkpoint::write_stage(dir, "stage-0.safetensors", model, optimizer)?;
    debug_assert_eq!(per_epoch, spec.steps_per_epoch, "the plan's epochs are the spec's");
    let manifest = spec.manifest(
        "local",
        step,
        cfg.batch_size,
        vec![(0, model.layers().len())],
        vec![file],
        Vec::new(),
    );
    checkpoint::write_manifest(dir, &manifest)?;
    Ok(())
}

/// Loads a checkpoint into `model` and `optimizer` after checking it belongs to this run's model,
/// data and optimizer; returns the step to continue from.
fn resume_from(
    path: &Path,
    cfg: &TrainConfig,
    data: &Dataset,
    model: &mut Stage,
    optimizer: &mut Optimizer,
) -> Result<u64> {
    let (dir, manifest) = check_resume(path, cfg, data)?;
    checkpoint::read_stage(&dir, &manifest, model, optimizer)?;
    Ok(manifest.step)
}

/// Finds the checkpoint `path` means and checks that it was written for this run's model, data
/// order (dataset, batch size, seed) and optimizer; any strategy and any partition may have
/// written it. Returns its directory and manifest.
pub fn check_resume(
    path: &Path,
    cfg: &TrainConfig,
    data: &Dataset,
) -> Result<(std::path::PathBuf, Manifest)> {
    let dir = checkpoint::resolve(path)?;
    let manifest = checkpoint::read_manifest(&dir)?;
    let mismatch = |what: &str, theirs: String, ours: String| {
        Err(Error::Config(format!(
            "cannot resume from {}: it was written with {what} {theirs}, this run uses {ours}",
            dir.display()
        )))
    };
    // The vocabulary first: a preset's shapes follow it, so a model mismatch may be only this.
    let vocabulary = crate::spec::vocabulary_of(data);
    if manifest.vocabulary != vocabulary {
        let parse = |line: &Option<String>| {
            line.as_deref()
                .map(|l| ringtmp_data::Vocabulary::from_line(l, "vocabulary"))
        };
        let why = match (parse(&manifest.vocabulary), parse(&vocabulary)) {
            (Some(Ok(theirs)), Some(Ok(ours))) => theirs
                .check_matches(&ours)
                .err()
                .unwrap_or_else(|| "the vocabularies differ".into()),
            _ => "one of them is a language model's and the other is not".into(),
        };
        return Err(Error::Config(format!(
            "cannot resume from {}: its vocabulary is not this data's: {why}",
            dir.display()
        )));
    }
    if manifest.model.layers != cfg.model.layers {
        let (theirs, ours) = if manifest.model.name == cfg.model.name {
            // One name, other layers (another vocabulary or file): say how they differ.
            (
                format!("{} ({:?})", manifest.model.name, manifest.model.layers),
                format!("{:?}", cfg.model.layers),
            )
        } else {
            (manifest.model.name.clone(), cfg.model.name.clone())
        };
        return mismatch("model", theirs, ours);
    }
    if manifest.dataset != cfg.dataset {
        return mismatch("dataset", manifest.dataset.clone(), cfg.dataset.clone());
    }
    if manifest.batch_size != cfg.batch_size {
        return mismatch(
            "batch size",
            manifest.batch_size.to_string(),
            cfg.batch_size.to_string(),
        );
    }
    if manifest.seed != cfg.seed {
        return mismatch("seed", manifest.seed.to_string(), cfg.seed.to_string());
    }
    if std::mem::discriminant(&manifest.optimizer) != std::mem::discriminant(&cfg.optimizer) {
        return mismatch(
            "optimizer",
            format!("{:?}", manifest.optimizer),
            format!("{:?}", cfg.optimizer),
        );
    }
    Ok((dir, manifest))
}
