//! BSP on one server: each iteration's pushed gradients kept until every live worker has pushed,
//! their mean (summed in worker order) applied once, clipped by the global norm when asked.
//! Sans-I/O: what it sends (its share of the norm) and the payloads it is done with go out as
//! [`Output`]s.

use std::collections::{BTreeMap, BTreeSet};

use ringtmp_contract::error::{Error, Result};
use ringtmp_model::Optimizer;
use ringtmp_wire::Dtype;
use ringtmp_wire::message::tensor_view;

use super::events::Output;
use crate::admission::Reply;
use crate::driver::PsMessage;
use ringtmp_contract::messages::StrategyMessage;

/// BSP's iteration in progress: each worker's pushed gradient, kept as it arrived, until every
/// live worker has pushed. The mean is then summed in worker order, so a run's parameters do not
/// depend on the order in which pushes happened to arrive (float addition is not associative).
/// Memory: up to `W` gradients of the shard, which the received messages occupy anyway.
pub(super) struct BspSum {
    /// Per worker, its gradient payload for this iteration (a dead worker's stays).
    pushed: Vec<Option<(Vec<u8>, Dtype)>>,
    /// Live workers that pushed this iteration.
    awaited_pushed: BTreeSet<usize>,
    sum: Vec<f32>,
    scratch: Vec<f32>,
    lr: f32,
}

impl BspSum {
    pub(super) fn new(workers: usize, shard: usize, lr: f32) -> Self {
        Self {
            pushed: vec![None; workers],
            awaited_pushed: BTreeSet::new(),
            sum: vec![0.0; shard],
            scratch: Vec::new(),
            lr,
        }
    }

    pub(super) fn add(&mut self, w: usize, payload: Vec<u8>, dtype: Dtype, lr: f32) {
        self.pushed[w] = Some((payload, dtype));
        self.awaited_pushed.insert(w);
        self.lr = lr;
    }

    /// A dead worker is no longer awaited; a gradient it already pushed stays in the sum.
    pub(super) fn forget(&mut self, w: usize) {
        self.awaited_pushed.remove(&w);
    }

    /// Whether every one of `live` workers has pushed this iteration.
    pub(super) fn complete(&self, live: usize) -> bool {
        !self.awaited_pushed.is_empty() && self.awaited_pushed.len() >= live
    }

    /// The mean of the pushed gradients, in `sum` (in worker order); returns its squared L2
    /// norm, which clipping needs.
    fn take_mean(&mut self, out: &mut Vec<Output>) -> f64 {
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
            out.push(Output::Recycle(payload));
        }
        let mean = 1.0 / contributions as f32;
        if phantom {
            return 0.0;
        }
        self.sum.iter_mut().for_each(|v| *v *= mean);
        self.sum.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
    }

    /// Applies the mean (times `factor`, the clipping's) and starts the next iteration.
    pub(super) fn apply(&mut self, factor: f32, optimizer: &mut Optimizer, params: &mut [f32]) {
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
pub(super) struct Bsp {
    pub(super) sum: BspSum,
    pub(super) clip: Option<f32>,
    pub(super) servers: usize,
    /// The global iteration in progress.
    pub(super) iteration: u64,
    /// This iteration's own squared norm, once it is complete and waits for the others'.
    pub(super) waiting: Option<f64>,
    /// Every server's share by iteration, by server (summed in server order, so every server
    /// computes the same norm to the bit).
    pub(super) shares: BTreeMap<u64, BTreeMap<usize, f64>>,
    /// Answers held while an iteration waits.
    pub(super) held: Vec<Reply>,
}

impl Bsp {
    /// Whether an iteration is complete but not applied yet.
    pub(super) fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Applies the iteration if every one of `live` workers has pushed and — when clipping over
    /// several servers — every server's share of the norm is in (telling the others this
    /// server's share once it is complete). Returns whether it applied.
    pub(super) fn settle(
        &mut self,
        live: usize,
        optimizer: &mut Optimizer,
        params: &mut [f32],
        s: usize,
        out: &mut Vec<Output>,
    ) -> Result<bool> {
        if self.waiting.is_none() {
            if !self.sum.complete(live) {
                return Ok(false);
            }
            let own = self.sum.take_mean(out);
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
                out.push(Output::Send {
                    to: other as u32,
                    message: share.to_message(),
                });
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
    pub(super) fn share(&mut self, from: usize, iteration: u64, squared: f64) -> Result<()> {
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
