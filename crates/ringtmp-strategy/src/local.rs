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

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::{NodeSummary, Summary, resources};
use ringtmp_model::checkpoint;
use ringtmp_model::{Optimizer, Pass, Stage};
use serde_json::json;

use crate::config::TrainConfig;
use crate::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use crate::evaluation::evaluate;
use crate::event::Event;
use crate::recorder::{RunRecorder, Verdict};
use crate::resume::check_resume;
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

/// The `local` strategy's job: the whole model in one process.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LocalJob {
    /// The run (resumes itself from `resume`).
    #[serde(flatten)]
    pub spec: RunSpec,
}

impl Strategy for LocalJob {
    const NAME: &'static str = "local";
    const FAMILY: crate::contract::Family = crate::contract::Family::Single;
    const CLIPS: bool = true;
    type Options = crate::contract::NoOptions;

    fn workers(_: &Self::Options, _: u32) -> Result<usize> {
        Ok(1)
    }

    fn plan(
        config: TrainConfig,
        _: &Self::Options,
        cluster: &Cluster,
        data: &Dataset,
        _: &mut PlanReport,
    ) -> Result<Self> {
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

/// Trains `cfg.model` on `data` in this process and writes `metrics.jsonl`, `summary.json` and
/// checkpoints under `cfg.out`.
pub fn train_local(
    cfg: &TrainConfig,
    data: &Dataset,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary> {
    let wall = Instant::now();
    let layers = crate::layers_for(&cfg.model, data)?;
    let mut model =
        cfg.initial_stage(&layers, 0..layers.len(), cfg.threads, cfg.resume.is_some())?;
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
    let objective = crate::evaluation::objective_of(&data.train);
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
        let out = objective.score(logits, &y, classes, 1.0 / y.len() as f32, &mut dlogits)?;
        let lr = cfg
            .schedule
            .rate(*cfg.lr, step, schedule_steps, per_epoch, *cfg.warmup_steps);
        match cfg.clip_grad_norm {
            // The norm needs the whole gradient before any update.
            Some(max_norm) => {
                model.backward(0, &dlogits)?;
                crate::clipping::clip_whole(&mut model, max_norm);
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
        recorder.announce_step(step, mean_loss, lr, (train_seconds, samples), on_event)?;

        let last = step == total_steps;
        let mut verdict = Verdict::default();
        if recorder.eval_due(step) {
            let score = evaluate(&mut model, &data.test, classes)?;
            verdict = recorder.announce_eval(
                step,
                score,
                train_seconds,
                wall.elapsed().as_secs_f64(),
                on_event,
            )?;
        }
        let due = || step.is_multiple_of(cfg.checkpoint_every) || last;
        if verdict.checkpoint || (cfg.checkpoint_every > 0 && due()) {
            let dir = save_checkpoint(&spec, &model, &optimizer, step, per_epoch)?;
            recorder.announce_checkpoint(step, dir, on_event)?;
        }
        if verdict.stop {
            break;
        }
    }
    if step == first_step {
        // Nothing left to train (resumed at the end): still report the model's accuracy.
        let score = evaluate(&mut model, &data.test, classes)?;
        let _ = recorder.eval(step, score, train_seconds, wall.elapsed().as_secs_f64())?;
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
    debug_assert_eq!(
        per_epoch, spec.steps_per_epoch,
        "the plan's epochs are the spec's"
    );
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
