//! `ringtmp export --to gguf OUT.gguf [--dtype f32|f16|q8_0]`: a checkpoint of a Llama-family
//! model as a GGUF file (version 3) under llama.cpp's names and conventions — the rows of `q`
//! and `k` interleaved as its converter interleaves them, norms in F32, the matrices in the
//! type asked for (Q8_0 quantised as ggml's reference quantises) — with the architecture's
//! metadata and the run's tokenizer and chat template (a GGUF file's copied; a
//! `tokenizer.json` written as llama.cpp writes a byte-level BPE).

use anyhow::Result;
use ringtmp_model::LayerKind;
use ringtmp_model::layers::rope::{Rope, RopeScaling};
use ringtmp_pretrained::gguf::{Gguf, GgufWriter, TensorType, Value};

use super::opened::{Opened, open};
use super::request::ExportArgs;
use crate::error::UsageError;

/// `ringtmp export --to gguf`.
pub fn export_gguf(a: &ExportArgs) -> Result<()> {
    let kind = match a.dtype.as_deref().unwrap_or("f16") {
        "f32" => TensorType::F32,
        "f16" => TensorType::F16,
        "q8_0" => TensorType::Q8_0,
        other => {
            return Err(UsageError(format!(
                "--dtype {other:?}: a GGUF export writes f32, f16 or q8_0"
            ))
            .into());
        }
    };
    if a.out.is_dir() || (a.out.exists() && !a.overwrite) {
        return Err(UsageError(format!(
            "{}: exists (a GGUF export is one new file; --overwrite replaces a file)",
            a.out.display()
        ))
        .into());
    }
    let opened = open(&a.checkpoint, 1)?;
    let mut writer = GgufWriter::new();
    let (arch, count) = metadata(&opened, &mut writer)?;
    let tokenizer = copy_tokenizer(&opened, &mut writer)?;
    tensors(&opened, arch, kind, &mut writer)?;
    writer.write(&a.out)?;
    eprintln!(
        "export: {} ({} tensors, {}, {}) from {} step {} ({}) to {}",
        opened.manifest.model.name,
        count,
        kind.name(),
        tokenizer,
        opened.manifest.strategy,
        opened.manifest.step,
        opened.dir.display(),
        a.out.display()
    );
    Ok(())
}

fn uint(v: usize) -> Value {
    Value::U32(v as u32)
}

/// The architecture's metadata; returns its GGUF name and the number of tensors to come.
fn metadata(opened: &Opened, w: &mut GgufWriter) -> Result<(&'static str, usize)> {
    let layers = &opened.layers;
    let refuse = |why: &str| {
        UsageError(format!(
            "{}: --to gguf writes the Llama family (an embedding, Llama blocks, an RMSNorm and \
             a head): {why}",
            opened.dir.display()
        ))
    };
    let n = layers.len();
    let blocks: Vec<_> = layers
        .iter()
        .filter_map(|l| match &l.kind {
            LayerKind::LlamaBlock(b) => Some(b),
            _ => None,
        })
        .collect();
    let (Some(LayerKind::Embedding(e)), Some(LayerKind::Norm(norm)), Some(b)) = (
        layers.first().map(|l| &l.kind),
        layers.get(n.wrapping_sub(2)).map(|l| &l.kind),
        blocks.first(),
    ) else {
        return Err(refuse("its layers are not such a chain").into());
    };
    if blocks.len() + 3 != n || e.positions {
        return Err(refuse("its layers are not such a chain").into());
    }
    let arch = match (b.qkv_bias, b.qk_norm) {
        (false, false) => "llama",
        (true, false) => "qwen2",
        (false, true) => "qwen3",
        (true, true) => return Err(refuse("both q/k/v biases and q/k norms").into()),
    };
    let context = crate::pretrained::run_info(&opened.dir)
        .and_then(|v| v.context)
        .unwrap_or(b.seq);
    let key = |k: &str| format!("{arch}.{k}");
    let put = |w: &mut GgufWriter, k: String, v: Value| w.metadata(&k, v);
    put(w, "general.architecture".into(), Value::String(arch.into()))?;
    put(
        w,
        "general.name".into(),
        Value::String(opened.manifest.model.name.clone()),
    )?;
    put(w, key("context_length"), uint(context))?;
    put(w, key("embedding_length"), uint(b.width))?;
    put(w, key("block_count"), uint(blocks.len()))?;
    put(w, key("feed_forward_length"), uint(b.hidden))?;
    put(w, key("attention.head_count"), uint(b.heads))?;
    put(w, key("attention.head_count_kv"), uint(b.kv_heads))?;
    put(w, key("attention.key_length"), uint(b.head_dim))?;
    put(w, key("attention.value_length"), uint(b.head_dim))?;
    put(
        w,
        key("attention.layer_norm_rms_epsilon"),
        Value::F32(norm.eps),
    )?;
    put(w, key("rope.freq_base"), Value::F32(b.rope_theta as f32))?;
    put(w, key("rope.dimension_count"), uint(b.head_dim))?;
    put(w, key("vocab_size"), uint(e.vocab))?;
    match &b.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            put(w, key("rope.scaling.type"), Value::String("linear".into()))?;
            put(w, key("rope.scaling.factor"), Value::F32(*factor as f32))?;
        }
        // Llama 3's scaling (or a table already): the `rope_freqs` tensor of factors.
        Some(_) => {}
    }
    if let Some(scaling @ (RopeScaling::Llama3 { .. } | RopeScaling::Factors { .. })) =
        &b.rope_scaling
    {
        let rope = Rope::new(b.head_dim, b.rope_theta, Some(scaling));
        let factors: Vec<f32> = rope
            .factors(b.rope_theta)
            .into_iter()
            .map(|f| f as f32)
            .collect();
        w.tensor(
            "rope_freqs.weight",
            &[factors.len() as u64],
            TensorType::F32,
            &factors,
        )?;
    }
    let tied = layers[n - 1].tied_to.is_some();
    let count = opened
        .stage
        .param_ranges()
        .map(|(l, _)| l.param_tensors().len())
        .sum::<usize>()
        - usize::from(tied);
    Ok((arch, count))
}

/// The run's tokenizer, when it kept one: the `tokenizer.*` metadata of the GGUF file it
/// started from, copied; or the `tokenizer.json` it kept (a Hugging Face directory's) written
/// as llama.cpp's converter writes a byte-level BPE. Says what was written.
fn copy_tokenizer(opened: &Opened, w: &mut GgufWriter) -> Result<String> {
    let base = crate::pretrained::run_info(&opened.dir)
        .map(|v| v.base)
        .filter(|b| b.extension().is_some_and(|e| e == "gguf") && b.is_file());
    if let Some(base) = base {
        let file = Gguf::open(&base).map_err(|e| UsageError(e.to_string()))?;
        let mut copied = 0;
        for (k, v) in &file.metadata {
            if k.starts_with("tokenizer.") {
                w.metadata(k, v.clone())?;
                copied += 1;
            }
        }
        return Ok(format!(
            "the tokenizer of {} ({copied} keys)",
            base.display()
        ));
    }
    let Some((run, vocabulary)) = crate::pretrained::run_of(&opened.dir)? else {
        return Ok("no tokenizer (the run kept none)".into());
    };
    let rows = match opened.layers.first().map(|l| &l.kind) {
        Some(LayerKind::Embedding(e)) => e.vocab,
        _ => return Ok("no tokenizer (the model reads no tokens)".into()),
    };
    match ringtmp_pretrained::gguf::tokenizer_metadata(&vocabulary, rows) {
        Ok(keys) => {
            for (k, v) in keys {
                w.metadata(&k, v)?;
            }
            Ok(format!(
                "the tokenizer of {}",
                run.join("tokenizer.json").display()
            ))
        }
        Err(why) => {
            eprintln!("note: the GGUF file carries no tokenizer: {why}");
            Ok("no tokenizer".into())
        }
    }
}

/// The model's tensors under llama.cpp's names: matrices in `kind`, vectors in F32.
fn tensors(opened: &Opened, arch: &str, kind: TensorType, w: &mut GgufWriter) -> Result<()> {
    let params = opened.stage.params();
    let n = opened.layers.len();
    let tied = opened.layers[n - 1].tied_to.is_some();
    for (i, (layer, range)) in opened.stage.param_ranges().enumerate() {
        let mut at = range.start;
        let named: Vec<(String, Vec<usize>)> = match &layer.kind {
            LayerKind::LlamaBlock(b) => b.param_tensors(&format!("model.layers.{}", i - 1)),
            _ => layer.param_tensors(),
        };
        for (name, shape) in named {
            let len: usize = shape.iter().product();
            let mut values = params[at..at + len].to_vec();
            at += len;
            let gguf_name = match (&layer.kind, i) {
                (LayerKind::Embedding(_), _) => "token_embd.weight".to_string(),
                (LayerKind::Norm(_), _) => "output_norm.weight".to_string(),
                (LayerKind::Linear(_), _) if tied => continue,
                (LayerKind::Linear(_), _) => "output.weight".to_string(),
                _ => ringtmp_pretrained::model::gguf_llama_name(&name),
            };
            if arch == "llama" {
                let heads = match &layer.kind {
                    LayerKind::LlamaBlock(b) if name.contains("q_proj") => Some(b.heads),
                    LayerKind::LlamaBlock(b) if name.contains("k_proj") => Some(b.kv_heads),
                    _ => None,
                };
                if let Some(heads) = heads {
                    ringtmp_pretrained::model::interleave(&mut values, heads, shape[0]);
                }
            }
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            let stored = if shape.len() >= 2 {
                kind
            } else {
                TensorType::F32
            };
            w.tensor(&gguf_name, &dims, stored, &values)
                .map_err(|e| UsageError(format!("{gguf_name}: {e}")))?;
        }
    }
    Ok(())
}
