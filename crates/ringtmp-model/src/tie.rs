//! Weight tying: a language model's head and its token embedding as one matrix.
//!
//! GPT-2 and nanoGPT use the token embedding `wte` (`[vocab, width]`) as the LM head's weight
//! too (a linear layer's weight is `[out, in]`, the same layout). ringtmp keeps the flat
//! buffers' invariant — every layer owns its own range — by making the head's weight a
//! *mirror*: the embedding's table is the one matrix, and the head's range holds a copy of it
//! that is never trained on its own.
//!
//! Invariants, for a stage that holds both (the *internal* case):
//! - After every step, every import of parameters (the next pass sees it) and at
//!   initialisation, the mirror equals the source bit for bit.
//! - Whenever gradients are read (norms, export, step), the mirror's gradient has been added to
//!   the source's and the mirror's is zero: the matrix gets one update from the summed
//!   gradient, and a gradient norm counts it once.
//!
//! Where the two are on different stages of one process (a ring's master holding the
//! embedding's stage and the head's), the owner of both stages moves the mirror's gradient to
//! the source ([`crate::Stage::take_tied_grad`], [`crate::Stage::add_tied_grad`]) before the
//! step and the source's values to the mirror after it ([`crate::Stage::tied_source`],
//! [`crate::Stage::set_tied_mirror`]). A checkpoint reader fills a mirror from the source's
//! tensor, so a checkpoint's copy of the mirror is never trusted.

use std::ops::Range;

use crate::layers::{Layer, LayerKind};

/// Where a stage's tied ranges are, in its flat buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tie {
    /// The embedding's token table, when this stage holds it.
    pub source: Option<Range<usize>>,
    /// The head's weight, when this stage holds it.
    pub mirror: Option<Range<usize>>,
}

impl Tie {
    /// The tie of the stage holding `layers[range]`, whose layer `i` starts at
    /// `offsets[i - range.start]`; `None` where the stage holds neither end of one.
    pub fn of(layers: &[Layer], range: Range<usize>, offsets: &[usize]) -> Option<Self> {
        let head = layers.iter().position(|l| l.tied_to.is_some())?;
        let source_index = layers[head].tied_to?;
        let embedding = layers.iter().position(|l| l.index == source_index)?;
        let LayerKind::Embedding(e) = &layers[embedding].kind else {
            return None;
        };
        let table = e.vocab * e.width;
        let at = |i: usize| range.contains(&i).then(|| offsets[i - range.start]);
        let tie = Self {
            source: at(embedding).map(|start| start..start + table),
            mirror: at(head).map(|start| start..start + table),
        };
        (tie.source.is_some() || tie.mirror.is_some()).then_some(tie)
    }

    /// Both ends in this stage.
    pub fn internal(&self) -> Option<(Range<usize>, Range<usize>)> {
        Some((self.source.clone()?, self.mirror.clone()?))
    }
}

/// Copies the source's values over the mirror's.
pub(crate) fn mirror(values: &mut [f32], source: &Range<usize>, mirror: &Range<usize>) {
    values.copy_within(source.clone(), mirror.start);
}

/// Adds the mirror's gradient to the source's and zeroes the mirror's.
pub(crate) fn fold(grads: &mut [f32], source: &Range<usize>, mirror: &Range<usize>) {
    let (low, high, source_first) = if source.start < mirror.start {
        (source.clone(), mirror.clone(), true)
    } else {
        (mirror.clone(), source.clone(), false)
    };
    let (a, b) = grads.split_at_mut(high.start);
    let (low, high) = (&mut a[low], &mut b[..high.len()]);
    let (src, mir) = if source_first {
        (low, high)
    } else {
        (high, low)
    };
    for (s, m) in src.iter_mut().zip(mir.iter_mut()) {
        *s += *m;
        *m = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use crate::layers::{Layer, Pass};
    use crate::loss::softmax_cross_entropy;
    use crate::optim::{Optimizer, OptimizerConfig};
    use crate::spec::{LayerSpec, ModelSpec};
    use crate::{Shape, Stage};

    const VOCAB: usize = 11;
    const WIDTH: usize = 16;
    const SEQ: usize = 6;

    fn gpt(tied: bool) -> Vec<Layer> {
        use LayerSpec::*;
        let spec = ModelSpec {
            name: "tiny".into(),
            layers: vec![
                Embedding {
                    vocab: VOCAB,
                    width: WIDTH,
                    positions: true,
                },
                Block {
                    heads: 2,
                    mlp_ratio: 2,
                },
                LayerNorm {
                    eps: crate::layers::NORM_EPS,
                },
                Linear {
                    out: VOCAB,
                    bias: true,
                },
            ],
            tie_embeddings: tied,
            stale_momentum: None,
        };
        spec.build_for(&Shape::flat(SEQ), &Shape(vec![SEQ, VOCAB]))
            .unwrap()
    }

    fn batch() -> (Vec<f32>, Vec<u32>) {
        let x = (0..2 * SEQ).map(|i| ((i * 7 + 2) % VOCAB) as f32).collect();
        let y = (0..2 * SEQ).map(|i| ((i * 5 + 1) % VOCAB) as u32).collect();
        (x, y)
    }

    /// A training pass of `stages` in a chain, the loss at the end; returns the loss.
    fn pass(stages: &mut [&mut Stage]) -> f64 {
        let (x, y) = batch();
        let p = Pass {
            train: true,
            seed: 1,
            step: 0,
            row_offset: 0,
        };
        let mut h = x;
        for s in stages.iter_mut() {
            h = s.forward(0, &h, 2, &p).unwrap().to_vec();
        }
        let mut dy = vec![0.0; h.len()];
        let loss = softmax_cross_entropy(&h, &y, VOCAB, 0.1, &mut dy).unwrap();
        for s in stages.iter_mut().rev() {
            if let Some(dx) = s.backward(0, &dy).unwrap() {
                dy = dx.to_vec();
            }
        }
        loss.loss_sum
    }

    #[test]
    fn the_tied_gradient_is_the_sum_of_both_uses_and_counts_once() {
        let (tied_layers, free_layers) = (gpt(true), gpt(false));
        assert_eq!(tied_layers.last().unwrap().tied_to, Some(0));
        let mut tied = Stage::new(&tied_layers, 0..4, 3, 1);
        let mut free = Stage::new(&free_layers, 0..4, 3, 1);
        // The tied stage starts with its head's weight equal to the table.
        let head = tied.param_ranges().nth(3).unwrap().1.start;
        let n = VOCAB * WIDTH;
        assert_eq!(tied.params()[..n], tied.params()[head..head + n]);
        free.params_mut().copy_from_slice(tied.params());
        let (a, b) = (pass(&mut [&mut tied]), pass(&mut [&mut free]));
        assert_eq!(a, b, "the same matrix gives the same loss");
        let want_norm = {
            let g = free.grads().to_vec();
            let mut sum = g.clone();
            for i in 0..n {
                sum[i] += g[head + i];
                sum[head + i] = 0.0;
            }
            let got = tied.grads();
            let worst = got
                .iter()
                .zip(&sum)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-6,
                "tied gradient differs from the sum by {worst}"
            );
            assert!(got[head..head + n].iter().all(|&g| g == 0.0));
            sum.iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>()
        };
        let norm = tied.grad_norm_squared();
        assert!(
            (norm - want_norm).abs() < 1e-9 * want_norm.max(1.0),
            "{norm} vs {want_norm}"
        );
        let mut opt = Optimizer::new(
            OptimizerConfig::AdamW {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                decay_embeddings: true,
            },
            tied.params().len(),
        );
        tied.step(&mut opt, 0.01);
        assert_eq!(tied.params()[..n], tied.params()[head..head + n]);
        // An import refreshes the mirror before the next pass reads it.
        tied.params_mut()[0] += 1.0;
        pass(&mut [&mut tied]);
        assert_eq!(tied.params()[0], tied.params()[head]);
    }

    #[test]
    fn split_over_two_stages_the_owner_moves_the_gradient_and_the_values() {
        let layers = gpt(true);
        let mut whole = Stage::new(&layers, 0..4, 9, 1);
        let (mut front, mut back) = (
            Stage::new(&layers, 0..2, 9, 1),
            Stage::new(&layers, 2..4, 9, 1),
        );
        assert_eq!(
            (front.tied_ends(), back.tied_ends()),
            ((true, false), (false, true))
        );
        // The owner of both makes the head's copy the table's at the start.
        let t = front.tied_source().unwrap().to_vec();
        back.set_tied_mirror(&t);
        let sgd = || OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let mut o = Optimizer::new(sgd(), whole.params().len());
        let (mut o0, mut o1) = (
            Optimizer::new(sgd(), front.params().len()),
            Optimizer::new(sgd(), back.params().len()),
        );
        for _ in 0..3 {
            pass(&mut [&mut whole]);
            whole.step(&mut o, 0.1);
            pass(&mut [&mut front, &mut back]);
            let g = back.take_tied_grad();
            front.add_tied_grad(&g);
            front.step(&mut o0, 0.1);
            back.step(&mut o1, 0.1);
            let t = front.tied_source().unwrap().to_vec();
            back.set_tied_mirror(&t);
        }
        let split: Vec<f32> = front
            .params()
            .iter()
            .chain(back.params())
            .copied()
            .collect();
        let worst = whole
            .params()
            .iter()
            .zip(&split)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "split tied training differs by {worst}");
    }

    #[test]
    fn tying_is_refused_where_the_head_is_not_the_tables_shape() {
        let mut spec = ModelSpec::preset("mlp", 10).unwrap();
        spec.tie_embeddings = true;
        let e = spec
            .build(&Shape::image(28, 28, 1), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not start with an embedding"), "{e}");
        let mut spec = ModelSpec::preset("gpt-nano", VOCAB).unwrap();
        spec.tie_embeddings = true;
        spec.layers.push(LayerSpec::Gelu);
        let e = spec
            .build_for(&Shape::flat(SEQ), &Shape(vec![SEQ, VOCAB]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the last layer is gelu"), "{e}");
        let cut = crate::layers::cut_linear(&gpt(true), 3, 4)
            .unwrap_err()
            .to_string();
        assert!(cut.contains("tied"), "{cut}");
    }
}
