//! A linear layer cut in two by its output features, so that a pipeline can cut *inside* it: the
//! *head* holds rows `0..split` of `W` (and of `b`), the *tail* rows `split..out`.
//!
//! The head maps `x` (`in` features a row) to `[x | y_A]` (`in + split`), with
//! `y_A = x · W[..split]ᵀ + b[..split]`; the tail maps that to `[y_A | y_B]` (`out`), with
//! `y_B = x · W[split..]ᵀ + b[split..]`. Together they compute exactly the whole layer's `y` (each
//! output feature is the same dot product), and backward the same gradients: the tail's input
//! gradient is `[dy_B · W[split..] | dy_A]`, and the head adds `dy_A · W[..split]` to its first
//! part. Rows stay interleaved (`[x | y_A]` row by row), so anything that slices a tensor by rows
//! slices these too.
//!
//! Invariant: a head and a tail of the same layer, initialised with the layer's index, hold
//! exactly the rows of the whole layer's initial parameters (see `Layer::init`), so a model with
//! a cut layer starts bit-identical to the unsplit one.

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

use super::Linear;
use crate::kernels::set_len;

/// Geometry of one part of a linear layer cut after output feature `split`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearPart {
    /// Input features of the whole layer.
    pub in_features: usize,
    /// Output features of the whole layer.
    pub out_features: usize,
    /// Output features the head computes (`0 < split < out_features`).
    pub split: usize,
}

thread_local! {
    /// Gathered operands of the GEMMs (a part's rows are strided in its tensors).
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// A side's own output gradient in [`LinearPart::backward`].
    static OWN_GRAD: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Copies `width` values at `offset` of each `stride`-wide row of `from` into `to` (`n × width`).
fn gather(to: &mut Vec<f32>, from: &[f32], n: usize, stride: usize, offset: usize, width: usize) {
    set_len(to, n * width);
    for (row, out) in to.chunks_exact_mut(width).enumerate().take(n) {
        out.copy_from_slice(&from[row * stride + offset..][..width]);
    }
}

/// Copies each `width`-wide row of `from` (`n × width`) to `offset` of the `stride`-wide rows of
/// `to`.
fn scatter(to: &mut [f32], from: &[f32], n: usize, stride: usize, offset: usize, width: usize) {
    for (row, part) in from.chunks_exact(width).enumerate().take(n) {
        to[row * stride + offset..][..width].copy_from_slice(part);
    }
}

impl LinearPart {
    /// The head's share as a plain linear layer (`in → split`).
    fn head(&self) -> Linear {
        Linear {
            in_features: self.in_features,
            out_features: self.split,
            bias: true,
        }
    }

    /// The tail's share as a plain linear layer (`in → out − split`).
    fn tail(&self) -> Linear {
        Linear {
            in_features: self.in_features,
            out_features: self.out_features - self.split,
            bias: true,
        }
    }

    /// Parameters the head holds: its rows of `W`, then of `b`.
    pub fn head_param_count(&self) -> usize {
        self.head().param_count()
    }

    /// Parameters the tail holds.
    pub fn tail_param_count(&self) -> usize {
        self.tail().param_count()
    }

    /// Head forward: `u = [x | x · W_Aᵀ + b_A]`, `u` is `n × (in + split)`.
    pub(crate) fn head_forward(
        &self,
        p: &[f32],
        x: &[f32],
        n: usize,
        u: &mut [f32],
        threads: usize,
    ) {
        let (fi, s) = (self.in_features, self.split);
        SCRATCH.with_borrow_mut(|(y_a, _)| {
            set_len(y_a, n * s);
            self.head().forward(p, x, n, y_a, threads);
            scatter(u, x, n, fi + s, 0, fi);
            scatter(u, y_a, n, fi + s, fi, s);
        });
    }

    /// Tail forward: `y = [y_A | x · W_Bᵀ + b_B]` from `u = [x | y_A]`; keeps `x` gathered in
    /// `x_kept` (`n × in`) for the backward.
    pub(crate) fn tail_forward(
        &self,
        p: &[f32],
        u: &[f32],
        n: usize,
        y: &mut [f32],
        x_kept: &mut Vec<f32>,
        threads: usize,
    ) {
        let (fi, fo, s) = (self.in_features, self.out_features, self.split);
        gather(x_kept, u, n, fi + s, 0, fi);
        SCRATCH.with_borrow_mut(|(y_b, y_a)| {
            set_len(y_b, n * (fo - s));
            self.tail().forward(p, x_kept, n, y_b, threads);
            gather(y_a, u, n, fi + s, fi, s);
            scatter(y, y_a, n, fo, 0, s);
            scatter(y, y_b, n, fo, s, fo - s);
        });
    }

    /// The rows of `W` (and `b`) one side holds, as a plain linear layer: its parameters are laid
    /// out as that layer's, and its weight gradient is that layer's from `x` and the side's own
    /// output gradient ([`LinearPart::own_output_grad`]).
    pub(crate) fn rows_of(&self, side: Side) -> Linear {
        match side {
            Side::Head => self.head(),
            Side::Tail => self.tail(),
        }
    }

    /// The gradient of the side's own outputs, gathered from the gradient of its whole output
    /// (`[dx_pass | dy_A]` for the head: `dy_A`; `[dy_A | dy_B]` for the tail: `dy_B`) into `to`.
    pub(crate) fn own_output_grad(
        &self,
        side: Side,
        upstream: &[f32],
        n: usize,
        to: &mut Vec<f32>,
    ) {
        let (fi, fo, s) = (self.in_features, self.out_features, self.split);
        match side {
            Side::Head => gather(to, upstream, n, fi + s, fi, s),
            Side::Tail => gather(to, upstream, n, fo, s, fo - s),
        }
    }

    /// The side's input gradient into `dx` from the gradient of its whole output (`upstream`) and
    /// its own part of it (`own`, from [`LinearPart::own_output_grad`]): the head's is
    /// `dx_pass + dy_A · W_A` (`n × in`), the tail's `[dy_B · W_B | dy_A]` (`n × (in + split)`).
    /// Reads only the weights, so it may run before the side's weight gradient and update.
    pub(crate) fn input_grad_into(
        &self,
        side: Side,
        p: &[f32],
        upstream: &[f32],
        own: &[f32],
        n: usize,
        dx: &mut Vec<f32>,
        threads: usize,
    ) {
        let (fi, fo, s) = (self.in_features, self.out_features, self.split);
        match side {
            Side::Head => {
                self.head().input_grad_into(p, own, n, dx, threads);
                for (row, d) in dx.chunks_exact_mut(fi).enumerate().take(n) {
                    let pass = &upstream[row * (fi + s)..][..fi];
                    d.iter_mut().zip(pass).for_each(|(d, q)| *d += q);
                }
            }
            Side::Tail => {
                set_len(dx, n * (fi + s));
                SCRATCH.with_borrow_mut(|(dx_b, _)| {
                    self.tail().input_grad_into(p, own, n, dx_b, threads);
                    scatter(dx, dx_b, n, fi + s, 0, fi);
                });
                // dy_A passes through to the head.
                for row in 0..n {
                    dx[row * (fi + s) + fi..][..s].copy_from_slice(&upstream[row * fo..][..s]);
                }
            }
        }
    }

    /// One side's backward as one call (the stage runs the parts itself where it fuses the
    /// update or sends the input gradient first): the weight gradient (+)= from `x` (the head's
    /// input; the tail's kept `x`) and the side's own output gradient, then the input gradient.
    pub(crate) fn backward(
        &self,
        side: Side,
        p: &[f32],
        g: &mut [f32],
        accumulate: bool,
        x: &[f32],
        upstream: &[f32],
        n: usize,
        dx: Option<&mut Vec<f32>>,
        threads: usize,
    ) {
        let mut own = OWN_GRAD.take();
        self.own_output_grad(side, upstream, n, &mut own);
        self.rows_of(side)
            .weight_grad(g, accumulate, x, &own, n, threads);
        if let Some(dx) = dx {
            self.input_grad_into(side, p, upstream, &own, n, dx, threads);
        }
        OWN_GRAD.set(own);
    }
}

/// Which part of a cut linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Rows `0..split`: maps `x` to `[x | y_A]`.
    Head,
    /// Rows `split..out`: maps `[x | y_A]` to `[y_A | y_B]`.
    Tail,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{Aux, Layer, Pass, cut_linear};
    use crate::{ModelSpec, Shape, Stage};

    fn whole_layer() -> Layer {
        ModelSpec::preset("mlp", 10)
            .unwrap()
            .build(&Shape::flat(784), 10)
            .unwrap()
            .into_iter()
            .find(|l| matches!(l.kind, crate::LayerKind::Linear(_)))
            .unwrap()
    }

    #[test]
    fn head_and_tail_start_as_the_rows_of_the_whole_layer() {
        let layers = vec![whole_layer()];
        let cut = cut_linear(&layers, 0, 300).unwrap();
        let whole_count = layers[0].param_count();
        let mut whole = vec![0.0; whole_count];
        layers[0].init(&mut whole, 42);
        let (mut head, mut tail) = (
            vec![0.0; cut[0].param_count()],
            vec![0.0; cut[1].param_count()],
        );
        cut[0].init(&mut head, 42);
        cut[1].init(&mut tail, 42);
        assert_eq!(head.len() + tail.len(), whole_count);
        let weights = 784 * 1024;
        let (w, b) = whole.split_at(weights);
        assert_eq!(&head[..300 * 784], &w[..300 * 784]);
        assert_eq!(&tail[..724 * 784], &w[300 * 784..]);
        assert_eq!(&head[300 * 784..], &b[..300]);
        assert_eq!(&tail[724 * 784..], &b[300..]);
    }

    #[test]
    fn a_cut_that_leaves_a_part_empty_or_is_not_linear_is_refused() {
        let layers = ModelSpec::preset("mlp", 10)
            .unwrap()
            .build(&Shape::flat(784), 10)
            .unwrap();
        let linear = layers
            .iter()
            .position(|l| matches!(l.kind, crate::LayerKind::Linear(_)))
            .unwrap();
        for split in [0, 1024, 5000] {
            let err = cut_linear(&layers, linear, split).unwrap_err().to_string();
            assert!(err.contains("leaves a part empty"), "{err}");
        }
        let relu = layers
            .iter()
            .position(|l| l.kind == crate::LayerKind::Relu)
            .unwrap();
        let err = cut_linear(&layers, relu, 10).unwrap_err().to_string();
        assert!(err.contains("only a linear layer"), "{err}");
        assert!(cut_linear(&layers, 99, 10).is_err());
    }

    /// The oracle: a model with a layer cut in two, as two stages cut between head and tail,
    /// computes the unsplit model's output, input gradient and parameter gradients (after one
    /// SGD step, its parameters), within f32 rounding.
    #[test]
    fn a_model_cut_inside_a_layer_trains_as_the_whole_model() {
        let layers = ModelSpec::preset("mlp", 10)
            .unwrap()
            .build(&Shape::flat(784), 10)
            .unwrap();
        // Cut the second 1024→1024 layer after 384 of its outputs.
        let at = layers
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(l.kind, crate::LayerKind::Linear(_)))
            .nth(1)
            .unwrap()
            .0;
        let cut = cut_linear(&layers, at, 384).unwrap();
        assert_eq!(cut.len(), layers.len() + 1);
        let rows = 5;
        let x: Vec<f32> = (0..rows * 784)
            .map(|i| ((i * 37) % 101) as f32 / 101.0)
            .collect();
        let dy: Vec<f32> = (0..rows * 10)
            .map(|i| ((i * 13) % 7) as f32 / 7.0 - 0.4)
            .collect();
        let pass = Pass {
            train: true,
            seed: 1,
            step: 0,
            row_offset: 0,
        };

        let mut whole = Stage::new(&layers, 0..layers.len(), 9, 1);
        whole.set_input_grad(true);
        ringtmp_meter::take();
        let y_whole = whole.forward(0, &x, rows, &pass).unwrap().to_vec();
        let dx_whole = whole.backward(0, &dy).unwrap().unwrap().to_vec();
        let metered_whole = ringtmp_meter::take();

        // Two stages cut between the head (ends the first) and the tail (starts the second).
        let mut first = Stage::new(&cut, 0..at + 1, 9, 1);
        let mut second = Stage::new(&cut, at + 1..cut.len(), 9, 1);
        first.set_input_grad(true);
        second.set_input_grad(true);
        let u = first.forward(0, &x, rows, &pass).unwrap().to_vec();
        assert_eq!(u.len(), rows * (1024 + 384));
        let y_cut = second.forward(0, &u, rows, &pass).unwrap().to_vec();
        let du = second.backward(0, &dy).unwrap().unwrap().to_vec();
        let dx_cut = first.backward(0, &du).unwrap().unwrap().to_vec();
        // The simulator's meter counts the halves' rows as their shares of the whole layer's.
        let metered_cut = ringtmp_meter::take();
        assert_eq!(metered_cut.forward_rows, metered_whole.forward_rows);
        assert_eq!(metered_cut.backward_rows, metered_whole.backward_rows);
        assert_eq!(cut[at].metered_rows(64), 24);
        assert_eq!(cut[at + 1].metered_rows(64), 40);

        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
            let worst = a
                .iter()
                .zip(b)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            assert!(worst <= 1e-5 * scale, "{what}: worst {worst} of {scale}");
        };
        close(&y_whole, &y_cut, "output");
        close(&dx_whole, &dx_cut, "input gradient");
        // Parameter gradients: the cut layer's are the whole layer's rows, the others equal.
        let mut cut_grads = first.grads().to_vec();
        cut_grads.extend_from_slice(second.grads());
        let whole_grads = whole.grads().to_vec();
        let (fi, fo, s) = (1024, 1024, 384);
        let head_at: usize = cut[..at].iter().map(Layer::param_count).sum();
        let (head_n, tail_n) = (s * (fi + 1), (fo - s) * (fi + 1));
        let mut reordered = cut_grads[..head_at].to_vec();
        let (head, tail) = (
            &cut_grads[head_at..head_at + head_n],
            &cut_grads[head_at + head_n..head_at + head_n + tail_n],
        );
        reordered.extend_from_slice(&head[..s * fi]);
        reordered.extend_from_slice(&tail[..(fo - s) * fi]);
        reordered.extend_from_slice(&head[s * fi..]);
        reordered.extend_from_slice(&tail[(fo - s) * fi..]);
        reordered.extend_from_slice(&cut_grads[head_at + head_n + tail_n..]);
        close(&whole_grads, &reordered, "parameter gradients");
    }

    #[test]
    fn a_tail_keeps_the_input_it_needs_in_its_aux() {
        let part = LinearPart {
            in_features: 3,
            out_features: 4,
            split: 1,
        };
        // Rows [x | y_A]: x = (1, 2, 3), y_A = 10.
        let u = [1.0, 2.0, 3.0, 10.0, 4.0, 5.0, 6.0, 20.0];
        let p = vec![0.5; part.tail_param_count()];
        let (mut y, mut aux) = (vec![0.0; 8], Aux::default());
        part.tail_forward(&p, &u, 2, &mut y, &mut aux.values, 1);
        assert_eq!(aux.values, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // y = [y_A | 0.5·Σx + 0.5] per row.
        assert_eq!(y, [10.0, 3.5, 3.5, 3.5, 20.0, 8.0, 8.0, 8.0]);
    }
}
