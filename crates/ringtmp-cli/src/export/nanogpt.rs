//! `ringtmp export --to nanogpt`: a GPT as nanoGPT's `ckpt.pt` — its `GPT` module's state
//! dict, `model_args`, `iter_num`, and an AdamW state of no steps grouped as nanoGPT's
//! `configure_optimizers` groups its parameters, so both `sample.py` and `train.py
//! --init_from=resume` take it — and, for a character model, `meta.pkl` (`stoi`, `itos`), which
//! `sample.py` reads from `data/<dataset>/`.
//!
//! nanoGPT's `GPT` is an embedding, blocks of MLP ratio 4 with LayerNorms and biases, a final
//! LayerNorm and a head tied to the token embedding without a bias. A model of another shape,
//! or with an untied head, is refused naming what differs. The head's bias has no place of its
//! own there, but the final LayerNorm's bias `β` feeds the head through the tied table `W`:
//! adding `δ` with `W δ = b + c·1` moves every logit by the bias and one constant `c`, which the
//! softmax does not see. `δ` exists when the vocabulary is at most the width + 1 (character
//! models); the export solves for it (minimum norm, in f64), measures the spread of what is
//! left on the logits after rounding to f32, and refuses a head whose bias it cannot carry.
//!
//! One difference stays: nanoGPT's MLP computes GELU exactly (erf), ringtmp its tanh form, as
//! GPT-2 does. `benches/reference/nanogpt_export.py` measures what that moves.

use std::path::Path;

use anyhow::Result;
use ringtmp_data::Vocabulary;
use ringtmp_model::arch::Architecture;
use ringtmp_model::interop::{self, Tensor};
use ringtmp_model::{LayerKind, OptimizerConfig};

use super::opened::Opened;
use super::torch_file::{self, Py};
use crate::error::UsageError;

/// The files an export to nanoGPT may write.
pub const FILES: [&str; 2] = ["ckpt.pt", "meta.pkl"];

/// The dataset name `ckpt.pt` gives, under which nanoGPT's sample.py looks for `meta.pkl`.
const DATASET: &str = "ringtmp";

/// Largest spread, in logits, that carrying the head's bias in `ln_f.bias` may leave: far
/// below what sampling or the loss notice (a log-probability moves by at most the spread).
const MAX_SPREAD: f64 = 1e-4;

fn refuse(opened: &Opened, why: String) -> anyhow::Error {
    UsageError(format!(
        "--to nanogpt: model {} {why}; `--to pytorch` exports any model",
        opened.manifest.model.name
    ))
    .into()
}

/// What an export to nanoGPT writes, checked and converted before anything is written.
pub struct Prepared {
    /// The object `ckpt.pt` holds.
    checkpoint: Py,
    /// `meta.pkl`'s bytes, for a character model.
    meta: Option<Vec<u8>>,
}

/// Checks that nanoGPT's `GPT` can hold the opened model and converts it (the head's bias
/// moved into the final LayerNorm's); every refusal names why.
pub fn prepare(opened: &Opened) -> Result<Prepared> {
    let arch = Architecture::of(
        &opened.manifest.model,
        opened.layers.first().map(|l| l.input.numel()),
    )
    .ok_or_else(|| refuse(opened, "has no attention: it is not a GPT".into()))?;
    let (mut tensors, head_bias) = interop::to_nanogpt(&opened.layers, opened.stage.params())
        .map_err(|e| refuse(opened, format!("does not fit nanoGPT's GPT ({e})")))?;
    check_shape(opened, &arch)?;
    carry_head_bias(opened, &mut tensors, &head_bias)?;
    let checkpoint = checkpoint_value(opened, &arch, tensors);
    let meta = match opened.manifest.vocabulary.as_deref() {
        Some(line) => match Vocabulary::from_line(line, "the manifest")? {
            Vocabulary::Chars(chars) => Some(meta_pickle(&chars)),
            _ => None,
        },
        None => None,
    };
    Ok(Prepared { checkpoint, meta })
}

/// nanoGPT's `meta.pkl` for a character vocabulary: `vocab_size`, `itos`, `stoi`.
fn meta_pickle(chars: &[char]) -> Vec<u8> {
    let itos = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (Py::Int(i as i64), Py::Str(c.to_string())))
        .collect();
    let stoi = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (Py::Str(c.to_string()), Py::Int(i as i64)))
        .collect();
    torch_file::pickle(&Py::Dict(vec![
        (Py::str("vocab_size"), Py::Int(chars.len() as i64)),
        (Py::str("itos"), Py::Dict(itos)),
        (Py::str("stoi"), Py::Dict(stoi)),
    ]))
}

impl Prepared {
    /// Writes `ckpt.pt` (and `meta.pkl` for characters) into `out`; the files written.
    pub fn write(self, out: &Path) -> Result<Vec<&'static str>> {
        torch_file::save(&out.join("ckpt.pt"), &self.checkpoint)?;
        let mut written = vec!["ckpt.pt"];
        if let Some(meta) = &self.meta {
            ringtmp_model::checkpoint::write_atomic(&out.join("meta.pkl"), meta)?;
            written.push("meta.pkl");
        }
        eprintln!(
            "nanoGPT: cp {} data/{DATASET}/ in nanoGPT's directory, then `python sample.py \
             --init_from=resume --out_dir={}` (or train.py --init_from=resume to go on training)",
            out.join("meta.pkl").display(),
            out.display()
        );
        Ok(written)
    }
}

/// Refuses what nanoGPT's blocks cannot compute: another MLP ratio, blocks of different head
/// counts, RMSNorm, an untied head.
fn check_shape(opened: &Opened, arch: &Architecture) -> Result<()> {
    if arch.heads.is_none() {
        return Err(refuse(
            opened,
            "has blocks of different head counts; nanoGPT's have one".into(),
        ));
    }
    if arch.mlp_ratio != Some(4) {
        return Err(refuse(
            opened,
            format!(
                "has an MLP ratio of {}; nanoGPT's is 4",
                arch.mlp_ratio.map_or("several".into(), |r| r.to_string())
            ),
        ));
    }
    let norms_are_layer_norms = opened.layers.iter().all(|l| match &l.kind {
        LayerKind::Norm(n) => n.kind == ringtmp_model::layers::NormKind::Layer,
        _ => true,
    });
    if !norms_are_layer_norms {
        return Err(refuse(
            opened,
            "uses RMSNorm; nanoGPT's norms are LayerNorms".into(),
        ));
    }
    if opened.layers.last().and_then(|l| l.tied_to).is_none() {
        return Err(refuse(
            opened,
            "has its own head; nanoGPT ties its head to the token embedding (train with \
             --tie-embeddings)"
                .into(),
        ));
    }
    Ok(())
}

fn tensor_mut<'a>(tensors: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    tensors
        .iter_mut()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("nanoGPT's names include {name}"))
}

/// Moves the head's bias into `transformer.ln_f.bias` (see the module's header), or refuses.
fn carry_head_bias(opened: &Opened, tensors: &mut [Tensor], bias: &[f32]) -> Result<()> {
    if bias.iter().all(|&b| b == 0.0) {
        return Ok(());
    }
    let table = tensor_mut(tensors, "lm_head.weight").values.clone();
    let vocab = bias.len();
    let width = table.len() / vocab.max(1);
    if vocab > width + 1 {
        return Err(refuse(
            opened,
            format!(
                "has a head bias nanoGPT's biasless head cannot carry: its vocabulary of \
                 {vocab} is more than its width {width} + 1 (the final LayerNorm's bias carries \
                 it only then)"
            ),
        ));
    }
    let delta = solve_shift(&table, bias, width).ok_or_else(|| {
        refuse(
            opened,
            "has a head bias its token table cannot carry (the table's rows are linearly \
             dependent)"
                .into(),
        )
    })?;
    let ln_f = tensor_mut(tensors, "transformer.ln_f.bias");
    let old = ln_f.values.clone();
    for (beta, d) in ln_f.values.iter_mut().zip(&delta) {
        *beta = (f64::from(*beta) + d) as f32;
    }
    // What the rounded β moves each logit by, against the bias it stands for.
    let moved: Vec<f64> = (0..vocab)
        .map(|v| {
            let row = &table[v * width..(v + 1) * width];
            let shift: f64 = row
                .iter()
                .zip(ln_f.values.iter().zip(&old))
                .map(|(&w, (&new, &was))| f64::from(w) * (f64::from(new) - f64::from(was)))
                .sum();
            shift - f64::from(bias[v])
        })
        .collect();
    let spread = moved.iter().cloned().fold(f64::MIN, f64::max)
        - moved.iter().cloned().fold(f64::MAX, f64::min);
    if spread > MAX_SPREAD {
        return Err(refuse(
            opened,
            format!(
                "has a head bias the final LayerNorm's bias carries only to within {spread:.2e} \
                 of a logit (at most {MAX_SPREAD:.0e} is exported)"
            ),
        ));
    }
    eprintln!(
        "nanoGPT's head has no bias: the head's bias is carried by transformer.ln_f.bias, to \
         within {spread:.1e} of a logit"
    );
    Ok(())
}

/// The minimum-norm `δ` (width values) with `W δ − c·1 = b` for some `c`, where `W` is the
/// `[vocab, width]` table: `z = Aᵀ y`, `(A Aᵀ) y = b` for `A = [W | −1]`, by Cholesky in f64.
/// `None` when `A Aᵀ` is not positive definite (dependent rows).
fn solve_shift(table: &[f32], bias: &[f32], width: usize) -> Option<Vec<f64>> {
    let v = bias.len();
    let row = |i: usize| &table[i * width..(i + 1) * width];
    // M = W Wᵀ + 1 1ᵀ, lower triangle.
    let mut m = vec![0.0f64; v * v];
    for i in 0..v {
        for j in 0..=i {
            let dot: f64 = row(i)
                .iter()
                .zip(row(j))
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            m[i * v + j] = dot + 1.0;
        }
    }
    // Cholesky: M = L Lᵀ in place.
    for j in 0..v {
        let mut d = m[j * v + j];
        for k in 0..j {
            d -= m[j * v + k] * m[j * v + k];
        }
        if d <= f64::EPSILON * m[j * v + j].abs().max(1.0) {
            return None;
        }
        let d = d.sqrt();
        m[j * v + j] = d;
        for i in j + 1..v {
            let mut s = m[i * v + j];
            for k in 0..j {
                s -= m[i * v + k] * m[j * v + k];
            }
            m[i * v + j] = s / d;
        }
    }
    let mut y: Vec<f64> = bias.iter().map(|&b| f64::from(b)).collect();
    for i in 0..v {
        for k in 0..i {
            y[i] -= m[i * v + k] * y[k];
        }
        y[i] /= m[i * v + i];
    }
    for i in (0..v).rev() {
        for k in i + 1..v {
            y[i] -= m[k * v + i] * y[k];
        }
        y[i] /= m[i * v + i];
    }
    let mut delta = vec![0.0f64; width];
    for (i, &yi) in y.iter().enumerate() {
        for (d, &w) in delta.iter_mut().zip(row(i)) {
            *d += f64::from(w) * yi;
        }
    }
    Some(delta)
}

/// The object `ckpt.pt` holds.
fn checkpoint_value(opened: &Opened, arch: &Architecture, tensors: Vec<Tensor>) -> Py {
    let int = |v: Option<usize>| Py::Int(v.unwrap_or(0) as i64);
    let model_args = Py::Dict(vec![
        (Py::str("n_layer"), int(arch.blocks)),
        (Py::str("n_head"), int(arch.heads)),
        (Py::str("n_embd"), int(arch.width)),
        (Py::str("block_size"), int(arch.context)),
        (Py::str("bias"), Py::Bool(true)),
        (Py::str("vocab_size"), int(arch.vocab)),
        (Py::str("dropout"), Py::Float(0.0)),
    ]);
    // nanoGPT's configure_optimizers: matrices decay, vectors do not, in named_parameters()
    // order, the tied head counted once (it is the embedding's parameter).
    let parameters: Vec<&Tensor> = tensors
        .iter()
        .filter(|t| t.name != "lm_head.weight")
        .collect();
    let decayed = parameters.iter().filter(|t| t.shape.len() >= 2).count();
    let (lr, beta1, beta2, eps, weight_decay) = match opened.manifest.optimizer {
        OptimizerConfig::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        }
        | OptimizerConfig::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => (
            opened.manifest.lr.unwrap_or(1e-3),
            beta1,
            beta2,
            eps,
            weight_decay,
        ),
        // nanoGPT trains with AdamW; its defaults where ringtmp trained with SGD.
        _ => (6e-4, 0.9, 0.95, 1e-8, 0.1),
    };
    let group = |ids: std::ops::Range<usize>, decay: f32| {
        Py::Dict(vec![
            (Py::str("lr"), Py::Float(f64::from(lr))),
            (
                Py::str("betas"),
                Py::Tuple(vec![
                    Py::Float(f64::from(beta1)),
                    Py::Float(f64::from(beta2)),
                ]),
            ),
            (Py::str("eps"), Py::Float(f64::from(eps))),
            (Py::str("weight_decay"), Py::Float(f64::from(decay))),
            (Py::str("amsgrad"), Py::Bool(false)),
            (Py::str("maximize"), Py::Bool(false)),
            (Py::str("foreach"), Py::None),
            (Py::str("capturable"), Py::Bool(false)),
            (Py::str("differentiable"), Py::Bool(false)),
            (Py::str("fused"), Py::None),
            (
                Py::str("params"),
                Py::List(ids.map(|i| Py::Int(i as i64)).collect()),
            ),
        ])
    };
    let optimizer = Py::Dict(vec![
        (Py::str("state"), Py::Dict(Vec::new())),
        (
            Py::str("param_groups"),
            Py::List(vec![
                group(0..decayed, weight_decay),
                group(decayed..parameters.len(), 0.0),
            ]),
        ),
    ]);
    let state_dict = Py::OrderedDict(
        tensors
            .into_iter()
            .map(|t| {
                (
                    Py::Str(t.name),
                    Py::Tensor {
                        shape: t.shape,
                        values: t.values,
                    },
                )
            })
            .collect(),
    );
    Py::Dict(vec![
        (Py::str("model"), state_dict),
        (Py::str("optimizer"), optimizer),
        (Py::str("model_args"), model_args),
        (Py::str("iter_num"), Py::Int(opened.manifest.step as i64)),
        // nanoGPT's own starting value: the first evaluation of a resumed run saves.
        (Py::str("best_val_loss"), Py::Float(1e9)),
        (
            Py::str("config"),
            Py::Dict(vec![(Py::str("dataset"), Py::str(DATASET))]),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shift_moves_every_logit_by_its_bias_and_one_constant() {
        let (vocab, width) = (9, 8);
        let table: Vec<f32> = (0..vocab * width)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let bias: Vec<f32> = (0..vocab).map(|i| (i as f32 - 4.0) * 0.3).collect();
        let delta = solve_shift(&table, &bias, width).unwrap();
        let moved: Vec<f64> = (0..vocab)
            .map(|v| {
                table[v * width..(v + 1) * width]
                    .iter()
                    .zip(&delta)
                    .map(|(&w, d)| f64::from(w) * d)
                    .sum::<f64>()
                    - f64::from(bias[v])
            })
            .collect();
        let c = moved[0];
        assert!(moved.iter().all(|m| (m - c).abs() < 1e-9), "{moved:?}");
    }

    #[test]
    fn dependent_rows_have_no_shift() {
        let table = vec![1.0f32, 2.0, 1.0, 2.0, 0.5, 0.5];
        assert!(solve_shift(&table, &[1.0, -1.0, 0.0], 2).is_none());
    }
}
