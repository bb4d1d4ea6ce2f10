//! `ringtmp export`: a checkpoint written out for another framework — PyTorch's names and
//! layouts with a `model.py` that rebuilds the module (and, for a language model, what it reads:
//! see `language`), or nanoGPT's `ckpt.pt` (see `nanogpt`).

use std::fmt::Write as _;

use anyhow::Result;
use ringtmp_model::{Layer, LayerKind, checkpoint, interop};

use crate::error::UsageError;

use super::language;
use super::nanogpt;
use super::opened::{Opened, open};
use super::request::{ExportArgs, check_export_dir};

/// `ringtmp export --to pytorch`.
pub fn export_pytorch(a: &ExportArgs) -> Result<()> {
    check_export_dir(
        &a.out,
        &[
            "model.safetensors",
            "model.py",
            "recipe.json",
            "tokenizer.json",
        ],
        a.overwrite,
    )?;
    let opened = open(&a.checkpoint, 1)?;
    let language = language::Language::of(&opened, a.tokenizer.as_deref())?;
    let tensors = interop::to_pytorch(&opened.layers, opened.stage.params());
    let weights = a.out.join("model.safetensors");
    let architecture = language
        .as_ref()
        .and_then(|l| l.architecture(&opened))
        .map(|a| a.to_metadata())
        .unwrap_or_default();
    let mut metadata = vec![("format", "pt")];
    metadata.extend(architecture.iter().map(|(k, v)| (*k, v.as_str())));
    interop::write_safetensors(&weights, &tensors, &metadata)?;
    let mut code = model_py(&opened)?;
    let mut written = vec!["model.safetensors", "model.py"];
    let recipe = match (&language, &opened.recipe) {
        (Some(l), _) => {
            code.push_str(&l.python()?);
            written.extend(l.write_files(&a.out)?);
            Some(l.recipe(&opened))
        }
        (None, Some(r)) => Some(serde_json::to_value(r)?),
        (None, None) => None,
    };
    checkpoint::write_atomic(&a.out.join("model.py"), code.as_bytes())?;
    if let Some(recipe) = recipe {
        let text = serde_json::to_string_pretty(&recipe)?;
        checkpoint::write_atomic(&a.out.join("recipe.json"), text.as_bytes())?;
        written.push("recipe.json");
    }
    eprintln!(
        "export: {} ({} parameters in {} tensors) from {} step {} ({}) to {}: {}",
        opened.manifest.model.name,
        opened.stage.params().len(),
        tensors.len(),
        opened.manifest.strategy,
        opened.manifest.step,
        opened.dir.display(),
        a.out.display(),
        written.join(", ")
    );
    eprintln!(
        "load it: import model, safetensors.torch as st; m = model.build(); \
         m.load_state_dict(st.load_file(\"{}\"))",
        weights.display()
    );
    Ok(())
}

/// `ringtmp export --to nanogpt`.
pub fn export_nanogpt(a: &ExportArgs) -> Result<()> {
    if let Some(t) = &a.tokenizer {
        return Err(UsageError(format!(
            "--tokenizer {}: nanoGPT reads a character vocabulary from meta.pkl, and GPT-2's \
             encoding without one; export --to pytorch carries a tokenizer",
            t.display()
        ))
        .into());
    }
    let opened = open(&a.checkpoint, 1)?;
    // Every refusal before the output directory is made.
    let prepared = nanogpt::prepare(&opened)?;
    check_export_dir(&a.out, &nanogpt::FILES, a.overwrite)?;
    let written = prepared.write(&a.out)?;
    eprintln!(
        "export: {} ({} parameters) from {} step {} ({}) to {}: {}",
        opened.manifest.model.name,
        opened.stage.params().len(),
        opened.manifest.strategy,
        opened.manifest.step,
        opened.dir.display(),
        a.out.display(),
        written.join(", ")
    );
    Ok(())
}

/// The Python module expression of one layer.
fn module_of(layer: &Layer) -> Result<String> {
    Ok(match &layer.kind {
        LayerKind::Linear(l) if l.bias => {
            format!("nn.Linear({}, {})", l.in_features, l.out_features)
        }
        LayerKind::Linear(l) => format!(
            "nn.Linear({}, {}, bias=False)",
            l.in_features, l.out_features
        ),
        LayerKind::Conv2d(c) => format!(
            "nn.Conv2d({}, {}, {}, stride={}, padding={})",
            c.in_channels, c.out_channels, c.kernel, c.stride, c.padding
        ),
        LayerKind::MaxPool2d(p) => format!("nn.MaxPool2d({}, stride={})", p.kernel, p.stride),
        LayerKind::Relu => "nn.ReLU()".into(),
        LayerKind::Gelu => "nn.GELU(approximate=\"tanh\")".into(),
        LayerKind::Flatten => "nn.Flatten()".into(),
        LayerKind::Dropout(d) => format!("nn.Dropout({})", d.p),
        LayerKind::Norm(n) => match n.kind {
            ringtmp_model::layers::NormKind::Layer => {
                format!("nn.LayerNorm({}, eps={:e})", n.features, n.eps)
            }
            ringtmp_model::layers::NormKind::Rms => {
                format!("nn.RMSNorm({}, eps={:e})", n.features, n.eps)
            }
        },
        LayerKind::Embedding(e) => format!("Embedding({}, {}, {})", e.vocab, e.width, e.seq),
        LayerKind::CausalSelfAttention(a) => {
            format!("CausalSelfAttention({}, {})", a.width, a.heads)
        }
        LayerKind::Block(b) => {
            format!("Block({}, {}, {})", b.width, b.heads, b.width * b.mlp_ratio)
        }
        LayerKind::LinearHead(_) | LayerKind::LinearTail(_) => {
            anyhow::bail!("a whole model has no cut layers")
        }
        LayerKind::LlamaBlock(_) => {
            anyhow::bail!("a Llama-family model is exported as a Hugging Face directory")
        }
    })
}

/// The Python classes a language model's modules need, with ringtmp's parameter names
/// (nanoGPT's) and computations (GELU in its tanh form, causal attention, pre-norm blocks).
const TRANSFORMER_MODULES: &str = r#"

class Embedding(nn.Module):
    """Token and learned position embeddings: [batch, seq] ids to [batch, seq, width]."""

    def __init__(self, vocab, width, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        split = lambda z: z.view(n, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, c))


class Mlp(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, width, heads, hidden):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-5)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5)
        self.mlp = Mlp(width, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
"#;

/// The `model.py` of an opened checkpoint.
fn model_py(opened: &Opened) -> Result<String> {
    let m = &opened.manifest;
    let modules: Vec<String> = opened.layers.iter().map(module_of).collect::<Result<_>>()?;
    let transformer = opened.layers.iter().any(|l| {
        matches!(
            l.kind,
            LayerKind::Embedding(_) | LayerKind::Block(_) | LayerKind::CausalSelfAttention(_)
        )
    });
    let mut py = String::new();
    writeln!(
        py,
        "\"\"\"The ringtmp model {:?} as a PyTorch module (`ringtmp export`, from {} step {}).\n\n\
         Its weights are model.safetensors, under nn.Sequential's names:\n\n    \
         import safetensors.torch, model\n    \
         m = model.build()\n    \
         m.load_state_dict(safetensors.torch.load_file(\"model.safetensors\"))\n    \
         m.eval()\n\n\
         The module takes images channels first ([N, C, H, W]) as PyTorch does, tables as\n\
         [N, columns], token ids as [N, seq]; `preprocess` turns raw values (as the training\n\
         files stored them) into what it was trained on.\n\"\"\"",
        m.model.name, m.strategy, m.step
    )?;
    py.push_str("import torch\nfrom torch import nn\n");
    if transformer {
        py.push_str("from torch.nn import functional as F\n");
    }
    if let Some(r) = &opened.recipe {
        let n = &r.normalisation;
        let list = |v: &[f32]| {
            v.iter()
                .map(|x| format!("{x:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (h, w, c) = r.shape;
        writeln!(py)?;
        if h * w == 1 {
            writeln!(py, "INPUT_SHAPE = ({c},)  # table columns")?;
            writeln!(py, "COLUMNS = {:?}", r.columns)?;
        } else {
            writeln!(
                py,
                "INPUT_SHAPE = ({c}, {h}, {w})  # channels, height, width"
            )?;
        }
        writeln!(py, "SCALE = {:?}", n.scale)?;
        writeln!(py, "MEAN = [{}]", list(&n.mean))?;
        writeln!(py, "STD = [{}]", list(&n.std))?;
        writeln!(py, "CLASSES = {:?}", r.class_names)?;
        writeln!(py, "TARGETS = {:?}", r.targets)?;
        let stats = &r.target_standardisation;
        writeln!(
            py,
            "TARGET_MEAN = [{}]",
            list(&stats.iter().map(|s| s.0).collect::<Vec<_>>())
        )?;
        writeln!(
            py,
            "TARGET_STD = [{}]",
            list(&stats.iter().map(|s| s.1).collect::<Vec<_>>())
        )?;
        py.push_str(
            r#"

def preprocess(x):
    """Raw inputs ([N, C, H, W] images or [N, columns] tables, as stored) to the model's."""
    x = torch.as_tensor(x, dtype=torch.float32) * SCALE
    view = (1, -1, 1, 1) if x.dim() == 4 else (1, -1)
    return (x - torch.tensor(MEAN).view(view)) / torch.tensor(STD).view(view)


def to_targets(outputs):
    """A regression's outputs in the targets' own units (classifiers: unchanged)."""
    if not TARGET_MEAN:
        return outputs
    return outputs * torch.tensor(TARGET_STD) + torch.tensor(TARGET_MEAN)
"#,
        );
    }
    if transformer {
        py.push_str(TRANSFORMER_MODULES);
    }
    py.push_str("\n\ndef build():\n    \"\"\"The module, untrained (load model.safetensors into it).\"\"\"\n    model = nn.Sequential(\n");
    for (i, module) in modules.iter().enumerate() {
        writeln!(
            py,
            "        {module},  # {i}: {}",
            opened.layers[i].kind_name()
        )?;
    }
    py.push_str("    )\n");
    if let Some(head) = opened.layers.iter().find(|l| l.tied_to.is_some()) {
        writeln!(
            py,
            "    # Weight tying: the head's weight is the token embedding's table.\n    \
             model[{}].weight = model[{}].wte.weight",
            head.index,
            head.tied_to.unwrap_or(0)
        )?;
    }
    py.push_str("    return model\n");
    Ok(py)
}
