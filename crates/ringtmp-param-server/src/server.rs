//! A parameter server's side of the run: it owns a contiguous shard of the parameters and its
//! optimizer state, answers workers' pulls when the consistency model allows ([`Admission`]),
//! and applies their pushed gradients — under BSP their mean once per iteration (clipped by the
//! global norm across servers when asked, `Bsp`), otherwise each push as it arrives — and
//! writes its shard of every checkpoint (`Checkpoints`).
//!
//! [`run_server`] is the loop; `Server`'s handlers say what each kind of event does: a link
//! lost (a worker dropped, or the run ended), a message from another server (a grant, a share
//! of the norm, a checkpoint entry or a report), a message from a worker (a pull, a push, its
//! report, its end).
//!
//! Invariants: a shard leaves the server only with every update due before it applied (under
//! BSP, no answer between an iteration's completion and its application); a dropped worker's
//! later messages are ignored; the loop ends only when every worker has finished or been
//! dropped and no iteration waits.

use std::collections::BTreeSet;
use std::ops::Range;

use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_transport::{BufferPool, Transport, TransportError};
use ringtmp_wire::message::tensor_view;
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};

use super::admission::{Admission, Reply};
use super::consistency::Consistency;
use super::driver::{PsJob, PsMessage, ServerOutcome, UpdateStaleness, shard_range, tensor};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;
use ringtmp_contract::spec::ResumePoint;

/// Runs server `s` (rank `s`) until every worker has finished or been dropped.
pub fn run_server(job: &PsJob, s: usize, net: &mut dyn Transport) -> Result<ServerOutcome> {
    let mut server = Server::new(job, s)?;
    while server.serving() {
        match net.recv(job.timeout()) {
            Ok((from, message)) if (from as usize) < job.servers => {
                server.on_server_message(net, from, message)?;
            }
            Ok((from, message)) => server.on_worker_message(net, from, message)?,
            Err(e) => server.on_lost(net, e)?,
        }
    }
    server.finish_checkpoints(net)?;
    Ok(server.outcome())
}

/// One server's state while it serves.
struct Server<'a> {
    job: &'a PsJob,
    s: usize,
    /// The whole model's initial stage (its layout names the shard's tensors in checkpoints).
    model: Stage,
    params: Vec<f32>,
    optimizer: Optimizer,
    checkpoints: Checkpoints,
    pulls: Admission,
    finished: BTreeSet<usize>,
    dropped: Vec<u32>,
    drops: Vec<ringtmp_metrics::DroppedNode>,
    reports: Vec<String>,
    bsp: Bsp,
    updates: UpdateStaleness,
    scratch: Vec<f32>,
}

impl<'a> Server<'a> {
    /// Server `s` of `job`: its shard of the initial parameters (every strategy's), or of the
    /// checkpoint it resumes from.
    fn new(job: &'a PsJob, s: usize) -> Result<Self> {
        let layers = job.layers()?;
        let total: usize = layers.iter().map(|l| l.param_count()).sum();
        let range = shard_range(total, job.servers, s);
        let model =
            job.spec
                .initial_stage(&layers, 0..layers.len(), 1, job.spec.resume_from.is_some())?;
        let mut params = model.params()[range.clone()].to_vec();
        let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), params.len());
        if let Some(ResumePoint { dir, .. }) = &job.spec.resume_from {
            let manifest = checkpoint::read_manifest(dir)?;
            checkpoint::read_range(
                dir,
                &manifest,
                &model,
                range.clone(),
                &mut params,
                &mut optimizer,
            )?;
        }
        let workers = job.workers as u64;
        Ok(Self {
            job,
            s,
            checkpoints: Checkpoints {
                range,
                iterations: 0,
                pushes: 0,
                entries: std::collections::BTreeMap::new(),
            },
            pulls: Admission::new(
                job.consistency,
                s,
                job.servers,
                job.workers,
                job.first_step() * workers..job.spec.total_steps * workers,
            ),
            finished: BTreeSet::new(),
            dropped: Vec::new(),
            drops: Vec::new(),
            reports: Vec::new(),
            bsp: Bsp {
                sum: BspSum::new(job.workers, params.len(), job.spec.lr),
                clip: job
                    .spec
                    .clip_grad_norm
                    .filter(|_| job.consistency == Consistency::Bsp),
                servers: job.servers,
                iteration: job.first_step(),
                waiting: None,
                shares: std::collections::BTreeMap::new(),
                held: Vec::new(),
            },
            updates: UpdateStaleness::new(job.workers),
            scratch: Vec::new(),
            model,
            params,
            optimizer,
        })
    }

    /// Whether workers remain to serve, or an iteration waits for the other servers' shares of
    /// its norm (it is applied before the end).
    fn serving(&self) -> bool {
        self.finished.len() + self.dropped.len() < self.job.workers || self.bsp.waiting()
    }

    /// The consistency controller's time: the network's (virtual in simulation).
    fn now(net: &dyn Transport) -> f64 {
        net.clock().now().as_secs_f64()
    }

    fn worker(&self, rank: u32) -> usize {
        rank as usize - self.job.servers
    }

    fn live(&self) -> usize {
        self.job.workers - self.dropped.len()
    }

    /// A link failed: a dead worker is dropped where the consistency model allows (BSP only with
    /// `drop_dead_workers`); anything else ends the run.
    fn on_lost(&mut self, net: &mut dyn Transport, e: TransportError) -> Result<()> {
        let job = self.job;
        let Some(rank) = e.failed_peer().filter(|r| *r as usize >= job.servers) else {
            return Err(e.into());
        };
        // A worker that already finished may leave whenever it likes.
        let w = self.worker(rank);
        if self.finished.contains(&w) || self.dropped.contains(&rank) {
            return Ok(());
        }
        if job.consistency == Consistency::Bsp && !job.drop_dead_workers {
            return Err(e.into());
        }
        tracing::warn!("server {}: dropping worker rank {rank}: {e}", self.s);
        let replies = self.pulls.drop_worker(w, Self::now(net));
        self.dropped.push(rank);
        self.drops.push(ringtmp_metrics::DroppedNode {
            rank,
            step: job.first_step() + self.checkpoints.iterations,
            reason: e.to_string(),
        });
        // Under BSP the iteration may now be complete without it.
        self.bsp.sum.forget(w);
        self.settle(net)?;
        self.answer(net, replies)
    }

    /// A message from another server: a grant (server 0's, under SSP and DSSP), a share of a
    /// clipped iteration's norm, or, on server 0, a checkpoint entry or an end-of-run report.
    fn on_server_message(
        &mut self,
        net: &mut dyn Transport,
        from: u32,
        message: Message,
    ) -> Result<()> {
        let (job, s) = (self.job, self.s);
        let own = match &message {
            Message::Control(control) => PsMessage::from_control(control, net, from)?,
            Message::Tensor(..) => None,
        };
        match (own, message) {
            (None, Message::Control(Control::Report { nodes })) if s == 0 => {
                self.reports.extend(nodes);
            }
            (None, Message::Control(Control::Checkpoint { step, files })) if s == 0 => {
                self.checkpoints
                    .record(job, step, from as usize, files, &self.model)?;
            }
            (
                Some(PsMessage::Grant {
                    worker,
                    unit,
                    settled,
                }),
                _,
            ) if from == 0 && (worker as usize) < job.workers => {
                let replies = self
                    .pulls
                    .grant(worker as usize, unit, settled, Self::now(net));
                self.answer(net, replies)?;
            }
            (
                Some(PsMessage::GradNorm {
                    iteration,
                    squared_bits,
                }),
                _,
            ) if self.bsp.clip.is_some() => {
                self.bsp
                    .share(from as usize, iteration, f64::from_bits(squared_bits))?;
                self.settle(net)?;
            }
            _ => {
                return Err(Error::Config(format!(
                    "server {s}: unexpected message from server rank {from}"
                )));
            }
        }
        Ok(())
    }

    /// A message from a worker: a pull, a push, its end-of-run report, or its end.
    fn on_worker_message(
        &mut self,
        net: &mut dyn Transport,
        from: u32,
        message: Message,
    ) -> Result<()> {
        let s = self.s;
        if self.dropped.contains(&from) {
            // What a worker sent before it died, read after its death was noticed (a link's
            // closure can be reported while the server waits on another link, ahead of what is
            // still queued on its own): it is no longer part of the run.
            return Ok(());
        }
        let own = match &message {
            Message::Control(control) => PsMessage::from_control(control, net, from)?,
            Message::Tensor(..) => None,
        };
        let w = self.worker(from);
        match (own, message) {
            (Some(PsMessage::Pull { clock }), _) => {
                let pushed = self.pulls.gate().pushes(w);
                if pushed != clock {
                    return Err(Error::Config(format!(
                        "server {s}: worker rank {from} pulls for iteration {clock} after pushing {pushed}"
                    )));
                }
                let replies = self.pulls.pull(w, clock, Self::now(net));
                self.answer(net, replies)
            }
            (None, Message::Tensor(h, bytes)) if h.tag == TensorTag::ParamGrads => {
                self.on_push(net, from, &h, bytes)
            }
            (None, Message::Control(Control::Report { nodes })) => {
                self.reports.extend(nodes);
                Ok(())
            }
            (Some(PsMessage::Finished { .. }), _) => {
                self.finished.insert(w);
                let replies = self.pulls.drop_worker(w, Self::now(net));
                self.answer(net, replies)
            }
            (own, other) => {
                let what = match (own, other) {
                    (Some(m), _) => format!("{m:?}"),
                    (None, Message::Control(c)) => format!("{c:?}"),
                    (None, Message::Tensor(h, _)) => {
                        format!("{:?} tensor for step {}", h.tag, h.step)
                    }
                };
                Err(Error::Config(format!(
                    "server {s}: unexpected {what} from rank {from}"
                )))
            }
        }
    }

    /// Worker rank `from` pushed its gradient of unit `h.micro_batch`: under BSP it joins the
    /// iteration's mean; otherwise it is applied now, as 1/W of an iteration's mean gradient.
    fn on_push(
        &mut self,
        net: &mut dyn Transport,
        from: u32,
        h: &TensorHeader,
        bytes: Vec<u8>,
    ) -> Result<()> {
        let job = self.job;
        let w = self.worker(from);
        // The header's count (checked against the payload when the frame was decoded; a
        // phantom run's payload carries no values).
        let count = h.elements().unwrap_or(u64::MAX);
        if count != self.params.len() as u64 {
            return Err(Error::Config(format!(
                "server {}: gradient of {count} values from rank {from}, shard has {}",
                self.s,
                self.params.len()
            )));
        }
        // The rate of the global iteration the unit belongs to, whoever computed it.
        let lr = job.lr_at_unit(h.micro_batch);
        if job.consistency == Consistency::Bsp {
            // Keep this iteration's gradients; apply their mean once all live workers pushed.
            self.bsp.sum.add(w, bytes, h.dtype, lr);
            self.settle(net)?;
        } else {
            // A push is 1/W of an iteration: its step is taken at 1/W of the iteration's
            // rate. (Scaling the gradient instead would be the same for plain SGD, but Adam's
            // step ignores the gradient's scale, so each push would move as far as a whole
            // iteration, and a decay would be applied W times an iteration.)
            let rate = lr / job.workers as f32;
            self.updates.applying(w);
            let grads = tensor_view(&bytes, h.dtype, &mut self.scratch);
            self.optimizer.step(&mut self.params, grads, rate, 1);
            net.buffers().give(bytes);
            self.checkpoints.push_applied(
                job,
                self.s,
                &self.model,
                &self.params,
                &self.optimizer,
                net,
            )?;
        }
        let replies = self.pulls.pushed(w, h.micro_batch, Self::now(net));
        self.answer(net, replies)
    }

    /// Under BSP: applies the iteration if it is complete (and its norm known), then counts it
    /// for checkpoints and sends the answers it held.
    fn settle(&mut self, net: &mut dyn Transport) -> Result<()> {
        let live = self.live();
        if !self
            .bsp
            .settle(live, &mut self.optimizer, &mut self.params, self.s, net)?
        {
            return Ok(());
        }
        self.checkpoints.iteration_done(
            self.job,
            self.s,
            &self.model,
            &self.params,
            &self.optimizer,
            net,
        )?;
        let held = std::mem::take(&mut self.bsp.held);
        self.answer(net, held)
    }

    /// Sends `replies` now, or holds them while a BSP iteration waits for the other servers'
    /// shares of its norm (a shard sent then would miss the iteration's update).
    fn answer(&mut self, net: &mut dyn Transport, replies: Vec<Reply>) -> Result<()> {
        if self.bsp.waiting() {
            self.bsp.held.extend(replies);
            return Ok(());
        }
        send_replies(
            replies,
            &self.params,
            self.job.servers,
            self.job.spec.wire_dtype,
            &mut self.updates,
            net,
        )
    }

    /// Server 0 writes a checkpoint's manifest once every server's file is in: it waits for the
    /// entries still on their way when the workers finished.
    fn finish_checkpoints(&mut self, net: &mut dyn Transport) -> Result<()> {
        let job = self.job;
        while self.s == 0 && !self.checkpoints.entries.is_empty() {
            match net.recv(job.timeout())? {
                (from, Message::Control(Control::Checkpoint { step, files }))
                    if (from as usize) < job.servers =>
                {
                    self.checkpoints
                        .record(job, step, from as usize, files, &self.model)?;
                }
                (from, Message::Control(Control::Report { nodes }))
                    if (from as usize) < job.servers =>
                {
                    self.reports.extend(nodes);
                }
                // Workers that finished may still say goodbye; nothing else is expected.
                (from, _) if (from as usize) >= job.servers => {}
                (from, _) => {
                    return Err(Error::Config(format!(
                        "server 0: unexpected message from server rank {from} while finishing a checkpoint"
                    )));
                }
            }
        }
        Ok(())
    }

    fn outcome(self) -> ServerOutcome {
        ServerOutcome {
            parked_pulls: self.pulls.parked_count(),
            staleness: self.pulls.gate().staleness_histogram().to_vec(),
            worker_staleness: (0..self.job.workers)
                .map(|w| self.pulls.gate().worker_staleness(w).to_vec())
                .collect(),
            update_staleness: self.updates,
            dropped: self.drops,
            reports: self.reports,
            params: self.params,
        }
    }
}

/// Sends what the admission decided: shards to workers, grants to the other servers.
fn send_replies(
    replies: Vec<Reply>,
    params: &[f32],
    servers: usize,
    dtype: Dtype,
    staleness: &mut UpdateStaleness,
    net: &mut dyn Transport,
) -> Result<()> {
    for reply in replies {
        match reply {
            Reply::Params {
                worker,
                clock,
                unit,
            } => {
                staleness.sent(worker);
                send_params(worker, clock, unit, params, servers, dtype, net)?
            }
            Reply::Grant {
                to,
                worker,
                unit,
                settled,
            } => net.send(
                to as u32,
                PsMessage::Grant {
                    worker: worker as u32,
                    unit,
                    settled,
                }
                .to_message(),
            )?,
        }
    }
    Ok(())
}

/// Sends worker `w` this server's shard for its iteration `clock` (from server 0 with the unit of
/// work it does next).
fn send_params(
    w: usize,
    clock: u64,
    unit: u64,
    params: &[f32],
    servers: usize,
    dtype: Dtype,
    net: &mut dyn Transport,
) -> Result<()> {
    let message = tensor(net, TensorTag::Params, clock, unit, params, dtype);
    net.send((servers + w) as u32, message)?;
    Ok(())
}

/// BSP's iteration in progress: each worker's pushed gradient, kept as it arrived, until every
/// live worker has pushed. The mean is then summed in worker order, so a run's parameters do not
/// depend on the order in which pushes happened to arrive (float addition is not associative).
/// Memory: up to `W` gradients of the shard, which the received messages occupy anyway.
struct BspSum {
    /// Per worker, its gradient payload for this iteration (a dead worker's stays).
    pushed: Vec<Option<(Vec<u8>, Dtype)>>,
    /// Live workers that pushed this iteration.
    awaited_pushed: BTreeSet<usize>,
    sum: Vec<f32>,
    scratch: Vec<f32>,
    lr: f32,
}

impl BspSum {
    fn new(workers: usize, shard: usize, lr: f32) -> Self {
        Self {
            pushed: vec![None; workers],
            awaited_pushed: BTreeSet::new(),
            sum: vec![0.0; shard],
            scratch: Vec::new(),
            lr,
        }
    }

    fn add(&mut self, w: usize, payload: Vec<u8>, dtype: Dtype, lr: f32) {
        self.pushed[w] = Some((payload, dtype));
        self.awaited_pushed.insert(w);
        self.lr = lr;
    }

    /// A dead worker is no longer awaited; a gradient it already pushed stays in the sum.
    fn forget(&mut self, w: usize) {
        self.awaited_pushed.remove(&w);
    }

    /// Whether every one of `live` workers has pushed this iteration.
    fn complete(&self, live: usize) -> bool {
        !self.awaited_pushed.is_empty() && self.awaited_pushed.len() >= live
    }

    /// The mean of the pushed gradients, in `sum` (in worker order); returns its squared L2
    /// norm, which clipping needs.
    fn take_mean(&mut self, buffers: &BufferPool) -> f64 {
        let phantom = ringtmp_meter::phantom();
        if !phantom {
            self.sum.fill(0.0);
        }
        let mut contributions = 0;
        for (payload, dtype) in self.pushed.iter_mut().filter_map(Option::take) {
            let grads = tensor_view(&payload, dtype, &mut self.scratch);
            for (a, g) in self.sum.iter_mut().zip(grads) {
                *a += g;
            }
            contributions += 1;
            buffers.give(payload);
        }
        let mean = 1.0 / contributions as f32;
        if phantom {
            return 0.0;
        }
        self.sum.iter_mut().for_each(|v| *v *= mean);
        self.sum.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
    }

    /// Applies the mean (times `factor`, the clipping's) and starts the next iteration.
    fn apply(&mut self, factor: f32, optimizer: &mut Optimizer, params: &mut [f32]) {
        if factor != 1.0 && !ringtmp_meter::phantom() {
            self.sum.iter_mut().for_each(|v| *v *= factor);
        }
        optimizer.step(params, &self.sum, self.lr, 1);
        self.awaited_pushed.clear();
    }
}

/// BSP's iterations on one server: the mean applied once every live worker has pushed, clipped
/// by the global norm when asked — with several servers, once every server's share of the
/// squared norm has arrived. While a clipped iteration waits for those shares, the answers to
/// pulls wait too (they must carry the updated shard).
///
/// Invariants: iterations are applied in order, one at a time; the factor of an iteration is the
/// same on every server (the same shares summed); no shard leaves the server between an
/// iteration's completion and its application.
struct Bsp {
    sum: BspSum,
    clip: Option<f32>,
    servers: usize,
    /// The global iteration in progress.
    iteration: u64,
    /// This iteration's own squared norm, once it is complete and waits for the others'.
    waiting: Option<f64>,
    /// Every server's share by iteration, by server (summed in server order, so every server
    /// computes the same norm to the bit).
    shares: std::collections::BTreeMap<u64, std::collections::BTreeMap<usize, f64>>,
    /// Answers held while an iteration waits.
    held: Vec<Reply>,
}

impl Bsp {
    /// Whether an iteration is complete but not applied yet.
    fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Applies the iteration if every one of `live` workers has pushed and — when clipping over
    /// several servers — every server's share of the norm is in (telling the others this
    /// server's share once it is complete). Returns whether it applied.
    fn settle(
        &mut self,
        live: usize,
        optimizer: &mut Optimizer,
        params: &mut [f32],
        s: usize,
        net: &mut dyn Transport,
    ) -> Result<bool> {
        if self.waiting.is_none() {
            if !self.sum.complete(live) {
                return Ok(false);
            }
            let own = self.sum.take_mean(net.buffers());
            if self.clip.is_none() {
                self.sum.apply(1.0, optimizer, params);
                self.iteration += 1;
                return Ok(true);
            }
            self.waiting = Some(own);
            self.shares
                .entry(self.iteration)
                .or_default()
                .insert(s, own);
            let share = PsMessage::GradNorm {
                iteration: self.iteration,
                squared_bits: own.to_bits(),
            };
            for other in (0..self.servers).filter(|o| *o != s) {
                net.send(other as u32, share.to_message())?;
            }
        }
        let (Some(_), Some(max_norm)) = (self.waiting, self.clip) else {
            return Ok(false);
        };
        let Some(shares) = self.shares.get(&self.iteration) else {
            return Ok(false);
        };
        if shares.len() < self.servers {
            return Ok(false);
        }
        let squared: f64 = shares.values().sum();
        let factor = ringtmp_contract::clipping::clip_factor(squared.sqrt(), max_norm);
        self.sum.apply(factor, optimizer, params);
        self.shares.remove(&self.iteration);
        self.waiting = None;
        self.iteration += 1;
        Ok(true)
    }

    /// Server `from`'s share of iteration `iteration`'s squared norm.
    fn share(&mut self, from: usize, iteration: u64, squared: f64) -> Result<()> {
        let shares = self.shares.entry(iteration).or_default();
        if iteration < self.iteration
            || !squared.is_finite()
            || squared < 0.0
            || shares.insert(from, squared).is_some()
        {
            return Err(Error::Config(format!(
                "server rank {from}'s share of the gradient norm for iteration {iteration} \
                 ({squared}) comes at iteration {}, or again",
                self.iteration
            )));
        }
        Ok(())
    }
}

/// A server's checkpointing: it counts iterations applied to its shard (under BSP one per
/// applied mean; otherwise one per `W` pushes) and, at each checkpoint step, writes its shard
/// file and tells server 0, which writes the manifest once every server's entry is in.
///
/// Under BSP every server's file holds exactly iteration `step`'s parameters. Under the other
/// models servers apply pushes as they come, so each file holds `step · W` pushes but not
/// necessarily the same ones: the checkpoint is what a worker could have pulled, not one global
/// instant, and a resumed run restarts the data at unit `step · W`.
struct Checkpoints {
    range: Range<usize>,
    iterations: u64,
    pushes: u64,
    /// Server 0: checkpoint step → each server's file entry (JSON) that has arrived.
    entries: std::collections::BTreeMap<u64, Vec<Option<String>>>,
}

impl Checkpoints {
    fn push_applied(
        &mut self,
        job: &PsJob,
        s: usize,
        model: &Stage,
        params: &[f32],
        optimizer: &Optimizer,
        net: &mut dyn Transport,
    ) -> Result<()> {
        self.pushes += 1;
        if self.pushes % job.workers as u64 == 0 {
            self.iteration_done(job, s, model, params, optimizer, net)?;
        }
        Ok(())
    }

    fn iteration_done(
        &mut self,
        job: &PsJob,
        s: usize,
        model: &Stage,
        params: &[f32],
        optimizer: &Optimizer,
        net: &mut dyn Transport,
    ) -> Result<()> {
        self.iterations += 1;
        if s == 0 {
            net.step_done();
        }
        let step = job.first_step() + self.iterations;
        if !job.checkpoint_due(step) {
            return Ok(());
        }
        let entry = checkpoint::write_range(
            &job.checkpoint_dir(step),
            &format!("server-{s}.safetensors"),
            model,
            self.range.clone(),
            params,
            optimizer,
        )?;
        let entry = serde_json::to_string(&entry).map_err(|e| Error::Config(e.to_string()))?;
        if s == 0 {
            self.record(job, step, 0, vec![entry], model)
        } else {
            net.send(
                0,
                Message::Control(Control::Checkpoint {
                    step,
                    files: vec![entry],
                }),
            )?;
            Ok(())
        }
    }

    /// Server 0: server `from`'s file for `step`; the manifest once all are in.
    fn record(
        &mut self,
        job: &PsJob,
        step: u64,
        from: usize,
        files: Vec<String>,
        model: &Stage,
    ) -> Result<()> {
        let slots = self
            .entries
            .entry(step)
            .or_insert_with(|| vec![None; job.servers]);
        let [entry] = <[String; 1]>::try_from(files).map_err(|_| {
            Error::Config(format!(
                "server rank {from}: a checkpoint entry must name one file"
            ))
        })?;
        slots[from] = Some(entry);
        if slots.iter().any(Option::is_none) {
            return Ok(());
        }
        let files = self
            .entries
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .map(|f| {
                serde_json::from_str(&f).map_err(|e| {
                    Error::Config(format!("a server's checkpoint entry is invalid: {e}"))
                })
            })
            .collect::<Result<Vec<checkpoint::FileEntry>>>()?;
        let total = model.params().len();
        let manifest = job.spec.manifest(
            "ps",
            step,
            job.spec.batch_size * job.workers,
            (0..job.servers)
                .map(|s| checkpoint::range_layers(model, &shard_range(total, job.servers, s)))
                .collect(),
            files,
            Vec::new(),
        );
        checkpoint::write_manifest(&job.checkpoint_dir(step), &manifest)?;
        if let Some(keep) = job.spec.keep_checkpoints {
            checkpoint::retain_newest(&job.spec.out.join("checkpoints"), keep)?;
        }
        Ok(())
    }
}
