//! A parameter server's side of the run: it owns a contiguous shard of the parameters and its
//! optimizer state, answers workers' pulls when the consistency model allows ([`Admission`]),
//! and applies their pushed gradients — under BSP their mean once per iteration (clipped by the
//! global norm across servers when asked, `bsp`), otherwise each push as it arrives — and
//! writes its shard of every checkpoint (`checkpoints`).
//!
//! [`Server`] is sans-I/O: [`Server::handle`] takes what arrived, decoded ([`Input`]: a pull, a
//! push, a grant, a share of the norm, a checkpoint entry, a report, an end, a lost link) and the
//! network's time, and says what to send ([`Output`]); [`run_server`] is the loop that receives,
//! decodes, and carries the outputs out over the links. Every rule is a case of `handle`, tested
//! without a network.
//!
//! Invariants: a shard leaves the server only with every update due before it applied (under
//! BSP, no answer between an iteration's completion and its application; a [`Output::Shard`] is
//! carried out after the inputs before it were handled, so it holds their updates); a dropped
//! worker's later messages are ignored; the loop ends only when every worker has finished or been
//! dropped and no iteration waits.

mod bsp;
mod checkpoints;
mod events;

use std::collections::{BTreeMap, BTreeSet};

use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::tensor_view;
use ringtmp_wire::{TensorHeader, TensorTag};

use self::bsp::{Bsp, BspSum};
use self::checkpoints::Checkpoints;
pub use self::events::{Input, Lost, Output};
use super::admission::{Admission, Reply};
use super::consistency::Consistency;
use super::driver::{PsJob, PsMessage, ServerOutcome, UpdateStaleness, shard_range, tensor};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;
use ringtmp_contract::spec::ResumePoint;

/// Runs server `s` (rank `s`) until every worker has finished or been dropped.
pub fn run_server(job: &PsJob, s: usize, net: &mut dyn Transport) -> Result<ServerOutcome> {
    let mut server = Server::new(job, s)?;
    let mut out = Vec::new();
    while server.serving() {
        let received = net.recv(job.timeout());
        let now = net.clock().now().as_secs_f64();
        match received {
            Ok((from, message)) => {
                let input = Input::decode(from, message, net)?;
                server.handle(input, now, &mut out)?;
            }
            Err(e) => lost(&mut server, e, now, &mut out)?,
        }
        carry_out(&mut out, &server, net)?;
    }
    while server.awaits_entries() {
        let (from, message) = net.recv(job.timeout())?;
        server.finishing(Input::decode(from, message, net)?)?;
    }
    Ok(server.outcome())
}

/// A failed link: a worker the run may lose is dropped; anything else ends the run with `e`.
fn lost(server: &mut Server<'_>, e: TransportError, now: f64, out: &mut Vec<Output>) -> Result<()> {
    let reason = e.to_string();
    match e.failed_peer() {
        Some(rank) if server.lost(rank, reason, now, out)? == Lost::Tolerated => Ok(()),
        _ => Err(e.into()),
    }
}

/// Carries `out` out over the links, in order (emptying it).
fn carry_out(out: &mut Vec<Output>, server: &Server<'_>, net: &mut dyn Transport) -> Result<()> {
    let job = server.job;
    for output in out.drain(..) {
        match output {
            Output::Shard {
                worker,
                clock,
                unit,
            } => {
                let message = tensor(
                    net,
                    TensorTag::Params,
                    clock,
                    unit,
                    &server.params,
                    job.spec.wire_dtype,
                );
                net.send((job.servers + worker) as u32, message)?;
            }
            Output::Send { to, message } => net.send(to, message)?,
            Output::Recycle(bytes) => net.buffers().give(bytes),
            Output::StepDone => net.step_done(),
        }
    }
    Ok(())
}

/// One server's state while it serves.
pub struct Server<'a> {
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
    pub fn new(job: &'a PsJob, s: usize) -> Result<Self> {
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
                entries: BTreeMap::new(),
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
                sum: BspSum::new(job.workers, params.len(), *job.spec.lr),
                clip: job
                    .spec
                    .clip_grad_norm
                    .filter(|_| job.consistency == Consistency::Bsp),
                servers: job.servers,
                iteration: job.first_step(),
                waiting: None,
                shares: BTreeMap::new(),
                held: Vec::new(),
            },
            updates: UpdateStaleness::new(job.workers),
            scratch: Vec::new(),
            model,
            params,
            optimizer,
        })
    }

    /// The shard's parameters now.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Whether workers remain to serve, or an iteration waits for the other servers' shares of
    /// its norm (it is applied before the end).
    pub fn serving(&self) -> bool {
        self.finished.len() + self.dropped.len() < self.job.workers || self.bsp.waiting()
    }

    /// Server 0 after serving: whether a checkpoint still waits for other servers' entries.
    pub fn awaits_entries(&self) -> bool {
        self.s == 0 && !self.checkpoints.entries.is_empty()
    }

    /// Handles `input`, received at the network's time `now` (the consistency controller's
    /// clock), pushing onto `out` what is to be sent.
    pub fn handle(&mut self, input: Input, now: f64, out: &mut Vec<Output>) -> Result<()> {
        let servers = self.job.servers as u32;
        let from = input.sender();
        if from >= servers && self.dropped.contains(&from) {
            // What a worker sent before it died, read after its death was noticed (a link's
            // closure can be reported while the server waits on another link, ahead of what is
            // still queued on its own): it is no longer part of the run.
            if let Input::Push { bytes, .. } = input {
                out.push(Output::Recycle(bytes));
            }
            return Ok(());
        }
        match input {
            Input::Pull { from, clock } if from >= servers => self.on_pull(from, clock, now, out),
            Input::Push {
                from,
                header,
                bytes,
            } if from >= servers => self.on_push(from, &header, bytes, now, out),
            Input::Finished { from } if from >= servers => {
                let w = self.worker(from);
                self.finished.insert(w);
                let replies = self.pulls.drop_worker(w, now);
                self.answer(replies, out);
                Ok(())
            }
            Input::Report { from, nodes } if from >= servers || self.s == 0 => {
                self.reports.extend(nodes);
                Ok(())
            }
            Input::Checkpoint { from, step, files } if from < servers && self.s == 0 => self
                .checkpoints
                .record(self.job, step, from as usize, files, &self.model),
            Input::Grant {
                from: 0,
                worker,
                unit,
                settled,
            } if (worker as usize) < self.job.workers => {
                let replies = self.pulls.grant(worker as usize, unit, settled, now);
                self.answer(replies, out);
                Ok(())
            }
            Input::GradNorm {
                from,
                iteration,
                squared,
            } if from < servers && self.bsp.clip.is_some() => {
                self.bsp.share(from as usize, iteration, squared)?;
                self.settle(out)
            }
            other => Err(self.unexpected(&other, "")),
        }
    }

    /// The error for an input that is no part of the protocol here.
    fn unexpected(&self, input: &Input, when: &str) -> Error {
        let (s, from) = (self.s, input.sender());
        let what = match input {
            Input::Pull { clock, .. } => format!("Pull {{ clock: {clock} }}"),
            Input::Push { header, .. } => {
                format!("{:?} tensor for step {}", header.tag, header.step)
            }
            Input::Finished { .. } => "Finished".to_string(),
            Input::Grant { .. } => "Grant".to_string(),
            Input::GradNorm { .. } => "GradNorm".to_string(),
            Input::Checkpoint { .. } => "Checkpoint".to_string(),
            Input::Report { .. } => "Report".to_string(),
            Input::Unexpected { what, .. } => what.clone(),
        };
        if (from as usize) < self.job.servers {
            Error::Config(format!(
                "server {s}: unexpected {what} from server rank {from}{when}"
            ))
        } else {
            Error::Config(format!(
                "server {s}: unexpected {what} from rank {from}{when}"
            ))
        }
    }

    /// Server 0 once the workers are done, waiting for the other servers' checkpoint entries:
    /// entries and reports are recorded; workers that finished may still say goodbye.
    pub fn finishing(&mut self, input: Input) -> Result<()> {
        let servers = self.job.servers as u32;
        match input {
            Input::Checkpoint { from, step, files } if from < servers => {
                self.checkpoints
                    .record(self.job, step, from as usize, files, &self.model)
            }
            Input::Report { from, nodes } if from < servers => {
                self.reports.extend(nodes);
                Ok(())
            }
            other if other.sender() >= servers => Ok(()),
            other => Err(self.unexpected(&other, " while finishing a checkpoint")),
        }
    }

    fn worker(&self, rank: u32) -> usize {
        rank as usize - self.job.servers
    }

    fn live(&self) -> usize {
        self.job.workers - self.dropped.len()
    }

    /// The link to `rank` failed (`reason`): a dead worker is dropped where the consistency
    /// model allows (BSP only with `drop_dead_workers`); a finished or dropped worker may leave
    /// as it likes; anything else is fatal.
    pub fn lost(
        &mut self,
        rank: u32,
        reason: String,
        now: f64,
        out: &mut Vec<Output>,
    ) -> Result<Lost> {
        let job = self.job;
        if (rank as usize) < job.servers {
            return Ok(Lost::Fatal);
        }
        let w = self.worker(rank);
        if self.finished.contains(&w) || self.dropped.contains(&rank) {
            return Ok(Lost::Tolerated);
        }
        if job.consistency == Consistency::Bsp && !job.drop_dead_workers {
            return Ok(Lost::Fatal);
        }
        tracing::warn!("server {}: dropping worker rank {rank}: {reason}", self.s);
        let replies = self.pulls.drop_worker(w, now);
        self.dropped.push(rank);
        self.drops.push(ringtmp_metrics::DroppedNode {
            rank,
            step: job.first_step() + self.checkpoints.iterations,
            reason,
        });
        // Under BSP the iteration may now be complete without it.
        self.bsp.sum.forget(w);
        self.settle(out)?;
        self.answer(replies, out);
        Ok(Lost::Tolerated)
    }

    /// Worker rank `from` asks for the shard for its iteration `clock`.
    fn on_pull(&mut self, from: u32, clock: u64, now: f64, out: &mut Vec<Output>) -> Result<()> {
        let w = self.worker(from);
        let pushed = self.pulls.gate().pushes(w);
        if pushed != clock {
            return Err(Error::Config(format!(
                "server {}: worker rank {from} pulls for iteration {clock} after pushing {pushed}",
                self.s
            )));
        }
        let replies = self.pulls.pull(w, clock, now);
        self.answer(replies, out);
        Ok(())
    }

    /// Worker rank `from` pushed its gradient of unit `h.micro_batch`: under BSP it joins the
    /// iteration's mean; otherwise it is applied now, as 1/W of an iteration's mean gradient.
    fn on_push(
        &mut self,
        from: u32,
        h: &TensorHeader,
        bytes: Vec<u8>,
        now: f64,
        out: &mut Vec<Output>,
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
            self.settle(out)?;
        } else {
            // A push is 1/W of an iteration: its step is taken at 1/W of the iteration's
            // rate. (Scaling the gradient instead would be the same for plain SGD, but Adam's
            // step ignores the gradient's scale, so each push would move as far as a whole
            // iteration, and a decay would be applied W times an iteration.)
            let rate = lr / job.workers as f32;
            self.updates.applying(w);
            let grads = tensor_view(&bytes, h.dtype, &mut self.scratch);
            self.optimizer.step(&mut self.params, grads, rate, 1);
            out.push(Output::Recycle(bytes));
            // W pushes are one iteration of the shard.
            if self.checkpoints.push_applied(job.workers) {
                self.iteration_applied(out)?;
            }
        }
        let replies = self.pulls.pushed(w, h.micro_batch, now);
        self.answer(replies, out);
        Ok(())
    }

    /// Under BSP: applies the iteration if it is complete (and its norm known), then counts it
    /// for checkpoints and sends the answers it held.
    fn settle(&mut self, out: &mut Vec<Output>) -> Result<()> {
        let live = self.live();
        if !self
            .bsp
            .settle(live, &mut self.optimizer, &mut self.params, self.s, out)?
        {
            return Ok(());
        }
        self.iteration_applied(out)?;
        let held = std::mem::take(&mut self.bsp.held);
        self.answer(held, out);
        Ok(())
    }

    /// One more iteration applied to the shard: counted, and checkpointed when one is due.
    fn iteration_applied(&mut self, out: &mut Vec<Output>) -> Result<()> {
        self.checkpoints.iteration_done(
            self.job,
            self.s,
            &self.model,
            &self.params,
            &self.optimizer,
            out,
        )
    }

    /// Sends `replies` now, or holds them while a BSP iteration waits for the other servers'
    /// shares of its norm (a shard sent then would miss the iteration's update).
    fn answer(&mut self, replies: Vec<Reply>, out: &mut Vec<Output>) {
        if self.bsp.waiting() {
            self.bsp.held.extend(replies);
            return;
        }
        for reply in replies {
            out.push(match reply {
                Reply::Params {
                    worker,
                    clock,
                    unit,
                } => {
                    self.updates.sent(worker);
                    Output::Shard {
                        worker,
                        clock,
                        unit,
                    }
                }
                Reply::Grant {
                    to,
                    worker,
                    unit,
                    settled,
                } => Output::Send {
                    to: to as u32,
                    message: PsMessage::Grant {
                        worker: worker as u32,
                        unit,
                        settled,
                    }
                    .to_message(),
                },
            });
        }
    }

    /// What the server measured, and its final shard.
    pub fn outcome(self) -> ServerOutcome {
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

#[cfg(test)]
mod tests;
