//! What compute a node's thread did, in units a cost model can price, and the sizes-only
//! (*phantom*) mode in which the simulator runs clusters too large for this machine.
//!
//! The kernels record their work here as they run: a layer's forward or backward pass over some
//! rows ([`layer`]), an optimizer step over some parameters ([`update`]), an element-wise pass
//! over some floats ([`elementwise`]: the sums and averages of models and gradients, and the
//! copies to and from the wire). Real runs time compute on the wall clock and never read the
//! record. The simulator prices it: when a node accounts for a block of compute, its virtual
//! clock drains the record ([`take`]) and charges what the cost model says that work takes on the
//! simulated node. So simulated compute is charged where, and as often as, the strategy's own
//! code ran it — not by a separate formula of what a strategy ought to do.
//!
//! Phantom mode is per thread ([`set_phantom`]): the kernels record their work and skip the
//! arithmetic, and tensors leave for the simulated wire with their header (shape and element
//! type) and no payload. Buffers keep their lengths — zeroed allocations, which the kernel maps
//! lazily and which are never written — so the protocols make the same decisions from the same
//! sizes, and a 100 M-parameter model on 1,024 simulated nodes needs no memory for its values.
//!
//! Invariant: in phantom mode nothing a strategy decides may depend on a tensor's values, only
//! on sizes and on the protocol's own messages. The strategy crate's simulator tests run each
//! strategy both ways on the simulated network and require the same virtual time and bytes.

use std::cell::{Cell, RefCell};

/// A layer's pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// Forward (training or evaluation).
    Forward,
    /// Backward: input and parameter gradients.
    Backward,
    /// The first part of a split backward (a ring stage's, which sends its input gradient before
    /// it makes its weight gradients): the layer's input gradient, and any parameter gradients
    /// made with it (a convolution's).
    InputGrad,
    /// The second part of a split backward: a linear layer's weight gradients.
    WeightGrad,
    /// A linear layer's backward without its input gradient (no one reads it: the model's first
    /// layer with parameters): its weight gradients alone.
    WeightGradAlone,
}

/// Work a thread did since the last [`take`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Work {
    /// Rows run through each layer's forward pass, by the layer's index in the model.
    pub forward_rows: Vec<u64>,
    /// Rows run through each layer's backward pass, by the layer's index in the model.
    pub backward_rows: Vec<u64>,
    /// Rows run through the input-gradient part of a split backward ([`Pass::InputGrad`]).
    pub input_grad_rows: Vec<u64>,
    /// Rows run through the weight-gradient part of a split backward ([`Pass::WeightGrad`]).
    pub weight_grad_rows: Vec<u64>,
    /// Rows run through a backward that made weight gradients alone ([`Pass::WeightGradAlone`]).
    pub weight_grad_alone_rows: Vec<u64>,
    /// Parameters updated by optimizer steps.
    pub updated_params: u64,
    /// Floats passed over element-wise: sums and averages, copies to and from the wire.
    pub elementwise: u64,
}

impl Work {
    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.updated_params == 0
            && self.elementwise == 0
            && self.forward_rows.iter().all(|r| *r == 0)
            && self.backward_rows.iter().all(|r| *r == 0)
            && self.input_grad_rows.iter().all(|r| *r == 0)
            && self.weight_grad_rows.iter().all(|r| *r == 0)
            && self.weight_grad_alone_rows.iter().all(|r| *r == 0)
    }
}

/// In phantom mode, tensors up to this many values still carry them by default (see
/// [`elides`]).
pub const DEFAULT_INLINE_VALUES: usize = 1 << 16;

thread_local! {
    static WORK: RefCell<Work> = RefCell::new(Work::default());
    static PHANTOM: Cell<bool> = const { Cell::new(false) };
    static INLINE: Cell<usize> = const { Cell::new(DEFAULT_INLINE_VALUES) };
}

/// Records a pass of layer `index` (its place in the whole model) over `rows` rows.
pub fn layer(index: usize, pass: Pass, rows: usize) {
    WORK.with_borrow_mut(|w| {
        let per_layer = match pass {
            Pass::Forward => &mut w.forward_rows,
            Pass::Backward => &mut w.backward_rows,
            Pass::InputGrad => &mut w.input_grad_rows,
            Pass::WeightGrad => &mut w.weight_grad_rows,
            Pass::WeightGradAlone => &mut w.weight_grad_alone_rows,
        };
        if per_layer.len() <= index {
            per_layer.resize(index + 1, 0);
        }
        per_layer[index] += rows as u64;
    });
}

/// Records an optimizer step over `params` parameters.
pub fn update(params: usize) {
    WORK.with_borrow_mut(|w| w.updated_params += params as u64);
}

/// Records an element-wise pass over `floats` values.
pub fn elementwise(floats: usize) {
    WORK.with_borrow_mut(|w| w.elementwise += floats as u64);
}

/// The work recorded on this thread since the last call, which starts a new record.
pub fn take() -> Work {
    WORK.with_borrow_mut(std::mem::take)
}

/// Puts back a record [`take`] returned, in place of this thread's (the simulator runs many
/// nodes on one thread, each with its own record, swapped in as it runs).
pub fn restore(work: Work) {
    WORK.with_borrow_mut(|w| *w = work);
}

/// This thread's phantom settings: `(on, inline values)` (see [`set_phantom`]).
pub fn phantom_settings() -> (bool, usize) {
    (PHANTOM.get(), INLINE.get())
}

/// Runs `f`, leaving out of the record the work it does (evaluations: the simulator does not
/// charge them to the training compute that follows).
pub fn unmetered<R>(f: impl FnOnce() -> R) -> R {
    let before = take();
    let result = f();
    WORK.with_borrow_mut(|w| *w = before);
    result
}

/// Whether this thread runs in phantom mode (sizes only, no arithmetic).
pub fn phantom() -> bool {
    PHANTOM.get()
}

/// Turns phantom mode on or off for this thread; in phantom mode tensors of more than
/// `inline_values` values travel without them ([`elides`]).
pub fn set_phantom(on: bool, inline_values: usize) {
    PHANTOM.set(on);
    INLINE.set(inline_values);
}

/// Whether a tensor of `values` values travels without them: in phantom mode, those larger than
/// the inline limit (models, gradients, large activations). Smaller ones (logits, most
/// activations) keep their meaningless values, so that code that reads them — the loss — runs
/// unchanged, at little cost in memory.
pub fn elides(values: usize) -> bool {
    PHANTOM.get() && values > INLINE.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_accumulate_per_thread_until_taken() {
        layer(2, Pass::Forward, 64);
        layer(2, Pass::Forward, 32);
        layer(0, Pass::Backward, 8);
        layer(1, Pass::InputGrad, 4);
        layer(3, Pass::WeightGrad, 2);
        update(100);
        elementwise(10);
        std::thread::spawn(|| layer(5, Pass::Forward, 1))
            .join()
            .unwrap();
        let w = take();
        assert_eq!(w.forward_rows, vec![0, 0, 96]);
        assert_eq!(w.backward_rows, vec![8]);
        assert_eq!(w.input_grad_rows, vec![0, 4]);
        assert_eq!(w.weight_grad_rows, vec![0, 0, 0, 2]);
        assert_eq!((w.updated_params, w.elementwise), (100, 10));
        assert!(take().is_empty(), "taking starts a new record");
    }

    #[test]
    fn phantom_mode_is_per_thread() {
        set_phantom(true, 10);
        assert!(phantom());
        assert!(elides(11) && !elides(10));
        assert!(!std::thread::spawn(phantom).join().unwrap());
        set_phantom(false, 10);
        assert!(!phantom() && !elides(11));
    }
}
