//! A stage: a contiguous block of layers with its parameters, gradients and per-micro-batch stash.
//!
//! This is the unit every strategy computes with: the ring gives each node one stage, the
//! data-parallel strategies give each worker one stage holding all layers, and the `local`
//! strategy is one stage holding all layers.
//!
//! Invariants:
//! - Parameters and gradients are each one flat `f32` buffer; layer `i` of the stage owns
//!   `offsets[i]..offsets[i + 1]` in both. Export/import for checkpoints, all-reduce or a
//!   parameter server is a slice copy.
//! - Each forward of a training micro-batch stashes the activations and side data its backward
//!   needs under the micro-batch id; any number may be in flight and their backwards may come in
//!   any order. A backward releases the stash.
//! - Gradients accumulate across backwards until [`Stage::step`] or [`Stage::zero_grad`]. The
//!   first backward after a reset *writes* gradients instead of adding to zeros, which saves a
//!   pass over the gradient buffer per step.
//! - Stash buffers are recycled, so a steady-state training loop allocates nothing.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::kernels::{column_sums, set_len};
use crate::layers::{Aux, Fused, Layer, LayerKind, OutputGrad, Pass, Side};
use crate::optim::Optimizer;
use crate::tie::{self, Tie};

/// Released weight versions kept for reuse. Two suffice for a steady pipeline: the step that
/// needs a new version finds the buffer of the version released since the last step.
const SPARE_PARAM_BUFFERS: usize = 2;

/// What one in-flight micro-batch keeps between its forward and its backward.
#[derive(Debug, Default)]
struct Stash {
    /// `acts[0]` is the stage input, `acts[i + 1]` the output of layer `i`.
    acts: Vec<Vec<f32>>,
    /// The weights the forward used, when weight stashing is on.
    weights: Option<Arc<Vec<f32>>>,
    aux: Vec<Aux>,
    rows: usize,
}

impl Stash {
    /// Bytes of its activations and side data.
    fn bytes(&self) -> usize {
        self.acts.iter().map(Vec::len).sum::<usize>() * 4
            + self
                .aux
                .iter()
                .map(|a| a.values.len() * 4 + a.indices.len() * 4)
                .sum::<usize>()
    }
}

/// A contiguous block of a model's layers with their parameters and optimizer-facing buffers.
#[derive(Debug)]
pub struct Stage {
    layers: Vec<Layer>,
    offsets: Vec<usize>,
    /// Shared so that weight stashing can keep the version a micro-batch's forward used without
    /// copying: an optimizer step copies only while some in-flight micro-batch still holds it.
    params: Arc<Vec<f32>>,
    /// Parameter buffers of versions no micro-batch holds any more, reused by the next step
    /// that must leave a stashed version intact (at most [`SPARE_PARAM_BUFFERS`]): reusing them
    /// avoids a fresh allocation, whose page faults cost more than the update itself.
    spare_params: Vec<Vec<f32>>,
    /// Keep each in-flight micro-batch's weights for its backward (PipeDream weight stashing).
    stash_weights: bool,
    grads: Vec<f32>,
    /// Per layer: whether `grads` holds a value written since the last reset.
    grads_written: Vec<bool>,
    in_flight: BTreeMap<u64, Stash>,
    free_stashes: Vec<Stash>,
    /// Whether backward must produce input gradients (false on the stage that reads raw data).
    input_grad: bool,
    threads: usize,
    /// `input_grads[i]` receives the gradient of layer `i`'s input during backward. One buffer
    /// per layer boundary keeps every buffer at a fixed size, so none is ever resized (and
    /// zero-filled) in the steady state; ping-ponging two buffers of alternating sizes cost the
    /// cnn ~15% of its step time in zero-fills.
    input_grads: Vec<Vec<f32>>,
    scratch: Vec<f32>,
    /// The own output gradient of a part of a cut linear layer, gathered for its backward.
    part_grad: Vec<f32>,
    /// Buffers for evaluation passes, which stash nothing.
    eval: Stash,
    /// Per-layer time accounting, when enabled (for `ringtmp bench-compute --profile`).
    profile: Option<Vec<LayerTime>>,
    /// Per layer, rows waiting for a deferred weight gradient (when deferral is on).
    deferred: Option<Vec<Pending>>,
    /// Per layer: which of the layers after a convolution, in this stage, run inside it (see
    /// [`Fusion`]). Bit for bit the same results as the layers apart.
    fusion: Vec<Fusion>,
    /// This stage's end(s) of a tied head and embedding (see the `tie` module).
    tie: Option<Tie>,
    /// The parameters were written from outside ([`Stage::params_mut`]) since the mirror was
    /// last refreshed: the next pass refreshes it first.
    tie_stale: bool,
}

/// The layers after a convolution, in the same stage, that the convolution runs itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fusion {
    /// Not a conv, or nothing fused.
    None,
    /// conv → ReLU: the conv applies the ReLU to each group of its output while in cache
    /// (forward) and masks its output gradient the same way (backward); the ReLU layer itself
    /// does nothing, and the conv's raw output is never kept.
    Relu,
    /// conv → ReLU → max-pool: the conv also pools each group in cache; neither its output nor
    /// the ReLU's is ever written, the pool's output and indices are stashed as usual, and the
    /// backward scatters the pool's output gradient into each group's in cache.
    ReluPool,
}

impl Fusion {
    /// What follows layer `i` of `layers`.
    fn of(layers: &[Layer], i: usize) -> Self {
        let kind = |k: usize| layers.get(k).map(|l| &l.kind);
        match (kind(i), kind(i + 1), kind(i + 2)) {
            (Some(LayerKind::Conv2d(_)), Some(LayerKind::Relu), Some(LayerKind::MaxPool2d(_))) => {
                Fusion::ReluPool
            }
            (Some(LayerKind::Conv2d(_)), Some(LayerKind::Relu), _) => Fusion::Relu,
            _ => Fusion::None,
        }
    }

    /// The stage position of the conv that runs layer `i`, if an earlier conv runs it.
    fn runner(fusion: &[Fusion], i: usize) -> Option<usize> {
        if i >= 1 && fusion[i - 1] != Fusion::None {
            Some(i - 1)
        } else if i >= 2 && fusion[i - 2] == Fusion::ReluPool {
            Some(i - 2)
        } else {
            None
        }
    }

    /// Whether layer `i` runs inside an earlier conv.
    fn absorbs(fusion: &[Fusion], i: usize) -> bool {
        Self::runner(fusion, i).is_some()
    }
}

/// Parameters a step inside the backward updates between two words to its caller: the master
/// of a ring answers the loss of a returning micro-batch in those gaps (`Stage::backward_with`'s
/// `between`). A layer's whole backward is ~2.7 ms for `mlp-deep`'s 1024×1024 layers on one
/// core, a quarter of its update ~0.3 ms.
const POLL_PARAMS: usize = 1 << 18;

/// What a backward tells its caller on the way.
enum Progress<'a> {
    /// Every layer from this offset in the flat parameters is done; their gradients.
    Layer(usize, &'a [f32]),
    /// Part of a layer is done (a moment to look at the network, nothing else).
    Within,
}

/// Where a step taken inside the backward writes each layer's update.
enum UpdateTarget {
    /// Into the current version (nothing else holds it).
    InPlace,
    /// Into the next version, read from the current one (held by a micro-batch in flight).
    Next(Vec<f32>),
}

/// Where a split backward hands the stage's input gradient ([`Stage::backward_sending`]).
type SendInputGrad<'a> = &'a mut dyn FnMut(&[f32]);

/// Which part of each layer's backward a pass over the layers does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Everything, layer by layer.
    All,
    /// Everything but the linear layers' weight gradients and the updates: the chain of input
    /// gradients down to the stage's own, as early as it can be had (a convolution's weight
    /// gradient comes with its input gradient, from the same pass over its rows).
    Inputs,
    /// The linear layers' weight gradients and every layer's update, after [`Phase::Inputs`].
    Weights,
}

/// Inputs and output gradients kept for a deferred weight gradient.
#[derive(Debug, Default)]
struct Pending {
    x: Vec<f32>,
    dy: Vec<f32>,
    rows: usize,
}

impl Pending {
    fn clear(&mut self) {
        self.x.clear();
        self.dy.clear();
        self.rows = 0;
    }
}

/// Time one layer spent in training forward and backward passes since profiling was enabled.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerTime {
    /// Seconds in forward passes (training micro-batches only).
    pub forward_seconds: f64,
    /// Seconds in backward passes (with the layer's optimizer update when the step runs inside
    /// the backward).
    pub backward_seconds: f64,
    /// Of `backward_seconds`, the optimizer update (steps taken inside the backward only); for a
    /// linear layer it includes the weight gradient, made block by block inside the update.
    pub update_seconds: f64,
}

impl Stage {
    /// Builds the stage holding `layers[range]` of a model and initialises its parameters from
    /// `seed` (per layer index, so the result does not depend on the partition).
    ///
    /// # Panics
    /// If `range` is empty or out of bounds (the partition planner guarantees neither happens).
    pub fn new(layers: &[Layer], range: Range<usize>, seed: u64, threads: usize) -> Self {
        Self::filled(layers, range, threads, |layers, offsets, params| {
            for (i, l) in layers.iter().enumerate() {
                l.init(&mut params[offsets[i]..offsets[i + 1]], seed);
            }
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {})
    }

    /// Builds the stage holding `layers[range]` with parameters that `fill` writes (weights
    /// read from a file, say: no seeded initialisation to overwrite); a tied head's mirror is
    /// then copied from the table when the stage holds both.
    ///
    /// # Errors
    /// Whatever `fill` returns.
    ///
    /// # Panics
    /// If `range` is empty or out of bounds.
    pub fn loaded<E>(
        layers: &[Layer],
        range: Range<usize>,
        threads: usize,
        fill: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        Self::filled(layers, range, threads, |_, _, params| fill(params))
    }

    fn filled<E>(
        layers: &[Layer],
        range: Range<usize>,
        threads: usize,
        fill: impl FnOnce(&[Layer], &[usize], &mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        assert!(
            !range.is_empty() && range.end <= layers.len(),
            "bad stage range {range:?}"
        );
        let all = layers;
        let layers = layers[range.clone()].to_vec();
        let mut offsets = vec![0];
        for l in &layers {
            offsets.push(offsets.last().copied().unwrap_or(0) + l.param_count());
        }
        let tie = Tie::of(all, range.clone(), &offsets);
        let total = *offsets.last().unwrap_or(&0);
        let mut params = vec![0.0; total];
        if !ringtmp_meter::phantom() {
            // (Phantom mode leaves the zeroed allocation untouched: the kernel maps it lazily.)
            fill(&layers, &offsets, &mut params)?;
            if let Some((source, mirror)) = tie.as_ref().and_then(Tie::internal) {
                tie::mirror(&mut params, &source, &mirror);
            }
        }
        let n = layers.len();
        let fusion = (0..n).map(|i| Fusion::of(&layers, i)).collect();
        Ok(Self {
            layers,
            offsets,
            params: Arc::new(params),
            spare_params: Vec::new(),
            stash_weights: false,
            grads: vec![0.0; total],
            grads_written: vec![false; n],
            in_flight: BTreeMap::new(),
            free_stashes: Vec::new(),
            input_grad: range.start > 0,
            threads: threads.max(1),
            input_grads: vec![Vec::new(); n],
            scratch: Vec::new(),
            part_grad: Vec::new(),
            eval: Stash::default(),
            profile: None,
            deferred: None,
            fusion,
            tie,
            tie_stale: false,
        })
    }

    /// Starts (or, with `false`, stops) accumulating per-layer forward and backward times. Costs
    /// two clock reads per layer and pass.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| vec![LayerTime::default(); self.layers.len()]);
    }

    /// Per-layer times accumulated since profiling was enabled.
    pub fn layer_times(&self) -> Option<&[LayerTime]> {
        self.profile.as_deref()
    }

    /// Per layer of this stage, with profiling on ([`Stage::set_profiling`]): its index in the
    /// model, and the seconds its training forward passes and its backward passes (with its
    /// update when the step runs inside the backward) took. Empty with profiling off.
    pub fn layer_seconds(&self) -> Vec<(usize, f64, f64)> {
        self.profile.as_deref().map_or_else(Vec::new, |times| {
            self.layers
                .iter()
                .zip(times)
                .map(|(l, t)| (l.index, t.forward_seconds, t.backward_seconds))
                .collect()
        })
    }

    /// The layers of this stage.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// For the stage's layer `i`: the model index of the convolution that runs it fused (a ReLU
    /// or max-pool after a conv in this stage), or `None` when it runs itself.
    pub fn fused_into(&self, i: usize) -> Option<usize> {
        Fusion::runner(&self.fusion, i).map(|k| self.layers[k].index)
    }

    /// Index of the first layer in the whole model.
    pub fn first_layer(&self) -> usize {
        self.layers[0].index
    }

    /// Values per sample this stage reads.
    pub fn input_len(&self) -> usize {
        self.layers[0].input.numel()
    }

    /// Values per sample this stage produces.
    pub fn output_len(&self) -> usize {
        self.layers[self.layers.len() - 1].output.numel()
    }

    /// Whether [`Stage::backward`] computes input gradients. Off by default on a stage that starts
    /// at layer 0, since nothing consumes the gradient of the raw data.
    pub fn set_input_grad(&mut self, on: bool) {
        self.input_grad = on;
    }

    /// Threads the kernels use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Threads the kernels may use.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// The flat parameter vector.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The flat parameter vector, mutable (for importing parameters).
    pub fn params_mut(&mut self) -> &mut [f32] {
        self.tie_stale = true;
        Arc::make_mut(&mut self.params).as_mut_slice()
    }

    /// Refreshes a tied head's weight from the embedding's table when both are in this stage and
    /// the parameters were imported since (a no-op otherwise).
    pub fn sync_tie(&mut self) {
        if !std::mem::take(&mut self.tie_stale) || ringtmp_meter::phantom() {
            return;
        }
        if let Some((source, mirror)) = self.tie.as_ref().and_then(Tie::internal) {
            tie::mirror(
                Arc::make_mut(&mut self.params).as_mut_slice(),
                &source,
                &mirror,
            );
        }
    }

    /// Whether this stage holds one end of a tied head and embedding, and which: `(source,
    /// mirror)`.
    pub fn tied_ends(&self) -> (bool, bool) {
        self.tie
            .as_ref()
            .map_or((false, false), |t| (t.source.is_some(), t.mirror.is_some()))
    }

    /// The embedding's token table, when this stage holds it and its head is tied to it.
    pub fn tied_source(&self) -> Option<&[f32]> {
        let source = self.tie.as_ref()?.source.clone()?;
        Some(&self.params[source])
    }

    /// Overwrites a tied head's weight (the mirror, held here without its source) with the
    /// embedding's `table`. Weights stashed by micro-batches in flight are left as they were.
    ///
    /// # Panics
    /// If this stage holds no mirror or `table` is not its length.
    pub fn set_tied_mirror(&mut self, table: &[f32]) {
        let mirror = self
            .tie
            .as_ref()
            .and_then(|t| t.mirror.clone())
            .expect("a stage holding a tied head");
        if !ringtmp_meter::phantom() {
            Arc::make_mut(&mut self.params)[mirror].copy_from_slice(table);
        }
    }

    /// Takes a tied head's weight gradient (the mirror's, held here without its source) and
    /// zeroes it there: the stage holding the embedding adds it to the table's
    /// ([`Stage::add_tied_grad`]) before its step. Empty in sizes-only runs.
    pub fn take_tied_grad(&mut self) -> Vec<f32> {
        let Some(mirror) = self.tie.as_ref().and_then(|t| t.mirror.clone()) else {
            return Vec::new();
        };
        if ringtmp_meter::phantom() {
            return Vec::new();
        }
        self.materialise_grads();
        let out = self.grads[mirror.clone()].to_vec();
        self.grads[mirror].fill(0.0);
        out
    }

    /// Adds a tied head's weight gradient to the embedding's table's (held here): the matrix's
    /// one update then follows both uses. An empty `grad` (sizes only) adds nothing.
    ///
    /// # Panics
    /// If this stage holds no tied embedding or `grad` has another length.
    pub fn add_tied_grad(&mut self, grad: &[f32]) {
        let source = self
            .tie
            .as_ref()
            .and_then(|t| t.source.clone())
            .expect("a stage holding a tied embedding");
        if grad.is_empty() || ringtmp_meter::phantom() {
            return;
        }
        self.materialise_grads();
        for (g, d) in self.grads[source].iter_mut().zip(grad) {
            *g += d;
        }
    }

    /// Turns weight stashing on or off: with it, a micro-batch's backward uses exactly the weights
    /// its forward used, even if the stage stepped in between (asynchronous pipelines).
    pub fn set_weight_stashing(&mut self, on: bool) {
        self.stash_weights = on;
    }

    /// Distinct weight versions held (1 + those kept alive only by in-flight micro-batches).
    pub fn weight_versions(&self) -> usize {
        let mut stashed: Vec<*const Vec<f32>> = self
            .in_flight
            .values()
            .filter_map(|s| s.weights.as_ref().map(Arc::as_ptr))
            .collect();
        stashed.push(Arc::as_ptr(&self.params));
        stashed.sort();
        stashed.dedup();
        stashed.len()
    }

    /// The parameters of the stage's `i`-th layer.
    pub fn layer_values(&self, i: usize) -> &[f32] {
        &self.params[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Parameter range of each layer in the flat buffers.
    pub fn param_ranges(&self) -> impl Iterator<Item = (&Layer, Range<usize>)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l, self.offsets[i]..self.offsets[i + 1]))
    }

    /// The accumulated gradients (zeros for layers no backward reached since the last reset).
    pub fn grads(&mut self) -> &[f32] {
        self.materialise_grads();
        &self.grads
    }

    /// The gradients, mutable (for strategies that replace them with averaged ones).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        self.materialise_grads();
        &mut self.grads
    }

    /// The squared L2 norm of the accumulated gradients, summed in f64 (a stage's share of a
    /// global norm: the stages' shares add up to the whole model's).
    pub fn grad_norm_squared(&mut self) -> f64 {
        if ringtmp_meter::phantom() {
            return 0.0;
        }
        self.materialise_grads();
        self.grads
            .chunks(4096)
            .map(|c| c.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>())
            .sum()
    }

    /// Multiplies the accumulated gradients by `factor` (gradient clipping).
    pub fn scale_grads(&mut self, factor: f32) {
        if ringtmp_meter::phantom() || factor == 1.0 {
            return;
        }
        self.materialise_grads();
        self.grads.iter_mut().for_each(|g| *g *= factor);
    }

    /// The parameter ranges that AdamW does not decay: every tensor of fewer than two
    /// dimensions (biases, norms' gains and shifts) and, unless `decay_embeddings`, token and
    /// position embeddings. Sorted and disjoint.
    pub fn no_decay_ranges(&self, decay_embeddings: bool) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for (layer, range) in self.param_ranges() {
            let mut at = range.start;
            let embedding = matches!(layer.kind, LayerKind::Embedding(_));
            for (name, shape) in layer.param_tensors() {
                let len: usize = shape.iter().product();
                // A split linear layer's pieces are flat; their names say which tensor they are.
                let matrix = shape.len() >= 2 || name.contains(".weight@");
                let decays = if embedding {
                    decay_embeddings
                } else {
                    matrix && !matches!(layer.kind, LayerKind::Norm(_))
                };
                if !decays && len > 0 {
                    match out.last_mut() {
                        Some(last) if last.end == at => last.end = at + len,
                        _ => out.push(at..at + len),
                    }
                }
                at += len;
            }
        }
        out
    }

    /// Tells an AdamW optimizer which of this stage's parameters it must not decay.
    fn prepare(&self, optimizer: &mut Optimizer) {
        if optimizer.wants_no_decay() {
            optimizer.set_no_decay(self.no_decay_ranges(optimizer.decays_embeddings()));
        }
    }

    /// Number of micro-batches whose forward is stashed and backward not yet done.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Bytes held for backward passes: stashes of in-flight micro-batches plus rows kept for
    /// deferred weight gradients.
    pub fn stash_bytes(&self) -> usize {
        let deferred: usize = self
            .deferred
            .iter()
            .flatten()
            .map(|p| (p.x.len() + p.dy.len()) * 4)
            .sum();
        self.in_flight.values().map(Stash::bytes).sum::<usize>() + deferred
    }

    /// Bytes the last evaluation pass ([`Stage::infer`]) held: its two activation buffers and
    /// one layer's side data (kept for the next pass).
    pub fn eval_bytes(&self) -> usize {
        self.eval.bytes()
    }

    /// Forward pass of a training micro-batch of `rows` samples; stashes what backward needs and
    /// returns the stage output `[rows, output_len]`.
    pub fn forward(
        &mut self,
        micro_batch: u64,
        x: &[f32],
        rows: usize,
        pass: &Pass,
    ) -> Result<&[f32]> {
        self.forward_with(micro_batch, x, rows, pass, &mut || {})
    }

    /// [`Stage::forward`], calling `between` after every layer but the last — a node whose
    /// messages must not wait for a whole stage's compute (the ring's master, which computes the
    /// loss for the others) services them there.
    pub fn forward_with(
        &mut self,
        micro_batch: u64,
        x: &[f32],
        rows: usize,
        pass: &Pass,
        between: &mut dyn FnMut(),
    ) -> Result<&[f32]> {
        check_input("stage input", rows * self.input_len(), x.len())?;
        self.sync_tie();
        if self.in_flight.contains_key(&micro_batch) {
            return Err(Error::Config {
                source_name: format!("stage at layer {}", self.first_layer()),
                reason: format!("micro-batch {micro_batch} is already in flight"),
            });
        }
        let mut stash = self.free_stashes.pop().unwrap_or_default();
        stash.acts.resize_with(self.layers.len() + 1, Vec::new);
        stash.aux.resize_with(self.layers.len(), Aux::default);
        stash.rows = rows;
        stash.weights = self.stash_weights.then(|| Arc::clone(&self.params));
        copy_input(&mut stash.acts[0], x, rows * self.input_len());
        run_forward(
            &self.layers,
            &self.fusion,
            &self.offsets,
            &self.params,
            &mut stash,
            pass,
            self.threads,
            self.profile.as_deref_mut(),
            between,
        );
        let stash = self.in_flight.entry(micro_batch).or_insert(stash);
        Ok(stash.acts.last().map(Vec::as_slice).unwrap_or_default())
    }

    /// Evaluation forward (no stash, dropout off); returns `[rows, output_len]`.
    pub fn infer(&mut self, x: &[f32], rows: usize) -> Result<&[f32]> {
        check_input("stage input", rows * self.input_len(), x.len())?;
        self.sync_tie();
        let eval = &mut self.eval;
        // Two activation buffers in turn and one layer's side data: an evaluation pass holds
        // one layer's working set, not every layer's (a transformer block's is ~12 MB a window
        // at gpt-100m's width).
        eval.acts.resize_with(2, Vec::new);
        eval.aux.resize_with(1, Aux::default);
        eval.rows = rows;
        copy_input(&mut eval.acts[0], x, rows * self.layers[0].input.numel());
        let out = run_inference(
            &self.layers,
            &self.fusion,
            &self.offsets,
            &self.params,
            eval,
            self.threads,
        );
        Ok(eval.acts[out].as_slice())
    }

    /// Backward pass of a stashed micro-batch from the gradient of its output, `[rows,
    /// output_len]`. Accumulates parameter gradients and returns the input gradient (`None` when
    /// input gradients are off for this stage). On error nothing changes.
    pub fn backward(&mut self, micro_batch: u64, dy: &[f32]) -> Result<Option<&[f32]>> {
        self.backward_with(micro_batch, dy, &mut || {})
    }

    /// [`Stage::backward`], calling `between` after every layer but the last (see
    /// [`Stage::forward_with`]).
    pub fn backward_with(
        &mut self,
        micro_batch: u64,
        dy: &[f32],
        between: &mut dyn FnMut(),
    ) -> Result<Option<&[f32]>> {
        self.backward_streaming(micro_batch, dy, &mut |_, _| between())
    }

    /// [`Stage::backward`], handing `done(offset, grads)` the parameter gradients that are
    /// complete after every layer but the last: `grads` is the flat gradient buffer from `offset`
    /// (the first parameter of the layer just finished) to the end. A data-parallel strategy
    /// starts reducing them while the remaining layers' backward runs (DDP's buckets). With
    /// deferred weight gradients ([`Stage::set_deferred_weight_grads`]) the linear layers' weight
    /// gradients are not in the buffer yet.
    pub fn backward_streaming(
        &mut self,
        micro_batch: u64,
        dy: &[f32],
        done: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Option<&[f32]>> {
        self.backward_impl(
            micro_batch,
            dy,
            &mut |progress| {
                if let Progress::Layer(offset, grads) = progress {
                    done(offset, grads);
                }
            },
            None,
            None,
        )
    }

    /// [`Stage::backward`] of the micro-batch that completes a step's gradients, followed by
    /// [`Stage::step`] — bit for bit — but with each layer updated right after its own backward
    /// (its weight and input gradients both done), while its weights and fresh gradient are
    /// still in cache: the separate step streamed all parameters, gradients and optimizer state
    /// from memory again (14% of an `mlp-deep` step on one core). With deferred weight gradients
    /// (or sizes only) it is the backward, then the step. `between` runs after every layer but
    /// the last, as in [`Stage::backward_with`], and within a linear layer too: after its input
    /// gradient and between parts of its update (at most 262,144 weights each), so that a
    /// ring's master answers a returning micro-batch's loss within ~0.3 ms of compute rather
    /// than after a whole layer (~2.7 ms for a 1024×1024 layer at 64 rows on one core).
    pub fn backward_and_step(
        &mut self,
        micro_batch: u64,
        dy: &[f32],
        optimizer: &mut Optimizer,
        lr: f32,
        between: &mut dyn FnMut(),
    ) -> Result<Option<&[f32]>> {
        // A tied matrix takes one update from both its gradients, so it waits for the whole
        // backward: no update inside it.
        if self.deferred.is_some() || ringtmp_meter::phantom() || self.tie.is_some() {
            self.backward_with(micro_batch, dy, between)?;
            self.step(optimizer, lr);
            return Ok(self.input_grad.then_some(self.input_grads[0].as_slice()));
        }
        self.backward_impl(
            micro_batch,
            dy,
            &mut |_| between(),
            Some((optimizer, lr)),
            None,
        )?;
        self.zero_grad();
        Ok(self.input_grad.then_some(self.input_grads[0].as_slice()))
    }

    /// [`Stage::backward`] (`step` `None`) or [`Stage::backward_and_step`] (`step` the optimizer
    /// and rate) that hands the stage's input gradient to `send` as soon as the chain of input
    /// gradients reaches it, before any update or linear layer's weight gradient: the stage
    /// before this one in a pipeline starts its own backward while this one finishes (the
    /// backward's B/W split of zero-bubble pipelines). The results are bit for bit those of the
    /// other two: each layer's input gradient reads the weights its forward used whichever part
    /// runs first, and each weight gradient and update reads only what the chain left. `send`
    /// is called exactly once, with the input gradient (never where this stage makes none).
    /// `between` runs as in [`Stage::backward_and_step`].
    pub fn backward_sending(
        &mut self,
        micro_batch: u64,
        dy: &[f32],
        step: Option<(&mut Optimizer, f32)>,
        between: &mut dyn FnMut(),
        send: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        if !self.input_grad || self.deferred.is_some() || self.tie.is_some() {
            let dx = match step {
                Some((optimizer, lr)) => {
                    self.backward_and_step(micro_batch, dy, optimizer, lr, between)?
                }
                None => self.backward_with(micro_batch, dy, between)?,
            };
            if let Some(dx) = dx {
                send(dx);
            }
            return Ok(());
        }
        if ringtmp_meter::phantom() {
            // Sizes only: the phases record the backward's work, the step its updates, in the
            // order of the split that computes (where a simulated network times what is sent).
            self.backward_impl(micro_batch, dy, &mut |_| between(), None, Some(send))?;
            if let Some((optimizer, lr)) = step {
                self.step(optimizer, lr);
            }
            return Ok(());
        }
        let stepped = step.is_some();
        self.backward_impl(micro_batch, dy, &mut |_| between(), step, Some(send))?;
        if stepped {
            self.zero_grad();
        }
        Ok(())
    }

    #[expect(
        clippy::too_many_lines,
        reason = "the fused backward: per layer its gradients, the step inside and the streaming hooks in one loop, so no buffer is copied"
    )]
    fn backward_impl(
        &mut self,
        micro_batch: u64,
        dy: &[f32],
        done: &mut dyn FnMut(Progress<'_>),
        step: Option<(&mut Optimizer, f32)>,
        send: Option<SendInputGrad<'_>>,
    ) -> Result<Option<&[f32]>> {
        let Some(stash) = self.in_flight.get(&micro_batch) else {
            return Err(Error::UnknownMicroBatch {
                stage: self.first_layer(),
                micro_batch,
            });
        };
        check_input("output gradient", stash.rows * self.output_len(), dy.len())?;
        let mut stash = self.in_flight.remove(&micro_batch).expect("checked above");
        let rows = stash.rows;
        // The weights this micro-batch's forward used (stashed), or the current ones.
        let mut weights = Some(
            stash
                .weights
                .take()
                .unwrap_or_else(|| Arc::clone(&self.params)),
        );
        // With the step in the backward: where each layer's update goes.
        let mut step = step.map(|(optimizer, lr)| {
            if optimizer.wants_no_decay() {
                let ranges = self.no_decay_ranges(optimizer.decays_embeddings());
                optimizer.set_no_decay(ranges);
            }
            let constants = optimizer.begin_step(lr);
            if weights
                .as_ref()
                .is_some_and(|w| Arc::ptr_eq(w, &self.params))
            {
                // The backward reads the current version itself, not a handle on it, so an
                // update in place is possible.
                weights = None;
            }
            let target = if Arc::strong_count(&self.params) == 1 {
                UpdateTarget::InPlace
            } else {
                // Another micro-batch in flight holds the current version: the update writes
                // the next one, as `step` does.
                let mut next = self.spare_params.pop().unwrap_or_default();
                set_len(&mut next, self.params.len());
                UpdateTarget::Next(next)
            };
            (optimizer, constants, target)
        });
        let last = self.layers.len() - 1;
        let phantom = ringtmp_meter::phantom();
        // Layers whose update ran inside their backward's own code (linear layers, by blocks).
        let mut updated = vec![false; self.layers.len()];
        // With `send`: the input gradients first, then the linear layers' weights.
        let phases: &[Phase] = match send {
            Some(_) => &[Phase::Inputs, Phase::Weights],
            None => &[Phase::All],
        };
        let mut send = send;
        for &phase in phases {
            if phase == Phase::Weights {
                let send = send.take().expect("a split backward has `send`");
                send(&self.input_grads[0]);
            }
            for i in (0..self.layers.len()).rev() {
                // A linear layer, or a part of a cut one (its rows of the layer, whose backward
                // is a linear layer's on gathered operands): both fuse the weight gradient into
                // the update, split the input gradient from the weight gradient and defer the
                // weight gradient alike.
                let part = match &self.layers[i].kind {
                    LayerKind::LinearHead(p) => Some((p, Side::Head)),
                    LayerKind::LinearTail(p) => Some((p, Side::Tail)),
                    _ => None,
                };
                let rows_view = match &self.layers[i].kind {
                    LayerKind::Linear(l) => Some(l.clone()),
                    _ => part.map(|(p, side)| p.rows_of(side)),
                };
                let linear = rows_view.is_some();
                // A linear layer over a sequence runs on every position of the samples.
                let lrows = self.layers[i].rows_for(rows);
                if phase == Phase::Weights && self.offsets[i + 1] == self.offsets[i] {
                    continue;
                }
                if i < last {
                    let offset = self.offsets[i + 1];
                    done(match phase {
                        Phase::All => Progress::Layer(offset, &self.grads[offset..]),
                        // Gradients complete from an offset on exist only layer by layer.
                        Phase::Inputs | Phase::Weights => Progress::Within,
                    });
                }
                // A layer's input gradient is wanted when a layer below it has parameters, or the
                // stage's own input gradient is (a ring's later stages). Below the first layer with
                // parameters nothing is: the model's first linear after a `flatten` made a 64×784
                // input gradient every step that no one read (7% of the first ring stage's GEMM
                // work in `mlp-deep`), and the parameter-free layers under it had no work at all.
                let want_dx = self.input_grad || self.offsets[i] > 0;
                if !want_dx && self.offsets[i + 1] == self.offsets[i] {
                    self.grads_written[i] = true;
                    continue;
                }
                // Recorded as it runs, for the simulator's clock: a split's input gradient is priced
                // before the send and a linear layer's weight gradient after it.
                // A linear layer whose input gradient no one reads (the model's first, on the
                // master) makes its weight gradient alone, and is priced so: before, the simulator
                // charged it the input gradient's GEMM too (1 ms a micro-batch of `mlp-deep`'s
                // master, measured against the planner's prediction).
                let metered = match phase {
                    Phase::All if linear && !want_dx => Some(ringtmp_meter::Pass::WeightGradAlone),
                    Phase::All => Some(ringtmp_meter::Pass::Backward),
                    Phase::Inputs if linear => want_dx.then_some(ringtmp_meter::Pass::InputGrad),
                    Phase::Inputs => Some(ringtmp_meter::Pass::Backward),
                    Phase::Weights if linear && !want_dx => {
                        Some(ringtmp_meter::Pass::WeightGradAlone)
                    }
                    Phase::Weights => linear.then_some(ringtmp_meter::Pass::WeightGrad),
                };
                if let Some(pass) = metered {
                    ringtmp_meter::layer(
                        self.layers[i].index,
                        pass,
                        self.layers[i].metered_rows(rows),
                    );
                }
                if phantom {
                    if want_dx {
                        set_len(
                            &mut self.input_grads[i],
                            rows * self.layers[i].input.numel(),
                        );
                    }
                    self.grads_written[i] = true;
                    continue;
                }
                if Fusion::absorbs(&self.fusion, i) {
                    // This layer's backward runs inside the conv's below.
                    self.grads_written[i] = true;
                    continue;
                }
                let (this, later) = self.input_grads.split_at_mut(i + 1);
                let fusion = self.fusion[i];
                // A fused conv takes the gradient of the last fused layer's output.
                let after = match fusion {
                    Fusion::None => i,
                    Fusion::Relu => i + 1,
                    Fusion::ReluPool => i + 2,
                };
                let upstream = if after == last { dy } else { &later[after - i] };
                let range = self.offsets[i]..self.offsets[i + 1];
                let read: &[f32] = weights.as_deref().unwrap_or(&self.params);
                let accumulate = self.grads_written[i];
                let threads = self.threads;
                // A part's own output gradient (`dy_A` of the head, `dy_B` of the tail), which
                // its weight gradient reads, and its input (the tail keeps `x` in its aux).
                let (own_dy, x): (&[f32], &[f32]) = match part {
                    Some((p, side)) => {
                        p.own_output_grad(side, upstream, rows, &mut self.part_grad);
                        let x = match side {
                            Side::Head => &stash.acts[i],
                            Side::Tail => &stash.aux[i].values,
                        };
                        (&self.part_grad, x)
                    }
                    _ => (upstream, &stash.acts[i]),
                };
                // `dx = dy · W` of a linear layer (the part's input gradient of a part), the same
                // call in each of its arms below.
                let input_grad = |linear: &crate::layers::Linear, dx: &mut Vec<f32>| match part {
                    Some((p, side)) => {
                        let w = &read[range.clone()];
                        p.input_grad_into(side, w, upstream, own_dy, rows, dx, threads)
                    }
                    None => {
                        linear.input_grad_into(&read[range.clone()], upstream, lrows, dx, threads)
                    }
                };
                let started = self.profile.is_some().then(std::time::Instant::now);
                match (&self.layers[i].kind, self.deferred.as_mut()) {
                    // Its gradients came with the input gradients; its update is below.
                    _ if phase == Phase::Weights && !linear => {}
                    (LayerKind::Conv2d(conv), _) if fusion != Fusion::None => {
                        if want_dx {
                            set_len(&mut this[i], rows * self.layers[i].input.numel());
                        }
                        let dx = want_dx.then_some(&mut this[i]);
                        let grad = match self.layers.get(i + 2).map(|l| &l.kind) {
                            Some(LayerKind::MaxPool2d(pool)) if fusion == Fusion::ReluPool => {
                                OutputGrad::ReluPool {
                                    pool,
                                    dy: upstream,
                                    pooled: &stash.acts[i + 3],
                                    indices: &stash.aux[i + 2].indices,
                                }
                            }
                            _ => OutputGrad::Relu {
                                dy: upstream,
                                relu_out: &stash.acts[i + 2],
                            },
                        };
                        conv.backward(
                            &read[range.clone()],
                            &mut self.grads[range.clone()],
                            accumulate,
                            &stash.acts[i],
                            grad,
                            rows,
                            dx,
                            &mut self.scratch,
                            self.threads,
                        );
                        self.grads_written[i] = true;
                    }
                    (_, None) if step.is_some() && rows_view.is_some() => {
                        let linear = rows_view.as_ref().expect("matched");
                        // The update in the backward, by blocks of the weight gradient: each block is
                        // made and applied while in cache (`Optimizer::update_blocks`). The input
                        // gradient reads the weights first, as an update in place overwrites them.
                        if want_dx && phase != Phase::Weights {
                            input_grad(linear, &mut this[i]);
                            done(Progress::Within);
                        }
                        if phase == Phase::Inputs {
                            if let (Some(t), Some(p)) = (started, self.profile.as_mut()) {
                                p[i].backward_seconds += t.elapsed().as_secs_f64();
                            }
                            continue;
                        }
                        let (optimizer, constants, target) = step.as_mut().expect("matched");
                        let updating = self.profile.is_some().then(std::time::Instant::now);
                        let weights_len = linear.in_features * linear.out_features;
                        let (grad_w, grad_b) = self.grads[range.clone()].split_at_mut(weights_len);
                        column_sums(grad_b, own_dy, accumulate);
                        let accumulated = accumulate.then_some(&*grad_w);
                        let gradient = |r: std::ops::Range<usize>, out: &mut [f32]| {
                            let acc = accumulated.map(|a| &a[r.clone()]);
                            linear.weight_grad_block(r, out, acc, x, own_dy, lrows);
                        };
                        let (w_at, b_at) = (range.start, range.start + weights_len);
                        let (from, to): (Option<&[f32]>, &mut [f32]) = match target {
                            UpdateTarget::InPlace => (
                                None,
                                &mut Arc::get_mut(&mut self.params)
                                    .expect("checked: nothing else holds the current version")
                                    [range.clone()],
                            ),
                            UpdateTarget::Next(next) => {
                                (Some(&self.params[range.clone()]), &mut next[range.clone()])
                            }
                        };
                        let (to_w, to_b) = to.split_at_mut(weights_len);
                        let (from_w, from_b) = match from {
                            Some(f) => (Some(&f[..weights_len]), Some(&f[weights_len..])),
                            None => (None, None),
                        };
                        // In parts of whole blocks (each block is made and applied on its own, so
                        // the bits are those of one call), with a word to the caller after each.
                        let block = linear.grad_block();
                        let part = (POLL_PARAMS / block).max(1) * block;
                        let mut at = 0;
                        while at < weights_len {
                            let end = (at + part).min(weights_len);
                            optimizer.update_blocks(
                                constants,
                                w_at + at,
                                from_w.map(|f| &f[at..end]),
                                &mut to_w[at..end],
                                block,
                                self.threads,
                                |r: std::ops::Range<usize>, out: &mut [f32]| {
                                    gradient(r.start + at..r.end + at, out)
                                },
                            );
                            at = end;
                            if at < weights_len {
                                done(Progress::Within);
                            }
                        }
                        optimizer.update_range(constants, b_at, from_b, to_b, grad_b, self.threads);
                        if let (Some(t), Some(p)) = (updating, self.profile.as_mut()) {
                            p[i].update_seconds += t.elapsed().as_secs_f64();
                        }
                        // The weight gradient itself was never written: only the step reads it, and
                        // `backward_and_step` forgets it right after.
                        self.grads_written[i] = true;
                        updated[i] = true;
                    }
                    (_, None) if phase != Phase::All && rows_view.is_some() => {
                        let linear = rows_view.as_ref().expect("matched");
                        // A split backward without the step: the input gradient in the first pass,
                        // the weight gradient (accumulated as `Linear::backward` does) in the second.
                        if phase == Phase::Inputs {
                            if want_dx {
                                input_grad(linear, &mut this[i]);
                            }
                        } else {
                            linear.weight_grad(
                                &mut self.grads[range.clone()],
                                accumulate,
                                x,
                                own_dy,
                                lrows,
                                self.threads,
                            );
                            self.grads_written[i] = true;
                        }
                    }
                    (_, Some(deferred)) if rows_view.is_some() => {
                        // Keep this micro-batch's rows; the weight gradient of the whole mini-batch is
                        // one GEMM at the step (see `set_deferred_weight_grads`).
                        let linear = rows_view.as_ref().expect("matched");
                        let pending = &mut deferred[i];
                        pending.x.extend_from_slice(x);
                        pending.dy.extend_from_slice(own_dy);
                        pending.rows += lrows;
                        if want_dx {
                            input_grad(linear, &mut this[i]);
                        }
                    }
                    _ => {
                        self.layers[i].backward(
                            &read[range.clone()],
                            &mut self.grads[range.clone()],
                            accumulate,
                            &stash.acts[i],
                            &stash.acts[i + 1],
                            &stash.aux[i],
                            upstream,
                            rows,
                            want_dx.then_some(&mut this[i]),
                            &mut self.scratch,
                            self.threads,
                        );
                        self.grads_written[i] = true;
                    }
                }
                let update_here = !updated[i] && phase != Phase::Inputs;
                if let Some((optimizer, constants, target)) = step.as_mut().filter(|_| update_here)
                {
                    let updating = self.profile.is_some().then(std::time::Instant::now);
                    if !range.is_empty() {
                        let grads = &self.grads[range.clone()];
                        match target {
                            UpdateTarget::InPlace => {
                                let params = Arc::get_mut(&mut self.params)
                                    .expect("checked: nothing else holds the current version");
                                let params = &mut params[range.clone()];
                                optimizer.update_range(
                                    constants,
                                    range.start,
                                    None,
                                    params,
                                    grads,
                                    self.threads,
                                );
                            }
                            UpdateTarget::Next(next) => optimizer.update_range(
                                constants,
                                range.start,
                                Some(&self.params[range.clone()]),
                                &mut next[range.clone()],
                                grads,
                                self.threads,
                            ),
                        }
                    }
                    if let (Some(t), Some(p)) = (updating, self.profile.as_mut()) {
                        p[i].update_seconds += t.elapsed().as_secs_f64();
                    }
                }
                if let (Some(t), Some(p)) = (started, self.profile.as_mut()) {
                    p[i].backward_seconds += t.elapsed().as_secs_f64();
                }
            }
        }
        self.free_stashes.push(stash);
        if let Some(weights) = weights {
            self.recycle(weights);
        }
        if let Some((_, _, UpdateTarget::Next(next))) = step {
            let previous = std::mem::replace(&mut self.params, Arc::new(next));
            self.recycle(previous);
        }
        Ok(self.input_grad.then_some(self.input_grads[0].as_slice()))
    }

    /// Applies the optimizer to the accumulated gradients at learning rate `lr`, then resets them.
    ///
    /// When an in-flight micro-batch still holds the current weights (weight stashing), the
    /// update is written to a new version, read from the held one in the same pass.
    pub fn step(&mut self, optimizer: &mut Optimizer, lr: f32) {
        self.prepare(optimizer);
        self.materialise_grads();
        match Arc::get_mut(&mut self.params) {
            Some(params) => optimizer.step(params, &self.grads, lr, self.threads),
            None => {
                let mut next = self.spare_params.pop().unwrap_or_default();
                set_len(&mut next, self.params.len());
                optimizer.step_into(&self.params, &mut next, &self.grads, lr, self.threads);
                self.params = Arc::new(next);
            }
        }
        if let Some((source, mirror)) = self.tie.as_ref().and_then(Tie::internal)
            && !ringtmp_meter::phantom()
        {
            // The mirror's gradient was folded into the table's (zero): it follows the table.
            tie::mirror(
                Arc::make_mut(&mut self.params).as_mut_slice(),
                &source,
                &mirror,
            );
            self.tie_stale = false;
        }
        self.zero_grad();
    }

    /// Keeps a released weight version's buffer for reuse if nothing else holds it.
    fn recycle(&mut self, weights: Arc<Vec<f32>>) {
        if let Ok(buffer) = Arc::try_unwrap(weights)
            && self.spare_params.len() < SPARE_PARAM_BUFFERS
        {
            self.spare_params.push(buffer);
        }
    }

    /// Forgets the accumulated gradients (cheaply: the next backward overwrites them).
    pub fn zero_grad(&mut self) {
        self.grads_written.fill(false);
        if let Some(deferred) = self.deferred.as_mut() {
            deferred.iter_mut().for_each(Pending::clear);
        }
    }

    /// Defers linear layers' weight gradients: each backward keeps its micro-batch's inputs and
    /// output gradients, and the step (or [`Stage::grads`]) computes the whole mini-batch's
    /// weight gradient as one GEMM over all its rows, instead of one small GEMM per micro-batch
    /// that re-reads and re-writes the full gradient. Costs the memory of those inputs and
    /// gradients until the step. The result is the same sum (up to floating-point order).
    pub fn set_deferred_weight_grads(&mut self, on: bool) {
        self.materialise_grads();
        self.deferred = on.then(|| (0..self.layers.len()).map(|_| Pending::default()).collect());
    }

    /// Drops every stashed micro-batch (after an aborted step).
    pub fn clear_in_flight(&mut self) {
        let stashes = std::mem::take(&mut self.in_flight);
        self.free_stashes.extend(stashes.into_values().map(|mut s| {
            s.weights = None;
            s
        }));
    }

    fn materialise_grads(&mut self) {
        if ringtmp_meter::phantom() {
            // Phantom backward passes (sizes only) defer nothing.
            return;
        }
        if let Some(deferred) = self.deferred.as_mut() {
            for (i, pending) in deferred.iter_mut().enumerate() {
                if pending.rows == 0 {
                    continue;
                }
                let linear = match &self.layers[i].kind {
                    LayerKind::Linear(linear) => Some(linear.clone()),
                    LayerKind::LinearHead(part) => Some(part.rows_of(Side::Head)),
                    LayerKind::LinearTail(part) => Some(part.rows_of(Side::Tail)),
                    _ => None,
                };
                if let Some(linear) = linear {
                    let g = &mut self.grads[self.offsets[i]..self.offsets[i + 1]];
                    linear.weight_grad(
                        g,
                        self.grads_written[i],
                        &pending.x,
                        &pending.dy,
                        pending.rows,
                        self.threads,
                    );
                    self.grads_written[i] = true;
                }
                pending.clear();
            }
        }
        for i in 0..self.layers.len() {
            if !self.grads_written[i] {
                self.grads[self.offsets[i]..self.offsets[i + 1]].fill(0.0);
                self.grads_written[i] = true;
            }
        }
        if let Some((source, mirror)) = self.tie.as_ref().and_then(Tie::internal) {
            tie::fold(&mut self.grads, &source, &mirror);
        }
    }
}

fn run_forward(
    layers: &[Layer],
    fusion: &[Fusion],
    offsets: &[usize],
    params: &[f32],
    stash: &mut Stash,
    pass: &Pass,
    threads: usize,
    mut profile: Option<&mut [LayerTime]>,
    between: &mut dyn FnMut(),
) {
    let phantom = ringtmp_meter::phantom();
    for (i, layer) in layers.iter().enumerate() {
        if i > 0 {
            between();
        }
        ringtmp_meter::layer(
            layer.index,
            ringtmp_meter::Pass::Forward,
            layer.metered_rows(stash.rows),
        );
        if phantom {
            set_len(&mut stash.acts[i + 1], stash.rows * layer.output.numel());
            continue;
        }
        if Fusion::absorbs(fusion, i) {
            // The conv before ran this layer.
            continue;
        }
        let started = profile.is_some().then(std::time::Instant::now);
        let (done, rest) = stash.acts.split_at_mut(i + 1);
        let params_i = &params[offsets[i]..offsets[i + 1]];
        match (&layer.kind, fusion[i]) {
            (LayerKind::Conv2d(conv), Fusion::Relu) => {
                // Straight into the ReLU's output; the conv's own is not kept.
                rest[0].clear();
                set_len(&mut rest[1], stash.rows * layers[i + 1].output.numel());
                let indices = &mut stash.aux[i].indices;
                conv.forward(
                    params_i,
                    &done[i],
                    stash.rows,
                    &mut rest[1],
                    Fused::Relu,
                    indices,
                    threads,
                );
            }
            (LayerKind::Conv2d(conv), Fusion::ReluPool) => {
                // Straight into the pool's output; neither the conv's nor the ReLU's is kept.
                let LayerKind::MaxPool2d(pool) = &layers[i + 2].kind else {
                    unreachable!("Fusion::of checked the pool");
                };
                rest[0].clear();
                rest[1].clear();
                set_len(&mut rest[2], stash.rows * layers[i + 2].output.numel());
                let indices = &mut stash.aux[i + 2].indices;
                conv.forward(
                    params_i,
                    &done[i],
                    stash.rows,
                    &mut rest[2],
                    Fused::ReluPool(pool),
                    indices,
                    threads,
                );
            }
            _ => layer.forward(
                params_i,
                &done[i],
                stash.rows,
                &mut rest[0],
                &mut stash.aux[i],
                pass,
                threads,
            ),
        }
        if let (Some(t), Some(p)) = (started, profile.as_deref_mut()) {
            p[i].forward_seconds += t.elapsed().as_secs_f64();
        }
    }
}

/// [`run_forward`] of an evaluation pass through `eval`'s two activation buffers in turn and its
/// one side-data buffer (no layer's output or side data is kept past the next layer's pass).
/// Returns which buffer holds the output.
fn run_inference(
    layers: &[Layer],
    fusion: &[Fusion],
    offsets: &[usize],
    params: &[f32],
    eval: &mut Stash,
    threads: usize,
) -> usize {
    let phantom = ringtmp_meter::phantom();
    let rows = eval.rows;
    let (mut input, aux) = (0, &mut eval.aux[0]);
    let pass = Pass::eval();
    for (i, layer) in layers.iter().enumerate() {
        ringtmp_meter::layer(
            layer.index,
            ringtmp_meter::Pass::Forward,
            layer.metered_rows(rows),
        );
        // Sizes only: every layer's output, fused or not.
        if !phantom && Fusion::absorbs(fusion, i) {
            // The conv before ran this layer.
            continue;
        }
        let [a, b] = &mut eval.acts[..] else {
            unreachable!("two buffers")
        };
        let (x, y) = if input == 0 { (&*a, b) } else { (&*b, a) };
        input = 1 - input;
        if phantom {
            set_len(y, rows * layer.output.numel());
            continue;
        }
        let params_i = &params[offsets[i]..offsets[i + 1]];
        match (&layer.kind, fusion[i]) {
            (LayerKind::Conv2d(conv), Fusion::Relu) => {
                set_len(y, rows * layers[i + 1].output.numel());
                conv.forward(params_i, x, rows, y, Fused::Relu, &mut aux.indices, threads);
            }
            (LayerKind::Conv2d(conv), Fusion::ReluPool) => {
                let LayerKind::MaxPool2d(pool) = &layers[i + 2].kind else {
                    unreachable!("Fusion::of checked the pool");
                };
                set_len(y, rows * layers[i + 2].output.numel());
                let fused = Fused::ReluPool(pool);
                conv.forward(params_i, x, rows, y, fused, &mut aux.indices, threads);
            }
            _ => layer.forward(params_i, x, rows, y, aux, &pass, threads),
        }
    }
    input
}

/// [`check_len`] of an input that may come from the wire: in phantom mode (sizes only), a
/// payload that never carried values arrives empty.
fn check_input(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if got == 0 && ringtmp_meter::phantom() {
        return Ok(());
    }
    check_len(what, expected, got)
}

/// Copies a checked input into a stage buffer of `len` values (left as zeros for a phantom's
/// empty input).
fn copy_input(to: &mut Vec<f32>, x: &[f32], len: usize) {
    set_len(to, len);
    if x.len() == len {
        to.copy_from_slice(x);
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Length {
            what,
            expected,
            got,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, Shape};

    /// An evaluation pass, through two buffers in turn, gives a training forward's output bit
    /// for bit (no dropout in these models), the fused convolutions included, whatever the rows
    /// of the pass before.
    #[test]
    fn inference_through_two_buffers_equals_the_training_forward() {
        let cases = [
            ("cnn", Shape::image(28, 28, 1), Shape::flat(10), 784),
            ("gpt-nano", Shape::flat(32), Shape(vec![32, 10]), 32),
        ];
        for (name, input, output, width) in cases {
            let layers = ModelSpec::preset(name, 10)
                .unwrap()
                .build_for(&input, &output)
                .unwrap();
            let mut stage = Stage::new(&layers, 0..layers.len(), 3, 1);
            for rows in [3, 1, 2] {
                let x: Vec<f32> = (0..rows * width).map(|i| (i % 10) as f32).collect();
                let pass = Pass {
                    train: true,
                    seed: 1,
                    step: 0,
                    row_offset: 0,
                };
                let trained = stage.forward(0, &x, rows, &pass).unwrap().to_vec();
                stage.clear_in_flight();
                assert_eq!(
                    stage.infer(&x, rows).unwrap(),
                    &trained[..],
                    "{name}, {rows} rows"
                );
            }
        }
    }

    /// Below the first layer with parameters no input gradient is made (nothing reads it) unless
    /// the stage's own input gradient is wanted; the parameter gradients are the same either way.
    #[test]
    fn no_input_gradient_is_made_below_the_first_layer_with_parameters() {
        let spec = r#"
name = "first-layers"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 8
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 10
"#;
        let layers = ModelSpec::from_toml(spec, "test")
            .unwrap()
            .build(&Shape::image(4, 4, 1), 10)
            .unwrap();
        let rows = 3;
        let x: Vec<f32> = (0..rows * 16).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
        let dy: Vec<f32> = (0..rows * 10).map(|i| (i % 5) as f32 / 5.0 - 0.4).collect();
        let pass = Pass {
            train: true,
            seed: 1,
            step: 0,
            row_offset: 0,
        };
        let run = |input_grad: bool| {
            let mut stage = Stage::new(&layers, 0..layers.len(), 1, 1);
            stage.set_input_grad(input_grad);
            stage.forward(0, &x, rows, &pass).unwrap();
            let dx = stage.backward(0, &dy).unwrap().map(<[f32]>::to_vec);
            let made: Vec<usize> = stage.input_grads.iter().map(Vec::len).collect();
            (dx, stage.grads().to_vec(), made)
        };
        let (dx, grads, made) = run(false);
        assert_eq!(dx, None);
        // Layer i's input gradient: the flatten's and the first linear's are not made; the
        // relu's (the first linear's output gradient) and the last linear's are.
        assert_eq!(made, [0, 0, rows * 8, rows * 8]);
        let (dx, wanted_grads, made) = run(true);
        assert_eq!(dx.map(|d| d.len()), Some(rows * 16));
        assert_eq!(made, [rows * 16, rows * 16, rows * 8, rows * 8]);
        assert_eq!(
            grads, wanted_grads,
            "the parameter gradients do not depend on it"
        );
    }
}
