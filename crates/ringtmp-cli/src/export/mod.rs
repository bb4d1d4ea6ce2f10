//! `ringtmp export --to pytorch` and `ringtmp predict`: a checkpoint of any strategy, whatever
//! its partition, opened as one whole model — written out with PyTorch's names and layouts and
//! a `model.py` that rebuilds the module, or run on a user's inputs read as training read them
//! (the run's input recipe: columns, layout, image size, normalisation, class names).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ringtmp_data::{InputRecipe, Labels};
use ringtmp_model::loss::Objective;
use ringtmp_model::{Layer, LayerKind, Shape, Stage, checkpoint, interop};

use crate::error::UsageError;

mod eval;
mod language;
mod nanogpt;
mod torch_file;

pub use eval::{EvalArgs, eval};

/// `ringtmp export` options.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// A checkpoint directory, or a run directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The framework to write for: pytorch (model.safetensors, model.py, recipe.json), or
    /// nanogpt (nanoGPT's ckpt.pt and, for characters, meta.pkl).
    #[arg(long, value_name = "FRAMEWORK", default_value = "pytorch")]
    pub to: String,
    /// Directory to write the files into (new or without an earlier export's, unless
    /// --overwrite).
    #[arg(value_name = "OUT")]
    pub out: PathBuf,
    /// Replace the files of an earlier export in OUT.
    #[arg(long)]
    pub overwrite: bool,
    /// The tokenizer.json a language model was trained with: copied beside the weights for
    /// model.py's encode and decode (checked to be the run's).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

/// Refuses an output that is a file, or a directory holding files an export would replace
/// (unless `overwrite`), or that cannot be written: bad input, before anything is computed.
fn check_export_dir(out: &Path, files: &[&str], overwrite: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(UsageError(format!("{}: is a file, not a directory", out.display())).into());
    }
    if !overwrite {
        let taken: Vec<&str> = files
            .iter()
            .copied()
            .filter(|f| out.join(f).exists())
            .collect();
        if !taken.is_empty() {
            return Err(UsageError(format!(
                "{} already holds {}: pass --overwrite to replace them, or export elsewhere",
                out.display(),
                taken.join(", ")
            ))
            .into());
        }
    }
    std::fs::create_dir_all(out)
        .map_err(|e| UsageError(format!("cannot create {}: {e}", out.display())))?;
    let probe = out.join(".ringtmp-export-probe");
    std::fs::write(&probe, b"")
        .map_err(|e| UsageError(format!("cannot write into {}: {e}", out.display())))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// `ringtmp predict` options.
#[derive(clap::Args)]
pub struct PredictArgs {
    /// A checkpoint directory, or a run directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The inputs: a .csv table with the training columns, an .npy/.npz array, a PNG/JPEG image
    /// or a folder of them [default: the bundled dataset's test split, for a model trained on
    /// one].
    #[arg(long, value_name = "FILE")]
    pub data_file: Option<PathBuf>,
    /// Predict for the first N rows only.
    #[arg(long, value_name = "N", value_parser = crate::args::at_least_one)]
    pub limit: Option<usize>,
    /// Write the outputs as an .npy array `[rows, outputs]`: class logits, or regression
    /// predictions in the targets' units.
    #[arg(long, value_name = "OUT.npy")]
    pub logits: Option<PathBuf>,
    /// Write one line per row: its source, the prediction (a class's name, or each target), and
    /// for classes the predicted class's probability.
    #[arg(long, value_name = "OUT.csv")]
    pub csv: Option<PathBuf>,
    /// Compute threads [default: all cores].
    #[arg(long, value_parser = crate::args::at_least_one)]
    pub threads: Option<usize>,
}

/// A checkpoint opened as one whole model.
pub struct Opened {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: checkpoint::Manifest,
    /// How the run read its inputs (`None` for checkpoints of language models).
    pub recipe: Option<InputRecipe>,
    /// Every layer of the model.
    pub layers: Vec<Layer>,
    /// The model with the checkpoint's parameters.
    pub stage: Stage,
}

/// The input recipe of a checkpoint written before runs stored theirs: the bundled datasets'.
fn bundled_recipe(dataset: &str) -> Option<InputRecipe> {
    let data = ringtmp_data::load(dataset, None).ok()?;
    Some(data.recipe)
}

/// The checkpoint whose weights `path` means ([`checkpoint::resolve_weights`]: a run's best
/// evaluation's, when it kept one); says so on stderr when that is not the run's last.
pub fn weights_dir(path: &Path) -> Result<std::path::PathBuf> {
    let dir = checkpoint::resolve_weights(path).map_err(|e| UsageError(e.to_string()))?;
    if let Ok(latest) = checkpoint::resolve(path)
        && latest != dir
    {
        eprintln!(
            "using the best evaluation's checkpoint {} (the run's last is {}; name it to use it)",
            dir.display(),
            latest.display()
        );
    }
    Ok(dir)
}

/// Opens the checkpoint `path` means (verifying every file) as one model on `threads` threads.
pub fn open(path: &Path, threads: usize) -> Result<Opened> {
    let dir = weights_dir(path)?;
    let manifest = checkpoint::verify(&dir)?;
    let recipe: Option<InputRecipe> = match &manifest.recipe {
        _ if manifest.model.reads_tokens() => None,
        Some(value) => Some(
            serde_json::from_value(value.clone())
                .with_context(|| format!("{}: the manifest's input recipe", dir.display()))?,
        ),
        None => Some(bundled_recipe(&manifest.dataset).ok_or_else(|| {
            UsageError(format!(
                "{}: the checkpoint does not record its input shape (dataset {:?})",
                dir.display(),
                manifest.dataset
            ))
        })?),
    };
    let outputs = match manifest.model.layers.last() {
        Some(ringtmp_model::LayerSpec::Linear { out }) => *out,
        _ => {
            return Err(UsageError(format!(
                "{}: model {} does not end in a linear layer",
                dir.display(),
                manifest.model.name
            ))
            .into());
        }
    };
    let (input, output) = match (&recipe, checkpoint::context_of(&dir, &manifest)?) {
        (Some(r), _) if !manifest.model.reads_tokens() => {
            let (h, w, c) = r.shape;
            (Shape::image(h, w, c), Shape::flat(outputs))
        }
        (_, Some(ctx)) => (Shape::flat(ctx), Shape(vec![ctx, outputs])),
        _ => {
            return Err(UsageError(format!(
                "{}: cannot tell the model's input shape",
                dir.display()
            ))
            .into());
        }
    };
    let layers = manifest.model.build_for(&input, &output)?;
    let mut stage = Stage::new(&layers, 0..layers.len(), manifest.seed, threads);
    checkpoint::read_params(&dir, &manifest, &mut stage)?;
    Ok(Opened {
        dir,
        manifest,
        recipe,
        layers,
        stage,
    })
}

fn threads(requested: Option<usize>) -> usize {
    requested.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `ringtmp export`.
pub fn export(a: &ExportArgs) -> Result<()> {
    match a.to.as_str() {
        "pytorch" => {}
        "nanogpt" => return export_nanogpt(a),
        other => {
            return Err(UsageError(format!(
                "--to {other:?}: ringtmp exports to pytorch or nanogpt"
            ))
            .into());
        }
    }
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
fn export_nanogpt(a: &ExportArgs) -> Result<()> {
    if let Some(t) = &a.tokenizer {
        return Err(UsageError(format!(
            "--tokenizer {}: nanoGPT reads a character vocabulary from meta.pkl, and GPT-2's \
             encoding without one; export --to pytorch carries a tokenizer",
            t.display()
        ))
        .into());
    }
    check_export_dir(&a.out, &nanogpt::FILES, a.overwrite)?;
    let opened = open(&a.checkpoint, 1)?;
    let written = nanogpt::export(&opened, &a.out)?;
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
        LayerKind::Linear(l) => format!("nn.Linear({}, {})", l.in_features, l.out_features),
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
                format!("nn.LayerNorm({}, eps={EPS})", n.features)
            }
            ringtmp_model::layers::NormKind::Rms => {
                format!("nn.RMSNorm({}, eps={EPS})", n.features)
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
    })
}

const EPS: &str = "1e-5";

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

/// `ringtmp predict`.
pub fn predict(a: &PredictArgs) -> Result<()> {
    if a.logits.is_none() && a.csv.is_none() {
        return Err(UsageError(
            "predict writes --logits OUT.npy or --csv OUT.csv (or both); name one".into(),
        )
        .into());
    }
    let threads = threads(a.threads);
    crate::plan::init_threads(threads)?;
    let mut opened = open(&a.checkpoint, threads)?;
    let Some(recipe) = opened.recipe.clone() else {
        return predict_tokens(a, &mut opened);
    };
    let run = outputs_of(&mut opened, &recipe, a.data_file.as_deref(), a.limit)?;
    if let Some(path) = &a.logits {
        ringtmp_data::npy::write_f32(path, &[run.inputs.rows, run.width], &run.values)?;
    }
    if let Some(path) = &a.csv {
        write_csv(
            path,
            &recipe,
            &run.inputs.names,
            &run.values,
            run.width,
            run.regression,
        )?;
    }
    let score = score_of(&run)
        .map(|s| format!("; {} against the inputs' labels", s.line()))
        .unwrap_or_default();
    eprintln!(
        "predict: {} rows with {} from {} step {}{score}",
        run.inputs.rows, opened.manifest.model.name, opened.manifest.strategy, opened.manifest.step
    );
    Ok(())
}

/// A model's outputs for a set of inputs.
struct Outputs {
    inputs: ringtmp_data::Inputs,
    /// `[rows, width]`: class logits, or regression predictions in the targets' units.
    values: Vec<f32>,
    width: usize,
    regression: bool,
}

/// The opened checkpoint's outputs for `data_file` (read as `recipe` says) or the bundled test
/// split.
fn outputs_of(
    opened: &mut Opened,
    recipe: &InputRecipe,
    data_file: Option<&Path>,
    limit: Option<usize>,
) -> Result<Outputs> {
    let inputs = match data_file {
        Some(path) => ringtmp_data::read_inputs(recipe, path, limit)?,
        None => test_split(opened, limit)?,
    };
    let outputs = inputs_outputs(&mut opened.stage, &inputs.x, inputs.rows)?;
    let width = outputs.len() / inputs.rows.max(1);
    let regression = opened.manifest.objective == Objective::MeanSquared;
    // Regression outputs in the targets' units.
    let values: Vec<f32> = if regression && !recipe.target_standardisation.is_empty() {
        outputs
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let (mean, std) = recipe.target_standardisation[i % width];
                o * std + mean
            })
            .collect()
    } else {
        outputs
    };
    Ok(Outputs {
        inputs,
        values,
        width,
        regression,
    })
}

/// A language model's logits for windows of token ids (an `.npy` of integers `[rows, seq]`):
/// `[rows, seq, vocabulary]`. Text is continued by `ringtmp generate`.
fn predict_tokens(a: &PredictArgs, opened: &mut Opened) -> Result<()> {
    let (Some(path), Some(out)) = (&a.data_file, &a.logits) else {
        return Err(UsageError(
            "a language model predicts the next token's logits for an .npy of token ids \
             [rows, seq] (--data-file IDS.npy --logits OUT.npy); `ringtmp generate` continues text"
                .into(),
        )
        .into());
    };
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    let header = ringtmp_data::npy::parse_header(path, &bytes)?;
    let seq = opened.layers[0].input.numel();
    let vocab = opened.layers.last().map_or(0, |l| l.output.numel() / seq);
    let ids = ringtmp_data::npy::values_f64(&header, &bytes);
    let bad = |why: String| UsageError(format!("{}: {why}", path.display()));
    if header.kind.is_float() || header.shape.len() != 2 || header.shape[1] != seq {
        return Err(bad(format!(
            "shape {:?} of {}: token ids are integers [rows, {seq}]",
            header.shape, header.descr
        ))
        .into());
    }
    if let Some(id) = ids.iter().find(|&&v| v < 0.0 || v >= vocab as f64) {
        return Err(bad(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))
        .into());
    }
    let rows = header.shape[0].min(a.limit.unwrap_or(usize::MAX));
    let x: Vec<f32> = ids[..rows * seq].iter().map(|&v| v as f32).collect();
    let logits = inputs_outputs(&mut opened.stage, &x, rows)?;
    ringtmp_data::npy::write_f32(out, &[rows, seq, vocab], &logits)?;
    eprintln!(
        "predict: next-token logits for {rows} windows of {seq} with {} from {} step {}",
        opened.manifest.model.name, opened.manifest.strategy, opened.manifest.step
    );
    Ok(())
}

/// The run's own test split (a bundled dataset), read raw and normalised as the recipe says.
fn test_split(opened: &Opened, limit: Option<usize>) -> Result<ringtmp_data::Inputs> {
    let name = &opened.manifest.dataset;
    if !ringtmp_data::DATASETS.contains(&name.as_str()) {
        return Err(UsageError(format!(
            "the model was trained on your own {name} data: name the inputs with --data-file"
        ))
        .into());
    }
    let data = ringtmp_data::load(name, None)?;
    let rows = data.test.len().min(limit.unwrap_or(usize::MAX));
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.test.gather_range(0, rows, &mut x, &mut y);
    Ok(ringtmp_data::Inputs {
        x,
        rows,
        labels: Some(Labels::Classes(y)),
        names: (0..rows).map(|r| format!("{name}-test[{r}]")).collect(),
    })
}

/// The model's outputs for `rows` inputs, in passes of at most 256 rows.
fn inputs_outputs(stage: &mut Stage, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    const ROWS: usize = 256;
    let features = x.len() / rows.max(1);
    let mut out = Vec::new();
    for start in (0..rows).step_by(ROWS) {
        let end = (start + ROWS).min(rows);
        out.extend_from_slice(stage.infer(&x[start * features..end * features], end - start)?);
    }
    Ok(out)
}

fn write_csv(
    path: &Path,
    recipe: &InputRecipe,
    names: &[String],
    values: &[f32],
    width: usize,
    regression: bool,
) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| path.display().to_string())?;
    if regression {
        let targets: Vec<String> = if recipe.targets.len() == width {
            recipe.targets.clone()
        } else {
            (0..width).map(|i| format!("target{i}")).collect()
        };
        w.write_record(std::iter::once("source".to_string()).chain(targets))?;
        for (name, row) in names.iter().zip(values.chunks_exact(width)) {
            w.write_record(std::iter::once(name.clone()).chain(row.iter().map(|v| v.to_string())))?;
        }
    } else {
        w.write_record(["source", "predicted", "probability"])?;
        for (name, row) in names.iter().zip(values.chunks_exact(width)) {
            let best = ringtmp_model::loss::argmax(row).0;
            let max = row[best];
            let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
            let class = recipe
                .class_names
                .get(best)
                .cloned()
                .unwrap_or_else(|| best.to_string());
            w.write_record([name.clone(), class, format!("{:.6}", 1.0 / sum)])?;
        }
    }
    w.flush()?;
    Ok(())
}

/// How well outputs match their inputs' labels.
enum Score {
    /// Classes: the share predicted right.
    Accuracy(f64),
    /// A regression, over every target: R² (1 − residual / total sum of squares), and the
    /// root mean squared and mean absolute errors in the targets' units.
    Regression { r2: f64, rmse: f64, mae: f64 },
}

impl Score {
    fn line(&self) -> String {
        match self {
            Self::Accuracy(a) => format!("accuracy {:.2}%", 100.0 * a),
            Self::Regression { r2, rmse, mae } => {
                format!("R² {r2:.4}, RMSE {rmse:.4}, MAE {mae:.4}")
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        match self {
            Self::Accuracy(a) => serde_json::json!({"accuracy": a}),
            Self::Regression { r2, rmse, mae } => {
                serde_json::json!({"r2": r2, "rmse": rmse, "mae": mae})
            }
        }
    }
}

/// The score of `run` against its inputs' labels, if they have any of the model's kind.
fn score_of(run: &Outputs) -> Option<Score> {
    match (run.inputs.labels.as_ref()?, run.regression) {
        (Labels::Classes(c), false) => {
            let right = run
                .values
                .chunks_exact(run.width)
                .zip(c)
                .filter(|(row, l)| ringtmp_model::loss::argmax(row).0 == **l as usize)
                .count();
            Some(Score::Accuracy(right as f64 / c.len().max(1) as f64))
        }
        (Labels::Targets { values: t, .. }, true) => {
            let n = t.len().max(1) as f64;
            // Each target's own mean: R² over several targets sums their squares.
            let width = run.width.max(1);
            let mut means = vec![0.0f64; width];
            for (i, &y) in t.iter().enumerate() {
                means[i % width] += f64::from(y);
            }
            let per_target = (t.len() / width).max(1) as f64;
            means.iter_mut().for_each(|m| *m /= per_target);
            let (mut sq, mut abs, mut total) = (0.0, 0.0, 0.0);
            for (i, (&p, &y)) in run.values.iter().zip(t).enumerate() {
                let e = f64::from(p - y);
                sq += e * e;
                abs += e.abs();
                total += (f64::from(y) - means[i % width]).powi(2);
            }
            Some(Score::Regression {
                r2: 1.0 - sq / total.max(f64::MIN_POSITIVE),
                rmse: (sq / n).sqrt(),
                mae: abs / n,
            })
        }
        _ => None,
    }
}
