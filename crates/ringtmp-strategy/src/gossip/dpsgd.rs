//! One worker of D-PSGD (Lian et al., NeurIPS 2017): synchronous decentralised SGD. Every
//! iteration a worker computes the gradient of its share of the global batch at its own model
//! x_i, sends x_i to its neighbours, replaces it by the uniform average of itself and what they
//! sent (the mixing matrix of [`super::mixing`]), and applies its gradient:
//! x_i ← Σ_j W_ij x_j − γ ∇F_i(x_i).
//!
//! At every evaluation (and checkpoint) the workers all-reduce their models over the ring links
//! to form the consensus model x̄ the papers evaluate; rank 0 scores it and records the consensus
//! distance (mean ‖x_i − x̄‖ / ‖x̄‖). Invariants: a model is averaged with its neighbours' in rank
//! order (reproducible); messages of one link arrive in order, so a worker reads each
//! neighbour's model of this iteration before anything that neighbour sends later.

use std::time::Instant;

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::{NodeSummary, Summary};
use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes_into, tensor_values};
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};
use serde_json::json;

use super::DpsgdJob;
use crate::allreduce::driver::{all_reduce, gather_reports, write_model};
use crate::error::{Error, Result};
use crate::spec::ResumePoint;

/// What a worker returns: its own model, and on rank 0 the run's summary.
pub struct WorkerOutcome {
    /// This worker's final model.
    pub stage: Stage,
    /// Rank 0's summary of the run.
    pub summary: Option<Summary>,
}

fn protocol(net: &dyn Transport, from: u32, what: &str) -> Error {
    Error::Transport(TransportError::Io {
        context: format!("d-psgd: unexpected {what} from {}", net.peer_name(from)),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not part of the protocol"),
    })
}

/// The consensus of the workers' models (their mean, on every worker) and the consensus distance
/// (mean over workers of ‖x_i − x̄‖ / ‖x̄‖), by two all-reduces over the ring links.
fn consensus(
    net: &mut dyn Transport,
    rank: u32,
    n: u32,
    params: &[f32],
    round: u64,
    job: &DpsgdJob,
) -> Result<(Vec<f32>, f64)> {
    let timeout = job.spec.recv_timeout();
    let mut mean = params.to_vec();
    all_reduce(net, rank, n, &mut mean, 2 * round, timeout)?;
    let scale = 1.0 / n as f32;
    mean.iter_mut().for_each(|v| *v *= scale);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, m) in params.iter().zip(&mean) {
        diff += f64::from(x - m).powi(2);
        norm += f64::from(*m).powi(2);
    }
    let mut distance = [(diff.sqrt() / norm.sqrt().max(f64::MIN_POSITIVE)) as f32];
    all_reduce(net, rank, n, &mut distance, 2 * round + 1, timeout)?;
    Ok((mean, f64::from(distance[0]) / f64::from(n)))
}

/// Runs worker `rank` of `job` on `data`; rank 0 evaluates the consensus model, checkpoints it
/// and writes the run's outputs.
pub fn run_worker(
    job: &DpsgdJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<WorkerOutcome> {
    run_worker_from(job, rank, data, net, on_event, None)
}

/// [`run_worker`] from the given initial model instead of the seed's (tests of the gossip
/// itself start the workers apart).
pub fn run_worker_from(
    job: &DpsgdJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
    initial: Option<&[f32]>,
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers as u32;
    let near: Vec<u32> = super::mixing::neighbours(job.topology, rank, n)
        .into_iter()
        .collect();
    let layers = spec.layers()?;
    let mut stage = Stage::new(&layers, 0..layers.len(), spec.seed, spec.threads);
    let mut optimizer = Optimizer::new(spec.optimizer.clone(), stage.params().len());
    if let Some(ResumePoint { dir, .. }) = &spec.resume_from {
        let manifest = checkpoint::read_manifest(dir)?;
        checkpoint::read_stage(dir, &manifest, &mut stage, &mut optimizer)?;
    }
    if let Some(initial) = initial {
        stage.params_mut().copy_from_slice(initial);
    }
    let clock = net.clock();
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    let mut plan = BatchPlan::new(data.train.len(), spec.batch_size * n as usize, spec.seed)?;
    let mut share = crate::data_parallel::ShareBuffers::default();
    let mut recorder = crate::data_parallel::open_recorder(
        spec,
        super::NAME,
        rank,
        stage.params().len(),
        json!({"workers": n, "topology": job.topology,
                    "second_eigenvalue": super::mixing::second_eigenvalue(job.topology, n)}),
        on_event,
    )?;
    let started = clock.now();
    let (mut train_seconds, mut compute_seconds, mut gossip_wait) = (0.0f64, 0.0f64, 0.0f64);
    let (mut samples, mut last_distance) = (0u64, None);
    let mut mixed: Vec<f32> = Vec::new();
    let mut received: Vec<f32> = Vec::new();
    for step in spec.first_step()..spec.total_steps {
        let t_step = clock.now();
        let epoch = step / spec.steps_per_epoch;
        let (t0, wall) = (clock.now(), Instant::now());
        let step_loss = crate::data_parallel::forward_share(
            spec, &mut plan, data, &mut stage, rank, n as usize, step, &mut share,
        )?;
        stage.backward(0, &share.dlogits)?;
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t0).as_secs_f64();
        // Gossip: our model to every neighbour, theirs averaged with ours in rank order.
        let waited = clock.now();
        for &p in &near {
            let header = TensorHeader {
                run_id: 0,
                step,
                micro_batch: 0,
                tag: TensorTag::Params,
                dtype: Dtype::F32,
                shape: vec![stage.params().len() as u32],
            };
            let mut payload = net.buffers().take(stage.params().len() * 4);
            tensor_bytes_into(stage.params(), Dtype::F32, &mut payload);
            net.send(p, Message::Tensor(header, payload))?;
        }
        mixed.clear();
        mixed.extend_from_slice(stage.params());
        for &p in &near {
            match net.recv_from(p, spec.recv_timeout())? {
                Message::Tensor(h, bytes)
                    if h.tag == TensorTag::Params
                        && h.step == step
                        && bytes.len() == mixed.len() * 4 =>
                {
                    tensor_values(&bytes, h.dtype, &mut received);
                    net.buffers().give(bytes);
                    mixed.iter_mut().zip(&received).for_each(|(m, v)| *m += v);
                }
                _ => return Err(protocol(net, p, "message instead of its model")),
            }
        }
        gossip_wait += (clock.now() - waited).as_secs_f64();
        let weight = 1.0 / (near.len() + 1) as f32;
        stage
            .params_mut()
            .iter_mut()
            .zip(&mixed)
            .for_each(|(x, m)| *x = m * weight);
        let lr = spec.lr_at(step);
        let (t1, wall) = (clock.now(), Instant::now());
        stage.step(&mut optimizer, lr);
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t1).as_secs_f64();
        train_seconds += (clock.now() - t_step).as_secs_f64();
        samples += (spec.batch_size * n as usize) as u64;
        if !step_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: step_loss,
            });
        }
        let done = step + 1;
        if let Some(recorder) = recorder.as_mut() {
            recorder.step(done, step_loss, lr, train_seconds)?;
            on_event(&crate::Event::Step {
                step: done,
                epoch,
                loss: step_loss,
                samples_per_second: samples as f64 / train_seconds.max(1e-9),
            });
        }
        let (eval, save) = (spec.eval_due(done), spec.checkpoint_due(done));
        if !(eval || save) {
            continue;
        }
        // Every worker takes part in forming the consensus; rank 0 uses it.
        let (mean, distance) = consensus(net, rank, n, stage.params(), done, job)?;
        last_distance = Some(distance);
        let Some(recorder) = recorder.as_mut() else {
            continue;
        };
        let mut model = Stage::new(&layers, 0..layers.len(), spec.seed, spec.threads);
        model.params_mut().copy_from_slice(&mean);
        if eval {
            let (accuracy, test_loss) =
                crate::local::evaluate(&mut model, &data.test, data.classes)?;
            recorder.eval(
                done,
                accuracy,
                Some(test_loss),
                train_seconds,
                (clock.now() - started).as_secs_f64(),
            )?;
            recorder.write(json!({"event": "consensus", "step": done, "distance": distance}))?;
            on_event(&crate::Event::Eval {
                step: done,
                epoch,
                accuracy,
                loss: test_loss,
            });
        }
        if save {
            // The consensus model, with rank 0's optimizer state.
            let dir = write_model(spec, n as usize, super::NAME, &model, &optimizer, done, &[])?;
            recorder.checkpoint(done, &dir)?;
            on_event(&crate::Event::Checkpoint {
                step: done,
                path: dir,
            });
        }
    }
    // Each worker's own model's accuracy, and the reports around the ring to rank 0.
    let (own_accuracy, _) = crate::local::evaluate(&mut stage, &data.test, data.classes)?;
    let params = stage.params().len() as u64;
    let own = NodeSummary {
        test_accuracy: Some(own_accuracy),
        ..crate::data_parallel::worker_summary(
            rank,
            &stage,
            &optimizer,
            net,
            &crate::data_parallel::WorkerClock {
                train_seconds,
                compute_seconds,
                wait_seconds: gossip_wait,
                iterations: spec.total_steps - spec.first_step(),
            },
        )
    };
    let Some(per_node) = gather_reports(net, rank, n, &own, spec.recv_timeout())? else {
        return Ok(WorkerOutcome {
            stage,
            summary: None,
        });
    };
    let Some(recorder) = recorder else {
        unreachable!("rank 0 gathers the reports and holds the recorder")
    };
    let total_bytes_sent: u64 = per_node.iter().map(|p| p.bytes_sent).sum();
    let summary = Summary {
        model_params: params,
        steps: spec.total_steps,
        samples,
        wall_seconds: (clock.now() - started).as_secs_f64(),
        train_seconds,
        samples_per_second: samples as f64 / train_seconds.max(1e-9),
        total_bytes_sent,
        bytes_per_sample: total_bytes_sent as f64 / samples.max(1) as f64,
        consensus_distance: last_distance,
        per_node,
        ..recorder.summary(super::NAME, n)
    };
    recorder.finish(&summary)?;
    Ok(WorkerOutcome {
        stage,
        summary: Some(summary),
    })
}
