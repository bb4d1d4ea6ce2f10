//! `ringtmp export --to hf OUT/`: a checkpoint of a Llama-family model (one fine-tuned from a
//! pretrained model, or any chain of an embedding, Llama blocks, an RMSNorm and a head) as a
//! Hugging Face model directory that `AutoModelForCausalLM.from_pretrained(OUT)` loads with the
//! same logits: `model.safetensors` under `transformers`' names, `config.json` (the family told
//! by the blocks: q/k/v biases make Qwen 2, q/k norms Qwen 3), `generation_config.json`, and
//! the run's tokenizer and chat template where the run kept them.

use std::path::Path;

use anyhow::Result;
use ringtmp_model::interop::{self, Tensor};
use ringtmp_model::{LayerKind, checkpoint};
use serde_json::json;

use super::opened::{Opened, open};
use super::request::{ExportArgs, check_export_dir};
use crate::error::UsageError;

/// The files an export writes.
const FILES: [&str; 6] = [
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// `ringtmp export --to hf`.
pub fn export_hf(a: &ExportArgs) -> Result<()> {
    let opened = open(&a.checkpoint, 1)?;
    let (tensors, config) = llama_tensors(&opened)?;
    check_export_dir(&a.out, &FILES, a.overwrite)?;
    interop::write_safetensors(
        &a.out.join("model.safetensors"),
        &tensors,
        &[("format", "pt")],
    )?;
    let run = crate::pretrained::run_of(&opened.dir)?;
    let mut config = config;
    let mut written = vec!["model.safetensors", "config.json"];
    let mut generation = json!({ "_from_model_config": true });
    if let Some((dir, vocabulary)) = &run {
        if let Some(bos) = vocabulary.bos {
            config["bos_token_id"] = json!(bos);
            generation["bos_token_id"] = json!(bos);
        }
        if let Some(&eos) = vocabulary.stop.first() {
            config["eos_token_id"] = json!(eos);
            generation["eos_token_id"] = json!(vocabulary.stop);
        }
        copy_if_there(&dir.join("tokenizer.json"), &a.out, &mut written)?;
        copy_if_there(&dir.join("chat_template.jinja"), &a.out, &mut written)?;
        let token = |id: Option<u32>| id.and_then(|i| vocabulary.tokenizer.id_to_token(i));
        let tokenizer_config = json!({
            "bos_token": token(vocabulary.bos),
            "eos_token": token(vocabulary.stop.first().copied()),
            "add_bos_token": vocabulary.add_bos,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config["max_position_embeddings"],
        });
        write_json(&a.out.join("tokenizer_config.json"), &tokenizer_config)?;
        written.push("tokenizer_config.json");
    }
    write_json(&a.out.join("config.json"), &config)?;
    write_json(&a.out.join("generation_config.json"), &generation)?;
    written.push("generation_config.json");
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
        "load it: from transformers import AutoModelForCausalLM; \
         AutoModelForCausalLM.from_pretrained(\"{}\")",
        a.out.display()
    );
    Ok(())
}

fn copy_if_there(from: &Path, out: &Path, written: &mut Vec<&'static str>) -> Result<()> {
    if from.is_file() {
        let name = from.file_name().expect("a file");
        std::fs::copy(from, out.join(name))?;
        written.push(if name == "tokenizer.json" {
            "tokenizer.json"
        } else {
            "chat_template.jinja"
        });
    }
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    checkpoint::write_atomic(path, text.as_bytes())?;
    Ok(())
}

/// The model's tensors under `transformers`' names and its `config.json`; refuses a chain that
/// is not an embedding, Llama-family blocks, an RMSNorm and a head without a bias.
fn llama_tensors(opened: &Opened) -> Result<(Vec<Tensor>, serde_json::Value)> {
    let layers = &opened.layers;
    let refuse = |why: &str| {
        UsageError(format!(
            "{}: --to hf writes the Llama family (an embedding, Llama blocks, an RMSNorm and a \
             head): {why}; export --to pytorch writes any model",
            opened.dir.display()
        ))
    };
    let n = layers.len();
    let (Some(LayerKind::Embedding(e)), Some(LayerKind::Norm(norm)), Some(LayerKind::Linear(head))) = (
        layers.first().map(|l| &l.kind),
        layers.get(n.wrapping_sub(2)).map(|l| &l.kind),
        layers.last().map(|l| &l.kind),
    ) else {
        return Err(refuse("its layers are not such a chain").into());
    };
    let blocks: Vec<_> = layers[1..n - 2]
        .iter()
        .filter_map(|l| match &l.kind {
            LayerKind::LlamaBlock(b) => Some(b),
            _ => None,
        })
        .collect();
    if e.positions || head.bias || blocks.len() != n - 3 || blocks.is_empty() {
        return Err(refuse("its layers are not such a chain").into());
    }
    let b = blocks[0];
    if blocks.iter().any(|x| *x != b) {
        return Err(refuse("its blocks differ from one another").into());
    }
    let params = opened.stage.params();
    let mut tensors = Vec::new();
    let mut at = 0;
    let tied = layers[n - 1].tied_to.is_some();
    for (i, (layer, range)) in opened.stage.param_ranges().enumerate() {
        let names: Vec<(String, Vec<usize>)> = match &layer.kind {
            LayerKind::Embedding(e) => {
                vec![("model.embed_tokens.weight".into(), vec![e.vocab, e.width])]
            }
            LayerKind::LlamaBlock(block) => block.param_tensors(&format!("model.layers.{}", i - 1)),
            LayerKind::Norm(norm) => vec![("model.norm.weight".into(), vec![norm.features])],
            LayerKind::Linear(l) => {
                vec![("lm_head.weight".into(), vec![l.out_features, l.in_features])]
            }
            _ => unreachable!("checked above"),
        };
        at = range.start;
        for (name, shape) in names {
            let len: usize = shape.iter().product();
            if !(tied && name == "lm_head.weight") {
                tensors.push(Tensor {
                    name,
                    shape,
                    values: params[at..at + len].to_vec(),
                });
            }
            at += len;
        }
    }
    debug_assert_eq!(at, params.len());
    let family = match (b.qkv_bias, b.qk_norm) {
        (false, false) => ("llama", "LlamaForCausalLM"),
        (true, false) => ("qwen2", "Qwen2ForCausalLM"),
        (false, true) => ("qwen3", "Qwen3ForCausalLM"),
        (true, true) => return Err(refuse("both q/k/v biases and q/k norms").into()),
    };
    let context = crate::pretrained::run_info(&opened.dir)
        .and_then(|v| v.context)
        .unwrap_or(b.seq);
    let mut config = json!({
        "architectures": [family.1],
        "model_type": family.0,
        "hidden_size": b.width,
        "intermediate_size": b.hidden,
        "num_hidden_layers": blocks.len(),
        "num_attention_heads": b.heads,
        "num_key_value_heads": b.kv_heads,
        "head_dim": b.head_dim,
        "hidden_act": "silu",
        "vocab_size": e.vocab,
        "max_position_embeddings": context,
        // The f32 written as its shortest decimal (1e-5, not 9.99999974737875e-6).
        "rms_norm_eps": norm.eps.to_string().parse::<f64>()?,
        "rope_theta": b.rope_theta,
        "tie_word_embeddings": tied,
        "attention_bias": b.qkv_bias,
        "torch_dtype": "float32",
    });
    match &b.rope_scaling {
        Some(ringtmp_model::layers::rope::RopeScaling::Factors { .. }) => {
            return Err(refuse(
                "its RoPE frequencies are scaled by a GGUF file's table, which config.json \
                 cannot state (export --to gguf keeps it)",
            )
            .into());
        }
        Some(scaling) => config["rope_scaling"] = serde_json::to_value(scaling)?,
        None => {}
    }
    Ok((tensors, config))
}
