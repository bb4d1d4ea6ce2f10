//! Optimizers over flat parameter vectors, and learning-rate schedules.
//!
//! Semantics follow the common frameworks exactly, so results can be compared with them:
//! - SGD: `v ← μ·v + (g + λ·p)`, `p ← p − η·v` (no dampening; `μ = 0` is plain SGD).
//! - Adam (Kingma & Ba, 2015): `m ← β₁m + (1−β₁)g'`, `v ← β₂v + (1−β₂)g'²` with `g' = g + λ·p`,
//!   `p ← p − η·m̂ / (√v̂ + ε)` with bias-corrected `m̂`, `v̂`.
//! - AdamW (Loshchilov & Hutter, 2019; PyTorch's `AdamW`): Adam on `g` alone, with the decay
//!   decoupled: `p ← p·(1 − ηλ) − η·m̂ / (√v̂ + ε)`. The decay skips the ranges
//!   [`Optimizer::set_no_decay`] names (a stage names its norms' gains, biases and, unless asked,
//!   embeddings: [`crate::Stage::no_decay_ranges`]).
//!
//! The update is one fused pass over parameters, gradients and state, split across threads in
//! large chunks: for the `mlp` preset it streams ~50 MB per step, which is memory-bound.

use multiversion::multiversion;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Which optimizer and its hyper-parameters (the learning rate comes from the schedule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// SGD with momentum and weight decay.
    Sgd {
        /// Momentum `μ`.
        momentum: f32,
        /// L2 weight decay `λ`.
        weight_decay: f32,
    },
    /// Adam.
    Adam {
        /// `β₁`.
        beta1: f32,
        /// `β₂`.
        beta2: f32,
        /// `ε`.
        eps: f32,
        /// L2 weight decay `λ`.
        weight_decay: f32,
    },
    /// AdamW: Adam with decoupled weight decay.
    #[serde(rename = "adamw")]
    AdamW {
        /// `β₁`.
        beta1: f32,
        /// `β₂`.
        beta2: f32,
        /// `ε`.
        eps: f32,
        /// Decoupled weight decay `λ` (each step shrinks a decayed weight by `1 − ηλ`).
        weight_decay: f32,
        /// Whether token and position embeddings decay too (nanoGPT's choice; off by default,
        /// like norms' gains and biases, which never decay).
        #[serde(default)]
        decay_embeddings: bool,
    },
}

impl OptimizerConfig {
    /// Whether the optimizer keeps two moments per parameter (Adam, AdamW).
    pub fn is_adaptive(&self) -> bool {
        !matches!(self, Self::Sgd { .. })
    }
}

/// An optimizer's state under its checkpoint names, writable in place ([`Optimizer::state_mut`]).
pub struct StateMut<'a> {
    tensors: Vec<(&'static str, &'a mut [f32])>,
    steps: &'a mut u64,
}

impl<'a> StateMut<'a> {
    /// The tensors, by name.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut (&'static str, &'a mut [f32])> {
        self.tensors.iter_mut()
    }

    /// Marks the state written: the optimizer has taken `steps` steps.
    pub fn done(self, steps: u64) {
        *self.steps = steps;
    }
}

/// An optimizer with its per-parameter state.
#[derive(Clone, Debug)]
pub struct Optimizer {
    config: OptimizerConfig,
    /// SGD: velocity. Adam: first moment.
    state_a: Vec<f32>,
    /// Adam: second moment (empty for SGD).
    state_b: Vec<f32>,
    /// Steps taken (Adam's bias correction needs it).
    steps: u64,
    /// Sorted, disjoint parameter ranges AdamW does not decay (`None`: not yet told).
    no_decay: Option<Vec<std::ops::Range<usize>>>,
}

const CHUNK: usize = 1 << 16;

/// A chunk's index with its parameters, first and second moments.
type AdamChunk<'a> = (usize, (&'a mut [f32], (&'a mut [f32], &'a mut [f32])));

impl Optimizer {
    /// A fresh optimizer for `params` parameters (zero state).
    pub fn new(config: OptimizerConfig, params: usize) -> Self {
        let state_b = if config.is_adaptive() {
            vec![0.0; params]
        } else {
            Vec::new()
        };
        Self {
            config,
            state_a: vec![0.0; params],
            state_b,
            steps: 0,
            no_decay: None,
        }
    }

    /// Names the parameter ranges whose weight decay AdamW skips (sorted, disjoint).
    pub fn set_no_decay(&mut self, ranges: Vec<std::ops::Range<usize>>) {
        debug_assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
        self.no_decay = Some(ranges);
    }

    /// Whether the ranges without decay are still to be named (AdamW only).
    pub fn wants_no_decay(&self) -> bool {
        matches!(self.config, OptimizerConfig::AdamW { .. }) && self.no_decay.is_none()
    }

    /// Whether AdamW decays embeddings too.
    pub fn decays_embeddings(&self) -> bool {
        matches!(
            self.config,
            OptimizerConfig::AdamW {
                decay_embeddings: true,
                ..
            }
        )
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes of optimizer state.
    pub fn state_bytes(&self) -> usize {
        (self.state_a.len() + self.state_b.len()) * 4
    }

    /// Named state tensors, for checkpoints.
    pub fn state(&self) -> Vec<(&'static str, &[f32])> {
        match self.config {
            OptimizerConfig::Sgd { .. } => vec![("optim.velocity", &self.state_a)],
            OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. } => {
                vec![("optim.m", &self.state_a), ("optim.v", &self.state_b)]
            }
        }
    }

    /// The state, to be written in place (a checkpoint's, read straight into it); the step
    /// count is set when [`StateMut::done`] is called.
    pub fn state_mut(&mut self) -> StateMut<'_> {
        let tensors = match self.config {
            OptimizerConfig::Sgd { .. } => vec![("optim.velocity", self.state_a.as_mut_slice())],
            OptimizerConfig::Adam { .. } | OptimizerConfig::AdamW { .. } => vec![
                ("optim.m", self.state_a.as_mut_slice()),
                ("optim.v", self.state_b.as_mut_slice()),
            ],
        };
        StateMut {
            tensors,
            steps: &mut self.steps,
        }
    }

    /// Restores state saved by [`Optimizer::state`] (with the step count). Leaves `self` unchanged
    /// on error.
    pub fn load_state(&mut self, tensors: &[(&str, Vec<f32>)], steps: u64) -> Result<()> {
        let expected: Vec<(&'static str, usize)> =
            self.state().iter().map(|(n, v)| (*n, v.len())).collect();
        let mut found = Vec::new();
        for (name, len) in &expected {
            let Some((_, values)) = tensors.iter().find(|(n, _)| n == name) else {
                return Err(Error::CheckpointMismatch {
                    path: Default::default(),
                    reason: format!("optimizer state {name} is missing"),
                });
            };
            if values.len() != *len {
                return Err(Error::CheckpointMismatch {
                    path: Default::default(),
                    reason: format!(
                        "optimizer state {name} has {} values, expected {len}",
                        values.len()
                    ),
                });
            }
            found.push(values);
        }
        self.state_a.copy_from_slice(found[0]);
        if let Some(b) = found.get(1) {
            self.state_b.copy_from_slice(b);
        }
        self.steps = steps;
        Ok(())
    }

    /// One update of `params` from `grads` at learning rate `lr`.
    ///
    /// # Panics
    /// If the buffers' lengths differ from the optimizer's (a programmer error).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, threads: usize) {
        self.step_impl(None, params, grads, lr, threads);
    }

    /// One update that reads the parameters from `from` and writes the updated ones to `to`,
    /// leaving `from` as it was: bit-identical to [`Optimizer::step`] on a copy of `from`, but
    /// one pass over memory instead of a copy and then a pass. Weight stashing uses it when an
    /// in-flight micro-batch still holds the current version.
    ///
    /// # Panics
    /// If the buffers' lengths differ from the optimizer's (a programmer error).
    pub fn step_into(
        &mut self,
        from: &[f32],
        to: &mut [f32],
        grads: &[f32],
        lr: f32,
        threads: usize,
    ) {
        assert_eq!(
            from.len(),
            to.len(),
            "source and destination differ in length"
        );
        self.step_impl(Some(from), to, grads, lr, threads);
    }

    fn step_impl(
        &mut self,
        from: Option<&[f32]>,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        threads: usize,
    ) {
        if !ringtmp_meter::phantom() {
            assert_eq!(
                params.len(),
                self.state_a.len(),
                "optimizer built for another size"
            );
        }
        let step = self.begin_step(lr);
        self.update_range(&step, 0, from, params, grads, threads);
    }

    /// Starts a step at learning rate `lr`, to be applied piece by piece with
    /// [`Optimizer::update_range`] (every parameter once): a stage updates each layer right after
    /// its backward, while its weights and gradient are still in cache. The pieces together are
    /// bit for bit [`Optimizer::step`].
    pub fn begin_step(&mut self, lr: f32) -> StepConstants {
        self.steps += 1;
        StepConstants(match self.config {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
            } => Hyper::Sgd(SgdStep {
                lr,
                momentum,
                weight_decay,
            }),
            OptimizerConfig::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Hyper::Adam(AdamStep::new(
                self.steps,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                0.0,
            )),
            OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => Hyper::Adam(AdamStep::new(
                self.steps,
                lr,
                beta1,
                beta2,
                eps,
                0.0,
                weight_decay,
            )),
        })
    }

    /// The pieces of `start..start + len` with their step constants: the decoupled decay off
    /// where a no-decay range covers them. Offsets are relative to `start`.
    fn pieces(
        &self,
        step: &StepConstants,
        start: usize,
        len: usize,
    ) -> Vec<(std::ops::Range<usize>, Hyper)> {
        let (Hyper::Adam(h), Some(off)) = (step.0, &self.no_decay) else {
            return vec![(0..len, step.0)];
        };
        if h.shrink == 1.0 {
            return vec![(0..len, step.0)];
        }
        let plain = Hyper::Adam(AdamStep { shrink: 1.0, ..h });
        let end = start + len;
        let mut out = Vec::new();
        let mut at = start;
        for r in off.iter().filter(|r| r.end > start && r.start < end) {
            let (a, b) = (r.start.max(start), r.end.min(end));
            if a > at {
                out.push((at - start..a - start, step.0));
            }
            out.push((a - start..b - start, plain));
            at = b;
        }
        if at < end {
            out.push((at - start..len, step.0));
        }
        out
    }

    /// Applies `step` to the parameters `start..start + params.len()`: `params` and `grads` are
    /// that range of the whole buffers (and `from`, when given, the range of the version read,
    /// as in [`Optimizer::step_into`]).
    ///
    /// # Panics
    /// If the lengths differ or the range is outside the optimizer's (a programmer error).
    pub fn update_range(
        &mut self,
        step: &StepConstants,
        start: usize,
        from: Option<&[f32]>,
        params: &mut [f32],
        grads: &[f32],
        threads: usize,
    ) {
        ringtmp_meter::update(params.len());
        if ringtmp_meter::phantom() {
            // Sizes only (the simulator): the step is recorded, not computed; `grads` may be
            // an empty view of a payload that never carried values.
            return;
        }
        assert_eq!(
            params.len(),
            grads.len(),
            "params and grads differ in length"
        );
        for (piece, hyper) in self.pieces(step, start, params.len()) {
            let (from, grads) = (from.map(|f| &f[piece.clone()]), &grads[piece.clone()]);
            self.for_each_block(
                start + piece.start,
                &mut params[piece],
                CHUNK,
                threads,
                |k, p, a, b| {
                    let range = k * CHUNK..k * CHUNK + p.len();
                    apply(
                        &hyper,
                        from.map(|f| &f[range.clone()]),
                        p,
                        &grads[range],
                        a,
                        b,
                    );
                },
            );
        }
    }

    /// [`Optimizer::update_range`] with the gradient made block by block: for each block of
    /// `block` parameters (offsets `range` inside `params`), `gradient(range, out)` writes that
    /// block's gradient into `out` (a per-thread buffer holding stale values: every one must be
    /// written), and the block is updated right away,
    /// while its gradient is still in cache. A layer's whole gradient is then never written to
    /// memory and read back: for a linear layer larger than the cache that is 12 of the ~32 bytes
    /// per parameter its weight gradient and update move. Blocks run in parallel when `threads`
    /// > 1, so `gradient` runs single-threaded. Bit for bit `update_range` on the same gradient.
    ///
    /// # Panics
    /// If `block` is 0 or the range is outside the optimizer's (a programmer error).
    pub fn update_blocks<F>(
        &mut self,
        step: &StepConstants,
        start: usize,
        from: Option<&[f32]>,
        params: &mut [f32],
        block: usize,
        threads: usize,
        gradient: F,
    ) where
        F: Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
    {
        ringtmp_meter::update(params.len());
        if ringtmp_meter::phantom() {
            return;
        }
        assert!(block > 0, "update_blocks: empty blocks");
        // Blocks hold one kind of parameter (a linear layer's weights): one decay for all.
        let pieces = self.pieces(step, start, params.len());
        debug_assert_eq!(
            pieces.len(),
            1,
            "a block update spans decayed and undecayed values"
        );
        let hyper = pieces[0].1;
        self.for_each_block(start, params, block, threads, |k, p, a, b| {
            let range = k * block..k * block + p.len();
            BLOCK_GRADIENT.with(|g| {
                let mut g = g.borrow_mut();
                if g.len() < p.len() {
                    g.resize(p.len(), 0.0);
                }
                // Not cleared: `gradient` overwrites every value (zeroing 256 KB a block was 2%
                // of a ring node's samples).
                let g = &mut g[..p.len()];
                gradient(range.clone(), g);
                apply(&hyper, from.map(|f| &f[range]), p, g, a, b);
            });
        });
    }

    /// Calls `f(k, params, state_a, state_b)` on the `k`-th block of `block` parameters of the
    /// range starting at `start` (with the matching state; `state_b` is empty for SGD), across
    /// `threads` threads.
    fn for_each_block<F>(
        &mut self,
        start: usize,
        params: &mut [f32],
        block: usize,
        threads: usize,
        f: F,
    ) where
        F: Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync,
    {
        assert!(
            start + params.len() <= self.state_a.len(),
            "optimizer built for another size"
        );
        let range = start..start + params.len();
        let first = &mut self.state_a[range.clone()];
        if self.state_b.is_empty() {
            let run = |(k, (p, a)): (usize, (&mut [f32], &mut [f32]))| f(k, p, a, &mut []);
            if threads > 1 {
                params
                    .par_chunks_mut(block)
                    .zip(first.par_chunks_mut(block))
                    .enumerate()
                    .for_each(run);
            } else {
                params
                    .chunks_mut(block)
                    .zip(first.chunks_mut(block))
                    .enumerate()
                    .for_each(run);
            }
        } else {
            let second = &mut self.state_b[range];
            let run = |(k, (p, (a, b))): AdamChunk<'_>| f(k, p, a, b);
            if threads > 1 {
                params
                    .par_chunks_mut(block)
                    .zip(
                        first
                            .par_chunks_mut(block)
                            .zip(second.par_chunks_mut(block)),
                    )
                    .enumerate()
                    .for_each(run);
            } else {
                params
                    .chunks_mut(block)
                    .zip(first.chunks_mut(block).zip(second.chunks_mut(block)))
                    .enumerate()
                    .for_each(run);
            }
        }
    }
}

thread_local! {
    /// The block gradient of [`Optimizer::update_blocks`], reused across calls on each thread.
    static BLOCK_GRADIENT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One block's update: from `from` into `p` when given, else in place; `b` is Adam's second
/// moment (empty for SGD).
fn apply(
    step: &Hyper,
    from: Option<&[f32]>,
    p: &mut [f32],
    g: &[f32],
    a: &mut [f32],
    b: &mut [f32],
) {
    match (step, from) {
        (Hyper::Sgd(h), Some(from)) => sgd_chunk_into(from, p, g, a, h),
        (Hyper::Sgd(h), None) => sgd_chunk(p, g, a, h),
        (Hyper::Adam(h), Some(from)) => adam_chunk_into(from, p, g, a, b, h),
        (Hyper::Adam(h), None) => adam_chunk(p, g, a, b, h),
    }
}

/// A step's constants (the learning rate, Adam's bias corrections), from
/// [`Optimizer::begin_step`].
#[derive(Clone, Copy, Debug)]
pub struct StepConstants(Hyper);

#[derive(Clone, Copy, Debug)]
enum Hyper {
    Sgd(SgdStep),
    Adam(AdamStep),
}

/// SGD's per-step constants.
#[derive(Clone, Copy, Debug)]
struct SgdStep {
    lr: f32,
    momentum: f32,
    weight_decay: f32,
}

/// One parameter's SGD update: returns the new value and updates the velocity. Inlined into
/// each per-SIMD-level kernel below. Rust never contracts `a * b + c` into an FMA on its own, so
/// every level computes bit-identical results.
#[inline(always)]
fn sgd_one(p: f32, g: f32, v: &mut f32, h: &SgdStep) -> f32 {
    let d = g + h.weight_decay * p;
    *v = h.momentum * *v + d;
    p - h.lr * *v
}

/// SGD over a chunk, in place; compiled per SIMD level (see `kernels`).
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn sgd_chunk(p: &mut [f32], g: &[f32], v: &mut [f32], h: &SgdStep) {
    for ((p, g), v) in p.iter_mut().zip(g).zip(v.iter_mut()) {
        *p = sgd_one(*p, *g, v, h);
    }
}

/// SGD over a chunk from `from` into `to`: with streaming stores on x86-64 (see [`streaming`]).
fn sgd_chunk_into(from: &[f32], to: &mut [f32], g: &[f32], v: &mut [f32], h: &SgdStep) {
    #[cfg(target_arch = "x86_64")]
    if streaming::available() {
        // SAFETY: `available` checked that this CPU has AVX.
        unsafe { streaming::sgd_into(from, to, g, v, h) };
        return;
    }
    sgd_chunk_into_cached(from, to, g, v, h);
}

/// [`sgd_chunk_into`] with ordinary stores (where streaming stores are not available).
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn sgd_chunk_into_cached(from: &[f32], to: &mut [f32], g: &[f32], v: &mut [f32], h: &SgdStep) {
    // Equal lengths up front let the compiler drop bounds checks and vectorise.
    let n = to.len();
    let (from, g, v) = (&from[..n], &g[..n], &mut v[..n]);
    for i in 0..n {
        to[i] = sgd_one(from[i], g[i], &mut v[i], h);
    }
}

/// Adam's per-step constants.
#[derive(Clone, Copy, Debug)]
struct AdamStep {
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    /// `lr / (1 − β₁ᵗ)`.
    step_size: f32,
    /// `1 / √(1 − β₂ᵗ)`.
    inv_sqrt_c2: f32,
    /// AdamW's decoupled decay: `1 − ηλ` (1 for Adam and for parameters that do not decay).
    shrink: f32,
}

impl AdamStep {
    /// Step `t`'s constants at rate `lr`, with coupled decay `l2` (Adam) or decoupled `decoupled`
    /// (AdamW).
    fn new(t: u64, lr: f32, beta1: f32, beta2: f32, eps: f32, l2: f32, decoupled: f32) -> Self {
        let t = t as i32;
        let c1 = 1.0 - beta1.powi(t);
        let c2 = 1.0 - beta2.powi(t);
        Self {
            beta1,
            beta2,
            eps,
            weight_decay: l2,
            step_size: lr / c1,
            inv_sqrt_c2: 1.0 / c2.sqrt(),
            shrink: 1.0 - lr * decoupled,
        }
    }
}

/// One parameter's Adam update, like [`sgd_one`].
#[inline(always)]
fn adam_one(p: f32, g: f32, m: &mut f32, v: &mut f32, h: &AdamStep) -> f32 {
    let d = g + h.weight_decay * p;
    *m = h.beta1 * *m + (1.0 - h.beta1) * d;
    *v = h.beta2 * *v + (1.0 - h.beta2) * d * d;
    p * h.shrink - h.step_size * *m / (v.sqrt() * h.inv_sqrt_c2 + h.eps)
}

/// Adam over a chunk, in place; compiled per SIMD level like [`sgd_chunk`].
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn adam_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamStep) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *p = adam_one(*p, *g, m, v, h);
    }
}

/// Adam over a chunk from `from` into `to`: with streaming stores on x86-64 (see [`streaming`]).
fn adam_chunk_into(
    from: &[f32],
    to: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: &AdamStep,
) {
    #[cfg(target_arch = "x86_64")]
    if streaming::available() {
        // SAFETY: `available` checked that this CPU has AVX.
        unsafe { streaming::adam_into(from, to, g, m, v, h) };
        return;
    }
    adam_chunk_into_cached(from, to, g, m, v, h);
}

/// [`adam_chunk_into`] with ordinary stores (where streaming stores are not available).
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
fn adam_chunk_into_cached(
    from: &[f32],
    to: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: &AdamStep,
) {
    let states = m.iter_mut().zip(v.iter_mut());
    for (((to, from), g), (m, v)) in to.iter_mut().zip(from).zip(g).zip(states) {
        *to = adam_one(*from, *g, m, v, h);
    }
}

/// How the learning rate changes over training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The base rate throughout.
    Constant,
    /// Cosine decay from the base rate to zero over the run.
    Cosine,
    /// Cosine decay from the base rate to `min_ratio` of it over the run (nanoGPT's schedule,
    /// whose `min_lr` is a tenth of the rate).
    #[serde(rename = "cosine_to")]
    CosineTo {
        /// The final rate over the base rate, in [0, 1].
        min_ratio: f32,
    },
    /// Multiply by `gamma` every `every` epochs.
    Step {
        /// Epochs between decays.
        every: u32,
        /// Decay factor.
        gamma: f32,
    },
}

impl std::str::FromStr for LrSchedule {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::parse(text)
    }
}

/// The schedule as `--lr-schedule` writes it, which [`LrSchedule::parse`] reads back.
impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Constant => f.write_str("constant"),
            Self::Cosine => f.write_str("cosine"),
            Self::CosineTo { min_ratio } => write!(f, "cosine:{min_ratio}"),
            Self::Step { every, gamma } => write!(f, "step:{every}:{gamma}"),
        }
    }
}

impl LrSchedule {
    /// Parses `constant`, `cosine`, `cosine:MIN_RATIO` or `step:EVERY:GAMMA`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.split(':').collect::<Vec<_>>()[..] {
            ["constant"] => Ok(Self::Constant),
            ["cosine"] => Ok(Self::Cosine),
            ["cosine", ratio] => match ratio.parse::<f32>() {
                Ok(min_ratio) if (0.0..=1.0).contains(&min_ratio) => {
                    Ok(Self::CosineTo { min_ratio })
                }
                _ => Err(format!(
                    "cosine schedule: the final rate's ratio {ratio:?} must be in [0, 1]"
                )),
            },
            ["step", every, gamma] => {
                let every: u32 = every
                    .parse()
                    .map_err(|_| format!("step schedule: bad epoch count {every:?}"))?;
                let gamma: f32 = gamma
                    .parse()
                    .map_err(|_| format!("step schedule: bad factor {gamma:?}"))?;
                if every == 0 || !(gamma > 0.0 && gamma <= 1.0) {
                    return Err("step schedule needs EVERY ≥ 1 and 0 < GAMMA ≤ 1".into());
                }
                Ok(Self::Step { every, gamma })
            }
            _ => Err(format!(
                "unknown schedule {text:?}; use constant, cosine, cosine:MIN_RATIO or \
                 step:EVERY:GAMMA"
            )),
        }
    }

    /// Learning rate at `step` of `total_steps` (`steps_per_epoch` converts to epochs), with a
    /// linear warm-up over the first `warmup` steps.
    pub fn rate(
        &self,
        base: f32,
        step: u64,
        total_steps: u64,
        steps_per_epoch: u64,
        warmup: u64,
    ) -> f32 {
        let scheduled = match *self {
            Self::Constant => base,
            Self::Cosine | Self::CosineTo { .. } => {
                let floor = match *self {
                    Self::CosineTo { min_ratio } => f64::from(base) * f64::from(min_ratio),
                    _ => 0.0,
                };
                let progress = step as f64 / total_steps.max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
                (floor + (f64::from(base) - floor) * cosine) as f32
            }
            Self::Step { every, gamma } => {
                let epoch = step / steps_per_epoch.max(1);
                base * gamma.powi((epoch / u64::from(every)) as i32)
            }
        };
        if step < warmup {
            scheduled * (step + 1) as f32 / warmup as f32
        } else {
            scheduled
        }
    }
}

/// The update into a new weight version with streaming (non-temporal) stores.
///
/// Writing a new version with ordinary stores first reads every destination line into the cache
/// (a read for ownership) only to overwrite all of it: for SGD that is 20 bytes of memory
/// traffic per parameter against 16 for the update in place. Streaming stores write whole lines
/// without reading them, which brings the update into a new version back to the in-place
/// update's traffic. What they give up, the new version staying in cache, is worth little here:
/// the versions a ring node writes are a stage's whole weights, larger than its core's cache,
/// and the next forward reads them after the rest of the stage has passed through.
///
/// AVX (256-bit) on every x86-64 CPU that has it, AVX-512 ones included: the loop is bound by
/// memory, not by vector width. The arithmetic is the scalar functions' ([`sgd_one`],
/// [`adam_one`]) operation by operation, never fused, so the results are bit for bit theirs.
#[cfg(target_arch = "x86_64")]
mod streaming {
    use std::arch::x86_64::*;

    use super::{AdamStep, SgdStep, adam_one, sgd_one};

    /// Floats in one AVX register.
    const LANES: usize = 8;

    /// Whether this CPU has the instructions below.
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx")
    }

    /// Elements of `to` before its first 32-byte-aligned one (a streaming store needs the
    /// alignment), at most `to.len()`.
    fn unaligned_head(to: &[f32]) -> usize {
        let misaligned = to.as_ptr() as usize % (LANES * 4);
        if misaligned == 0 {
            0
        } else {
            ((LANES * 4 - misaligned) / 4).min(to.len())
        }
    }

    /// [`super::sgd_chunk_into`] with streaming stores to `to`.
    ///
    /// # Safety
    /// The CPU must have AVX ([`available`]).
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn sgd_into(
        from: &[f32],
        to: &mut [f32],
        g: &[f32],
        v: &mut [f32],
        h: &SgdStep,
    ) {
        let n = to.len();
        let (from, g, v) = (&from[..n], &g[..n], &mut v[..n]);
        let head = unaligned_head(to);
        for i in 0..head {
            to[i] = sgd_one(from[i], g[i], &mut v[i], h);
        }
        let body_end = head + (n - head) / LANES * LANES;
        let weight_decay = _mm256_set1_ps(h.weight_decay);
        let momentum = _mm256_set1_ps(h.momentum);
        let lr = _mm256_set1_ps(h.lr);
        let mut i = head;
        while i < body_end {
            // SAFETY: `i + LANES <= n` for all four slices (equal lengths), and `to + i` is
            // 32-byte aligned (`head` reached the alignment, steps are whole registers).
            unsafe {
                let p = _mm256_loadu_ps(from.as_ptr().add(i));
                let grad = _mm256_loadu_ps(g.as_ptr().add(i));
                let vel = _mm256_loadu_ps(v.as_ptr().add(i));
                let d = _mm256_add_ps(grad, _mm256_mul_ps(weight_decay, p));
                let vel = _mm256_add_ps(_mm256_mul_ps(momentum, vel), d);
                _mm256_storeu_ps(v.as_mut_ptr().add(i), vel);
                _mm256_stream_ps(
                    to.as_mut_ptr().add(i),
                    _mm256_sub_ps(p, _mm256_mul_ps(lr, vel)),
                );
            }
            i += LANES;
        }
        for i in body_end..n {
            to[i] = sgd_one(from[i], g[i], &mut v[i], h);
        }
        // Streaming stores are weakly ordered: fence them before anything reads the version.
        _mm_sfence();
    }

    /// [`super::adam_chunk_into`] with streaming stores to `to`.
    ///
    /// # Safety
    /// The CPU must have AVX ([`available`]).
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn adam_into(
        from: &[f32],
        to: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        h: &AdamStep,
    ) {
        let n = to.len();
        let (from, g, m, v) = (&from[..n], &g[..n], &mut m[..n], &mut v[..n]);
        let head = unaligned_head(to);
        for i in 0..head {
            to[i] = adam_one(from[i], g[i], &mut m[i], &mut v[i], h);
        }
        let body_end = head + (n - head) / LANES * LANES;
        let weight_decay = _mm256_set1_ps(h.weight_decay);
        let beta1 = _mm256_set1_ps(h.beta1);
        let one_minus_beta1 = _mm256_set1_ps(1.0 - h.beta1);
        let beta2 = _mm256_set1_ps(h.beta2);
        let one_minus_beta2 = _mm256_set1_ps(1.0 - h.beta2);
        let eps = _mm256_set1_ps(h.eps);
        let step_size = _mm256_set1_ps(h.step_size);
        let inv_sqrt_c2 = _mm256_set1_ps(h.inv_sqrt_c2);
        let shrink = _mm256_set1_ps(h.shrink);
        let mut i = head;
        while i < body_end {
            // SAFETY: as in `sgd_into`.
            unsafe {
                let p = _mm256_loadu_ps(from.as_ptr().add(i));
                let grad = _mm256_loadu_ps(g.as_ptr().add(i));
                let d = _mm256_add_ps(grad, _mm256_mul_ps(weight_decay, p));
                let first = _mm256_add_ps(
                    _mm256_mul_ps(beta1, _mm256_loadu_ps(m.as_ptr().add(i))),
                    _mm256_mul_ps(one_minus_beta1, d),
                );
                let second = _mm256_add_ps(
                    _mm256_mul_ps(beta2, _mm256_loadu_ps(v.as_ptr().add(i))),
                    _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, d), d),
                );
                _mm256_storeu_ps(m.as_mut_ptr().add(i), first);
                _mm256_storeu_ps(v.as_mut_ptr().add(i), second);
                let denominator =
                    _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(second), inv_sqrt_c2), eps);
                let step = _mm256_div_ps(_mm256_mul_ps(step_size, first), denominator);
                _mm256_stream_ps(
                    to.as_mut_ptr().add(i),
                    _mm256_sub_ps(_mm256_mul_ps(p, shrink), step),
                );
            }
            i += LANES;
        }
        for i in body_end..n {
            to[i] = adam_one(from[i], g[i], &mut m[i], &mut v[i], h);
        }
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_reads_back_from_its_text() {
        for text in ["constant", "cosine", "cosine:0.1", "step:3:0.5"] {
            let schedule: LrSchedule = text.parse().unwrap();
            assert_eq!(schedule.to_string(), text);
            assert_eq!(
                schedule.to_string().parse::<LrSchedule>().unwrap(),
                schedule
            );
        }
        for bad in ["cosine:2", "step:0:0.5", "step:3:0", "linear"] {
            assert!(bad.parse::<LrSchedule>().is_err(), "{bad}");
        }
    }

    // The optimizer kernels, at whatever SIMD level runs them (AVX-512, AVX2, NEON),
    // equal the scalar formulas bit for bit at every tail length.
    #[test]
    fn optimizer_kernels_match_the_scalar_formulas_at_every_tail_length() {
        let sgd = SgdStep {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 1e-3,
        };
        let adam = AdamStep {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-3,
            step_size: 0.01 / 0.1,
            inv_sqrt_c2: 1.0 / 0.001f32.sqrt(),
            shrink: 1.0 - 0.01 * 0.1,
        };
        for len in 0..70 {
            let p: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let g: Vec<f32> = (0..len).map(|i| (i as f32 * 0.73).cos() * 0.1).collect();
            let state: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 0.01).collect();
            // SGD, in place and into another buffer.
            let (mut p1, mut v1) = (p.clone(), state.clone());
            sgd_chunk(&mut p1, &g, &mut v1, &sgd);
            let (mut want, mut wv) = (p.clone(), state.clone());
            for i in 0..len {
                want[i] = sgd_one(want[i], g[i], &mut wv[i], &sgd);
            }
            assert_eq!(bits(&p1), bits(&want), "sgd, {len} values");
            assert_eq!(bits(&v1), bits(&wv), "sgd velocity, {len} values");
            // Into another buffer: the streaming stores (x86-64) and the ordinary ones, with the
            // destination at every offset from a 32-byte boundary (the streaming kernel's head).
            let into = [
                sgd_chunk_into as fn(&[f32], &mut [f32], &[f32], &mut [f32], &SgdStep),
                sgd_chunk_into_cached,
            ];
            for (kernel, offset) in into.iter().flat_map(|k| (0..8).map(move |o| (k, o))) {
                let mut buffer = AlignedDestination::new(len + offset);
                let (p2, mut v2) = (&mut buffer.slice()[offset..], state.clone());
                kernel(&p, p2, &g, &mut v2, &sgd);
                assert_eq!(bits(p2), bits(&want), "sgd into, {len} values at {offset}");
                assert_eq!(bits(&v2), bits(&wv), "sgd velocity into, {len} at {offset}");
            }
            // Adam, in place and into another buffer.
            let (mut p1, mut m1, mut s1) = (p.clone(), state.clone(), state.clone());
            adam_chunk(&mut p1, &g, &mut m1, &mut s1, &adam);
            let (mut want, mut wm, mut ws) = (p.clone(), state.clone(), state.clone());
            for i in 0..len {
                want[i] = adam_one(want[i], g[i], &mut wm[i], &mut ws[i], &adam);
            }
            assert_eq!(bits(&p1), bits(&want), "adam, {len} values");
            assert_eq!(
                (bits(&m1), bits(&s1)),
                (bits(&wm), bits(&ws)),
                "adam state, {len}"
            );
            type AdamInto = fn(&[f32], &mut [f32], &[f32], &mut [f32], &mut [f32], &AdamStep);
            let into = [adam_chunk_into as AdamInto, adam_chunk_into_cached];
            for (kernel, offset) in into.iter().flat_map(|k| (0..8).map(move |o| (k, o))) {
                let mut buffer = AlignedDestination::new(len + offset);
                let p2 = &mut buffer.slice()[offset..];
                let (mut m2, mut s2) = (state.clone(), state.clone());
                kernel(&p, p2, &g, &mut m2, &mut s2, &adam);
                assert_eq!(bits(p2), bits(&want), "adam into, {len} values at {offset}");
                assert_eq!(
                    (bits(&m2), bits(&s2)),
                    (bits(&wm), bits(&ws)),
                    "adam state into, {len} at {offset}"
                );
            }
        }
    }

    /// A NaN-filled destination whose first value sits on a 32-byte boundary, so that an offset
    /// into it places the kernel's destination at a known misalignment.
    struct AlignedDestination {
        storage: Vec<f32>,
        start: usize,
        len: usize,
    }

    impl AlignedDestination {
        fn new(len: usize) -> Self {
            let storage = vec![f32::NAN; len + 8];
            let start = storage.as_ptr().align_offset(32);
            assert!(start < 8, "a Vec<f32> is at least 4-byte aligned");
            Self {
                storage,
                start,
                len,
            }
        }

        fn slice(&mut self) -> &mut [f32] {
            &mut self.storage[self.start..self.start + self.len]
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn step_into_is_bit_identical_to_an_in_place_step_and_leaves_the_source_alone() {
        let configs = [
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 1e-4,
            },
            OptimizerConfig::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-4,
            },
        ];
        // Longer than one chunk, so chunk offsets are exercised, and with both thread counts.
        let n = CHUNK * 2 + 37;
        let start: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let grads: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 997) as f32 / 997.0 - 0.5)
            .collect();
        for config in configs {
            for threads in [1, 2] {
                let mut in_place = Optimizer::new(config.clone(), n);
                let mut into = Optimizer::new(config.clone(), n);
                let mut a = start.clone();
                let mut from = start.clone();
                for step in 0..3 {
                    in_place.step(&mut a, &grads, 0.01, threads);
                    let mut to = vec![0.0; n];
                    into.step_into(&from, &mut to, &grads, 0.01, threads);
                    if step == 0 {
                        assert_eq!(from, start, "the source was modified");
                    }
                    from = to;
                }
                assert_eq!(a, from, "{config:?}, {threads} threads");
                assert_eq!(in_place.state(), into.state());
            }
        }
    }

    #[test]
    fn sgd_momentum_matches_hand_computation() {
        let mut opt = Optimizer::new(
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.1,
            },
            2,
        );
        let mut p = [1.0f32, -2.0];
        opt.step(&mut p, &[0.5, 0.5], 0.1, 1);
        // d = g + 0.1 p = [0.6, 0.3]; v = d; p -= 0.1 v
        assert!(
            (p[0] - 0.94).abs() < 1e-6 && (p[1] + 2.03).abs() < 1e-6,
            "{p:?}"
        );
        opt.step(&mut p, &[0.5, 0.5], 0.1, 2);
        // d = [0.594, 0.297]; v = 0.9·[0.6, 0.3] + d = [1.134, 0.567]
        assert!((p[0] - (0.94 - 0.1134)).abs() < 1e-6, "{p:?}");
        assert!((p[1] - (-2.03 - 0.0567)).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn adam_first_step_moves_each_parameter_by_lr_against_the_gradient_sign() {
        let cfg = OptimizerConfig::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = Optimizer::new(cfg, 3);
        let mut p = [0.0f32, 1.0, 2.0];
        opt.step(&mut p, &[3.0, -0.001, 0.0], 0.01, 1);
        assert!(
            (p[0] + 0.01).abs() < 1e-6 && (p[1] - 1.01).abs() < 1e-5 && p[2] == 2.0,
            "{p:?}"
        );
    }

    #[test]
    fn threaded_and_serial_updates_agree_bit_for_bit() {
        let n = 3 * CHUNK + 17;
        let grads: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
        for cfg in [
            OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 1e-4,
            },
            OptimizerConfig::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        ] {
            let (mut a, mut b) = (vec![0.5f32; n], vec![0.5f32; n]);
            let (mut oa, mut ob) = (Optimizer::new(cfg.clone(), n), Optimizer::new(cfg, n));
            for _ in 0..3 {
                oa.step(&mut a, &grads, 0.1, 1);
                ob.step(&mut b, &grads, 0.1, 2);
            }
            assert_eq!(a, b);
        }
    }

    #[test]
    fn schedules() {
        assert_eq!(
            LrSchedule::parse("constant")
                .unwrap()
                .rate(0.1, 50, 100, 10, 0),
            0.1
        );
        let cos = LrSchedule::parse("cosine").unwrap();
        assert!((cos.rate(0.1, 50, 100, 10, 0) - 0.05).abs() < 1e-7);
        let step = LrSchedule::parse("step:2:0.5").unwrap();
        assert!((step.rate(0.1, 45, 100, 10, 0) - 0.025).abs() < 1e-7);
        assert!((LrSchedule::Constant.rate(0.1, 0, 100, 10, 4) - 0.025).abs() < 1e-7);
        assert!(LrSchedule::parse("step:0:0.5").is_err());
        assert!(LrSchedule::parse("linear").is_err());
    }
}
