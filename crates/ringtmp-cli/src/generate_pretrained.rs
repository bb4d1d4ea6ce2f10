//! `ringtmp generate --pretrained PATH`: text from a pretrained model's own files, in one
//! process or split over `--nodes N` local node processes that each read only their own
//! layers' tensors. The prompt is `--chat` through the model's template (only the answer is
//! printed) or `--prompt` with its framing tokens; generation stops at the model's end of
//! sequence or turn; the sampling defaults are the model's `generation_config.json`'s.

use std::path::Path;
use std::time::Instant;

use ringtmp_model::decode::Decoder;
use ringtmp_model::generate::{LocalChain, Sampling};
use ringtmp_strategy::generate::GenerateJob;

use crate::error::UsageError;
use crate::generate::{GenerateArgs, Text, launch_split, stream};
use crate::pretrained::{self, Opened};

/// `ringtmp generate --pretrained PATH`.
pub fn run(a: &GenerateArgs, path: &Path) -> anyhow::Result<()> {
    crate::generate::check(a)?;
    let started = Instant::now();
    if a.tokenizer.is_some() {
        return Err(
            UsageError("--tokenizer: a pretrained model brings its own tokenizer".into()).into(),
        );
    }
    let opened = pretrained::open(path)?;
    let prompt = prompt(a, &opened)?;
    let context = opened.model.config.context;
    if prompt.len() >= context {
        return Err(UsageError(format!(
            "the prompt is {} tokens, the model's context {context}",
            prompt.len()
        ))
        .into());
    }
    let defaults = pretrained::sampling_defaults(path);
    let sampling = Sampling {
        temperature: a.temperature.unwrap_or(defaults.temperature),
        top_k: a.top_k.unwrap_or(defaults.top_k),
        top_p: a.top_p.unwrap_or(defaults.top_p),
        seed: a.seed,
        stop: opened.vocabulary.stop.clone(),
    };
    let layers = opened
        .model
        .layers(context)
        .map_err(|e| UsageError(e.to_string()))?;
    let config = &opened.model.config;
    let name = format!(
        "{} ({:?}, {} blocks, {:.1} M parameters)",
        path.display(),
        config.family,
        config.layers,
        config.parameters() as f64 / 1e6
    );
    if a.nodes > 1 {
        return split(a, path, &opened, &layers, prompt, &sampling, &name);
    }
    if a.node_memory_limit.is_some() || a.enforce_memory_limit {
        return Err(UsageError(
            "--node-memory-limit and --enforce-memory-limit apply to a split over --nodes N".into(),
        )
        .into());
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let stage = opened
        .model
        .inference_stage(&layers, 0..layers.len(), threads, a.weights_dtype)
        .map_err(|e| UsageError(e.to_string()))?
        .with_activations(crate::generate::activations(a.activations));
    Decoder::new(&stage).map_err(|e| UsageError(e.to_string()))?;
    ringtmp_strategy::generate::release_freed_memory();
    eprintln!(
        "generate: {name} loaded in {:.2} s, its weights {:.0} MB held as {}",
        started.elapsed().as_secs_f64(),
        stage.bytes() as f64 / 1e6,
        held_as(a.weights_dtype)
    );
    let text = Text::Pretrained(Box::new(opened.vocabulary.tokenizer.clone()));
    let mut chain = LocalChain::new(vec![stage])?;
    let generated = stream(a, &mut chain, &text, &prompt, &sampling)?;
    eprintln!(
        "generate: first token {:.2} s after the command started",
        started.elapsed().as_secs_f64() - generated.seconds + generated.first_token_seconds
    );
    Ok(())
}

/// The prompt's ids: `--chat` through the template, `--prompt-ids` checked, or `--prompt`.
fn prompt(a: &GenerateArgs, opened: &Opened) -> anyhow::Result<Vec<u32>> {
    let ids = match (&a.chat, &a.prompt_ids) {
        (Some(message), _) => opened.chat_prompt(message, a.system.as_deref())?,
        (None, Some(ids)) => opened.checked_ids(ids)?,
        (None, None) => opened.text_prompt(&a.prompt)?,
    };
    if ids.is_empty() {
        return Err(UsageError("--prompt: empty (at least one token to start from)".into()).into());
    }
    Ok(ids)
}

/// `--nodes N`: the pretrained model's layers split over N local node processes.
fn split(
    a: &GenerateArgs,
    path: &Path,
    opened: &Opened,
    layers: &[ringtmp_model::Layer],
    prompt: Vec<u32>,
    sampling: &Sampling,
    name: &str,
) -> anyhow::Result<()> {
    // Balanced by the bytes each node will hold (an embedding's 8-bit table weighs more a
    // value than 4-bit blocks); a tied head on rank 0 beside its table where both read the
    // same mapped bytes (elsewhere it would be a second copy there).
    let shared_table = opened
        .model
        .head_reads_mapped_table(layers, a.weights_dtype)
        .map_err(|e| UsageError(e.to_string()))?;
    let tail =
        ringtmp_strategy::generate::tail_of(layers, a.nodes as usize).filter(|_| shared_table);
    let bytes = opened
        .model
        .held_bytes(layers, a.weights_dtype)
        .map_err(|e| UsageError(e.to_string()))?;
    let ring = tail.map_or(layers.len(), |t| t.0);
    let partition =
        ringtmp_strategy::generate::partition_weighted(&bytes[..ring], a.nodes as usize)
            .map_err(|e| UsageError(e.to_string()))?;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let job = GenerateJob {
        checkpoint: std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
        pretrained: true,
        partition,
        tail,
        context: opened.model.config.context,
        vocab: opened.model.config.vocab,
        prompt,
        tokens: a.tokens,
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        seed: sampling.seed,
        stop: sampling.stop.clone(),
        print_prompt: a.chat.is_none(),
        threads: a
            .threads
            .unwrap_or_else(|| (cores / a.nodes as usize).max(1)),
        recv_timeout_secs: ringtmp_strategy::DEFAULT_RECV_TIMEOUT_SECS,
        tokenizer: None,
        weights_dtype: a.weights_dtype,
        activations: a.activations,
    };
    launch_split(a, &job, layers, name)
}

/// What `--weights-dtype` holds, in words.
fn held_as(dtype: ringtmp_pretrained::held::WeightsDtype) -> &'static str {
    use ringtmp_pretrained::held::WeightsDtype::*;
    match dtype {
        File => "the file stores them",
        F32 => "f32",
        Bf16 => "bf16",
        Q8_0 => "q8_0",
    }
}
