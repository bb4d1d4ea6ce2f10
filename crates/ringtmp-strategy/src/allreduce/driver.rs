//! One worker of ring all-reduce SGD: every worker holds a replica, computes the gradient of its
//! share of each global batch, and the workers average their gradients with the ring all-reduce
//! of [`super::ring`] before every worker applies the same step.
//!
//! Gradients go out in buckets as backward produces them, last layer first (PyTorch DDP's
//! buckets): the between-layers hook of [`Stage::backward_streaming`] starts each bucket whose
//! layers are done and moves every bucket in progress as far as what has arrived allows, so the
//! reduction overlaps the rest of the backward pass. Messages of a bucket that this worker has
//! not started yet wait in that bucket until it has.
//!
//! Invariants: every chunk is summed in the plan's fixed order, so a run is reproducible and the
//! replicas stay bit-identical; the step's mean loss travels in bucket 0's last slot; every wait
//! has the job's timeout and names the peer.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::{NodeSummary, Summary};
use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_transport::Transport;
use ringtmp_wire::message::{tensor_bytes_into, tensor_values};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};
use serde_json::json;

use super::AllReduceJob;
use super::ring::{RingPlan, chunks};
use crate::error::{Error, Result};
use crate::spec::ResumePoint;

/// One bucket: a contiguous range of the flat gradient buffer reduced as one all-reduce.
struct Bucket {
    /// The gradients it covers.
    range: Range<usize>,
    /// Its values while it is reduced (bucket 0 carries the step's loss in one more slot).
    values: Vec<f32>,
    /// Its chunks.
    chunks: Vec<Range<usize>>,
    /// The next protocol step (`None` until the bucket's gradients are complete).
    step: Option<usize>,
    /// Chunks that arrived before this worker got there, by protocol step.
    early: BTreeMap<usize, Vec<f32>>,
}

/// The buckets of a replica: layers from the last, grouped until a bucket holds `bytes`.
pub fn buckets(stage: &Stage, bytes: usize) -> Vec<Range<usize>> {
    let ranges: Vec<Range<usize>> = stage
        .param_ranges()
        .map(|(_, r)| r)
        .filter(|r| !r.is_empty())
        .collect();
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges.into_iter().rev() {
        match out.last_mut() {
            Some(last) if (last.len() * 4) < bytes => last.start = r.start,
            _ => out.push(r),
        }
    }
    out
}

/// The reduction of one iteration's gradients.
struct Reducer {
    plan: RingPlan,
    succ: u32,
    pred: u32,
    iteration: u64,
    buckets: Vec<Bucket>,
    /// Values bucket 0 carries beyond its gradients (the loss: 1, or none).
    extra: usize,
    timeout: Duration,
}

/// Sums `values` over the `n` workers of the ring `rank` is on (links to `rank ± 1`), in place,
/// by the ring all-reduce: every worker ends with the same bits. `round` tags the messages (an
/// iteration), so reductions of different rounds cannot meet.
pub fn all_reduce(
    net: &mut dyn Transport,
    rank: u32,
    n: u32,
    values: &mut [f32],
    round: u64,
    timeout: Duration,
) -> Result<()> {
    if n < 2 {
        return Ok(());
    }
    let whole = 0..values.len();
    let mut reducer = Reducer::new(rank, n, std::slice::from_ref(&whole), 0, round, timeout);
    reducer.start_ready(0, values, 0.0, net)?;
    reducer.finish(net)?;
    values.copy_from_slice(&reducer.buckets[0].values);
    Ok(())
}

/// `micro_batch` of a chunk message: its bucket and protocol step.
fn chunk_id(bucket: usize, step: usize) -> u64 {
    ((bucket as u64) << 32) | step as u64
}

impl Reducer {
    /// The reduction of `ranges` (buckets) among `n` workers; bucket 0 carries `extra` more
    /// values (the step's loss).
    fn new(
        rank: u32,
        n: u32,
        ranges: &[Range<usize>],
        extra: usize,
        iteration: u64,
        timeout: Duration,
    ) -> Self {
        let buckets = ranges
            .iter()
            .enumerate()
            .map(|(b, r)| {
                let len = r.len() + if b == 0 { extra } else { 0 };
                Bucket {
                    range: r.clone(),
                    values: Vec::new(),
                    chunks: chunks(len, n as usize),
                    step: None,
                    early: BTreeMap::new(),
                }
            })
            .collect();
        Self {
            plan: RingPlan {
                rank: rank as usize,
                n: n as usize,
            },
            succ: (rank + 1) % n,
            pred: (rank + n - 1) % n,
            iteration,
            buckets,
            extra,
            timeout,
        }
    }

    /// Starts every bucket whose gradients are complete: those from `offset` on, in `tail`
    /// (`grads[offset..]`); bucket 0 also takes `loss`.
    fn start_ready(
        &mut self,
        offset: usize,
        tail: &[f32],
        loss: f32,
        net: &mut dyn Transport,
    ) -> Result<()> {
        for b in 0..self.buckets.len() {
            let bucket = &mut self.buckets[b];
            if bucket.step.is_some() || bucket.range.start < offset {
                continue;
            }
            let local = bucket.range.start - offset..bucket.range.end - offset;
            bucket.values.clear();
            bucket.values.extend_from_slice(&tail[local]);
            if b == 0 && self.extra > 0 {
                bucket.values.push(loss);
            }
            bucket.step = Some(0);
            self.send(b, net)?;
            self.advance(b, net)?;
        }
        Ok(())
    }

    /// Sends bucket `b`'s chunk for its current step.
    fn send(&self, b: usize, net: &mut dyn Transport) -> Result<()> {
        let bucket = &self.buckets[b];
        let Some(s) = bucket.step.filter(|s| *s < self.plan.steps()) else {
            return Ok(());
        };
        let chunk = &bucket.values[bucket.chunks[self.plan.send_chunk(s)].clone()];
        let header = TensorHeader {
            run_id: 0,
            step: self.iteration,
            micro_batch: chunk_id(b, s),
            tag: TensorTag::ParamGrads,
            dtype: Dtype::F32,
            shape: vec![chunk.len() as u32],
        };
        let mut payload = net.buffers().take(chunk.len() * 4);
        tensor_bytes_into(chunk, Dtype::F32, &mut payload);
        net.send(self.succ, Message::Tensor(header, payload))?;
        Ok(())
    }

    /// Applies every chunk of bucket `b` that has already arrived, step by step.
    fn advance(&mut self, b: usize, net: &mut dyn Transport) -> Result<()> {
        loop {
            let bucket = &mut self.buckets[b];
            let Some(s) = bucket.step.filter(|s| *s < self.plan.steps()) else {
                return Ok(());
            };
            let Some(values) = bucket.early.remove(&s) else {
                return Ok(());
            };
            let target = &mut bucket.values[bucket.chunks[self.plan.recv_chunk(s)].clone()];
            if values.len() != target.len() {
                return Err(Error::protocol(
                    "all-reduce",
                    net,
                    self.pred,
                    &format!(
                        "a chunk of {} values where {} were due",
                        values.len(),
                        target.len()
                    ),
                ));
            }
            if self.plan.adds(s) {
                target.iter_mut().zip(&values).for_each(|(t, v)| *t += v);
            } else {
                target.copy_from_slice(&values);
            }
            bucket.step = Some(s + 1);
            self.send(b, net)?;
        }
    }

    /// Takes in one message: a chunk of this iteration from the predecessor.
    fn take(&mut self, from: u32, message: Message, net: &mut dyn Transport) -> Result<()> {
        match message {
            Message::Tensor(h, bytes)
                if from == self.pred
                    && h.tag == TensorTag::ParamGrads
                    && h.step == self.iteration =>
            {
                let (b, s) = (
                    (h.micro_batch >> 32) as usize,
                    (h.micro_batch & 0xffff_ffff) as usize,
                );
                if b >= self.buckets.len() || s >= self.plan.steps() {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        from,
                        "chunk of no bucket",
                    ));
                }
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                net.buffers().give(bytes);
                self.buckets[b].early.insert(s, values);
                self.advance(b, net)
            }
            _ => Err(Error::protocol(
                "all-reduce",
                net,
                from,
                "message during the all-reduce",
            )),
        }
    }

    /// Handles whatever has arrived, without waiting.
    fn pump(&mut self, net: &mut dyn Transport) -> Result<()> {
        while let Some((from, message)) = net.try_recv()? {
            self.take(from, message, net)?;
        }
        Ok(())
    }

    fn done(&self) -> bool {
        self.buckets
            .iter()
            .all(|b| b.step == Some(self.plan.steps()))
    }

    /// Waits until every bucket is reduced. Chunks come from the predecessor only, so messages
    /// of other peers (another protocol's, on their own links) wait for whoever expects them.
    fn finish(&mut self, net: &mut dyn Transport) -> Result<()> {
        while !self.done() {
            let message = net.recv_from(self.pred, self.timeout)?;
            self.take(self.pred, message, net)?;
        }
        Ok(())
    }
}

/// What a worker returns: its replica, and on rank 0 the run's summary.
pub struct WorkerOutcome {
    /// The replica's final parameters (the same bits on every worker).
    pub stage: Stage,
    /// Rank 0's summary of the run.
    pub summary: Option<Summary>,
}

/// Runs worker `rank` of `job` on `data` until the job's last iteration; rank 0 evaluates,
/// checkpoints and writes the run's outputs.
pub fn run_worker(
    job: &AllReduceJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers;
    let layers = spec.layers()?;
    let mut stage = Stage::new(&layers, 0..layers.len(), spec.seed, spec.threads);
    let mut optimizer = Optimizer::new(spec.optimizer.clone(), stage.params().len());
    if let Some(ResumePoint { dir, .. }) = &spec.resume_from {
        let manifest = checkpoint::read_manifest(dir)?;
        checkpoint::read_stage(dir, &manifest, &mut stage, &mut optimizer)?;
    }
    let ranges = buckets(&stage, job.bucket_bytes);
    let clock = net.clock();
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    let mut plan = BatchPlan::new(data.train.len(), spec.batch_size * n, spec.seed)?;
    let mut share = crate::data_parallel::ShareBuffers::default();
    let mut recorder = crate::data_parallel::open_recorder(
        spec,
        super::NAME,
        rank,
        stage.params().len(),
        json!({"workers": n, "buckets": ranges.len(), "bucket_bytes": job.bucket_bytes,
                    "params": stage.params().len()}),
        on_event,
    )?;
    let started = clock.now();
    let (mut train_seconds, mut compute_seconds, mut reduce_wait) = (0.0f64, 0.0f64, 0.0f64);
    let mut samples = 0u64;
    for step in spec.first_step()..spec.total_steps {
        let t_step = clock.now();
        let epoch = step / spec.steps_per_epoch;
        let (t0, wall) = (clock.now(), Instant::now());
        let local_loss = crate::data_parallel::forward_share(
            spec, &mut plan, data, &mut stage, rank, n, step, &mut share,
        )? as f32;
        let mut reducer = Reducer::new(rank, n as u32, &ranges, 1, step, spec.recv_timeout());
        // Overlap: between layers, start the buckets whose gradients are complete and move the
        // ones in flight; a failure is kept for after the layer (a hook cannot return one).
        let mut failure: Option<Error> = None;
        {
            let net = &mut *net;
            let reducer = &mut reducer;
            let mut hook = |offset: usize, tail: &[f32]| {
                if failure.is_some() || !job.overlap {
                    return;
                }
                let moved = reducer
                    .start_ready(offset, tail, local_loss, net)
                    .and_then(|()| reducer.pump(net));
                if let Err(e) = moved {
                    failure = Some(e);
                }
            };
            stage.backward_streaming(0, &share.dlogits, &mut hook)?;
        }
        if let Some(e) = failure {
            return Err(e);
        }
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t0).as_secs_f64();
        // Whatever the backward did not start yet (the first layers' bucket), then the rest of
        // the reduction.
        let waited = clock.now();
        reducer.start_ready(0, stage.grads(), local_loss, net)?;
        reducer.finish(net)?;
        reduce_wait += (clock.now() - waited).as_secs_f64();
        // The mean of the workers' gradients, then the same step on every replica.
        let scale = 1.0 / n as f32;
        let mut step_loss = 0.0f64;
        {
            let grads = stage.grads_mut();
            for (b, bucket) in reducer.buckets.iter().enumerate() {
                let len = bucket.range.len();
                grads[bucket.range.clone()]
                    .iter_mut()
                    .zip(&bucket.values[..len])
                    .for_each(|(g, v)| *g = v * scale);
                if b == 0 {
                    step_loss = f64::from(bucket.values[len]) / n as f64;
                }
            }
        }
        let lr = spec.lr_at(step);
        let (t1, wall) = (clock.now(), Instant::now());
        stage.step(&mut optimizer, lr);
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t1).as_secs_f64();
        train_seconds += (clock.now() - t_step).as_secs_f64();
        samples += (spec.batch_size * n) as u64;
        if !step_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: step_loss,
            });
        }
        let done = step + 1;
        let Some(recorder) = recorder.as_mut() else {
            continue;
        };
        recorder.step(done, step_loss, lr, train_seconds)?;
        on_event(&crate::Event::Step {
            step: done,
            epoch,
            loss: step_loss,
            samples_per_second: samples as f64 / train_seconds.max(1e-9),
        });
        if spec.eval_due(done) {
            let (accuracy, test_loss) =
                crate::local::evaluate(&mut stage, &data.test, data.classes)?;
            recorder.eval(
                done,
                accuracy,
                Some(test_loss),
                train_seconds,
                (clock.now() - started).as_secs_f64(),
            )?;
            on_event(&crate::Event::Eval {
                step: done,
                epoch,
                accuracy,
                loss: test_loss,
            });
        }
        if spec.checkpoint_due(done) {
            let dir = write_checkpoint(job, &stage, &optimizer, done)?;
            recorder.checkpoint(done, &dir)?;
            on_event(&crate::Event::Checkpoint {
                step: done,
                path: dir,
            });
        }
    }
    // Every worker's measurements, around the ring to rank 0.
    let params = stage.params().len() as u64;
    let own = crate::data_parallel::worker_summary(
        rank,
        &stage,
        &optimizer,
        net,
        &crate::data_parallel::WorkerClock {
            train_seconds,
            compute_seconds,
            wait_seconds: reduce_wait,
            iterations: spec.total_steps - spec.first_step(),
        },
    );
    let Some(per_node) = gather_reports(net, rank, n as u32, &own, spec.recv_timeout())? else {
        return Ok(WorkerOutcome {
            stage,
            summary: None,
        });
    };
    let Some(recorder) = recorder else {
        unreachable!("rank 0 gathers the reports and holds the recorder")
    };
    let total_bytes_sent: u64 = per_node.iter().map(|p| p.bytes_sent).sum();
    let wall = (clock.now() - started).as_secs_f64();
    let summary = Summary {
        model_params: params,
        steps: spec.total_steps,
        samples,
        wall_seconds: wall,
        train_seconds,
        samples_per_second: samples as f64 / train_seconds.max(1e-9),
        total_bytes_sent,
        bytes_per_sample: total_bytes_sent as f64 / samples.max(1) as f64,
        per_node,
        ..recorder.summary(super::NAME, n as u32)
    };
    recorder.finish(&summary)?;
    Ok(WorkerOutcome {
        stage,
        summary: Some(summary),
    })
}

/// Every node's report, around the ring `rank` is on (links to `rank ± 1`) to rank 0, which
/// returns them in rank order; the others add theirs and pass the token on.
pub fn gather_reports(
    net: &mut dyn Transport,
    rank: u32,
    n: u32,
    own: &NodeSummary,
    timeout: Duration,
) -> Result<Option<Vec<NodeSummary>>> {
    if n < 2 {
        return Ok(Some(vec![own.clone()]));
    }
    let doc = serde_json::to_string(own).map_err(|e| Error::Config(e.to_string()))?;
    let (succ, pred) = ((rank + 1) % n, (rank + n - 1) % n);
    if rank != 0 {
        match net.recv_from(pred, timeout)? {
            Message::Control(Control::Report { mut nodes }) => {
                nodes.push(doc);
                net.send(succ, Message::Control(Control::Report { nodes }))?;
            }
            _ => {
                return Err(Error::protocol(
                    "all-reduce",
                    net,
                    pred,
                    "message instead of the final report",
                ));
            }
        }
        return Ok(None);
    }
    net.send(succ, Message::Control(Control::Report { nodes: vec![doc] }))?;
    let nodes = match net.recv_from(pred, timeout)? {
        Message::Control(Control::Report { nodes }) if nodes.len() == n as usize => nodes,
        _ => {
            return Err(Error::protocol(
                "all-reduce",
                net,
                pred,
                "message instead of the final report",
            ));
        }
    };
    nodes
        .iter()
        .map(|d| serde_json::from_str(d))
        .collect::<std::result::Result<Vec<NodeSummary>, _>>()
        .map(Some)
        .map_err(|e| Error::Config(format!("a node's report is not valid: {e}")))
}

/// Rank 0 writes the one model every replica holds, in the format every strategy reads.
fn write_checkpoint(
    job: &AllReduceJob,
    stage: &Stage,
    optimizer: &Optimizer,
    step: u64,
) -> Result<std::path::PathBuf> {
    write_model(
        &job.spec,
        job.workers,
        super::NAME,
        stage,
        optimizer,
        step,
        &[],
    )
}

/// Writes `stage` (a whole model) as the checkpoint of `step` of a data-parallel run of
/// `workers` (its data order is that of the global batch), atomically, with each worker's own
/// model from `replicas` (rank, parameters) beside it; prunes old ones.
pub fn write_model(
    spec: &crate::RunSpec,
    workers: usize,
    strategy: &str,
    stage: &Stage,
    optimizer: &Optimizer,
    step: u64,
    replicas: &[(u32, &[f32])],
) -> Result<std::path::PathBuf> {
    let dir = spec.checkpoint_dir(step);
    let written = (|| -> Result<()> {
        let file = checkpoint::write_stage(&dir, "stage-0.safetensors", stage, optimizer)?;
        let replicas = replicas
            .iter()
            .map(|(rank, params)| {
                checkpoint::write_params(
                    &dir,
                    &format!("replica-{rank}.safetensors"),
                    stage,
                    params,
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let manifest = checkpoint::Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            strategy: strategy.into(),
            step,
            epoch: step / spec.steps_per_epoch,
            batch_in_epoch: step % spec.steps_per_epoch,
            dataset: spec.dataset.clone(),
            // The data order is that of the global batch.
            batch_size: spec.batch_size * workers,
            seed: spec.seed,
            model: spec.model.clone(),
            partition: vec![(0, stage.layers().len())],
            optimizer: spec.optimizer.clone(),
            files: vec![file],
            replicas,
        };
        checkpoint::write_manifest(&dir, &manifest)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    written?;
    if let Some(keep) = spec.keep_checkpoints {
        checkpoint::retain_newest(&spec.out.join("checkpoints"), keep)?;
    }
    Ok(dir)
}
