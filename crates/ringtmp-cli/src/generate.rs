//! `ringtmp generate`: text from a language model's checkpoint, whichever strategy and partition
//! wrote it. The model is assembled from the checkpoint's stage files by tensor name, decoded
//! with a KV cache ([`ringtmp_model::decode`]) and sampled as nanoGPT samples
//! ([`ringtmp_model::generate`]); the text goes to stdout as it is drawn, the figures (time to
//! first token, tokens per second, the cache's size) to stderr.
//!
//! Everything the user gives is checked before a token is drawn, each mistake exit status 2: a
//! checkpoint that is not a language model, a prompt with characters outside its vocabulary, a
//! tokenizer that is not the run's, no tokens asked for.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use ringtmp_data::{TextTokenizer, Vocabulary};
use ringtmp_model::checkpoint;
use ringtmp_model::decode::Decoder;
use ringtmp_model::generate::{LocalChain, Sampling, generate};
use ringtmp_model::{Shape, Stage};

use crate::error::UsageError;

/// `ringtmp generate` options.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint directory, a run's `checkpoints/` directory or a run directory (its latest
    /// checkpoint), from any strategy.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// The prompt as token ids (comma-separated), for a model trained on `.bin` token files.
    #[arg(long, conflicts_with = "prompt", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 500)]
    pub tokens: usize,
    /// Divides the logits before sampling; 0 takes the most likely token.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the K most likely tokens only; 0 = all.
    #[arg(long, default_value_t = 200)]
    pub top_k: usize,
    /// Seeds the sampling: the same checkpoint, prompt and seed give the same text.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// The `tokenizer.json` the model was trained with (a BPE run's; checked against the
    /// checkpoint's record of it).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Compute threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// How ids become text and back for this checkpoint.
enum Text {
    Chars(Vocabulary),
    Tokenizer(Box<TextTokenizer>),
    Ids,
}

impl Text {
    fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        Ok(match self {
            Self::Chars(v) => v.decode(ids).unwrap_or_default(),
            Self::Tokenizer(t) => t.decode(ids)?,
            Self::Ids => ids.iter().map(|i| format!("{i} ")).collect::<String>(),
        })
    }
}

pub fn run(a: &GenerateArgs) -> anyhow::Result<()> {
    if a.tokens == 0 {
        return Err(
            UsageError("--tokens 0: nothing to generate (ask for at least 1)".into()).into(),
        );
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(UsageError(format!(
            "--temperature {}: must be 0 (the most likely token) or more",
            a.temperature
        ))
        .into());
    }
    let dir = checkpoint::resolve(&a.checkpoint).map_err(|e| UsageError(e.to_string()))?;
    let manifest = checkpoint::read_manifest(&dir).map_err(|e| UsageError(e.to_string()))?;
    let not_lm = |why: &str| {
        UsageError(format!(
            "{}: not a language model's checkpoint ({why}; its model is {}, trained on {})",
            dir.display(),
            manifest.model.name,
            manifest.dataset
        ))
    };
    let line = manifest
        .vocabulary
        .as_deref()
        .ok_or_else(|| not_lm("it records no vocabulary"))?;
    let vocab = Vocabulary::from_line(line, &format!("{}", dir.display()))?;
    let context = checkpoint::context_of(&dir, &manifest)?
        .ok_or_else(|| not_lm("it has no position embedding"))?;
    let text = match (&vocab, &a.tokenizer) {
        (Vocabulary::Chars(_), _) => Text::Chars(vocab.clone()),
        (Vocabulary::Tokenizer { .. }, Some(path)) => {
            let t = TextTokenizer::open(path)?;
            if t.vocab != vocab {
                return Err(UsageError(format!(
                    "--tokenizer {}: {}, but the model was trained with {}",
                    path.display(),
                    t.vocab.describe(),
                    vocab.describe()
                ))
                .into());
            }
            Text::Tokenizer(Box::new(t))
        }
        (Vocabulary::Tokenizer { .. }, None) => {
            return Err(UsageError(format!(
                "the model was trained with a tokenizer ({}): give its file with --tokenizer",
                vocab.describe()
            ))
            .into());
        }
        (Vocabulary::Ids { .. }, _) => Text::Ids,
    };
    let prompt: Vec<u32> = match (&a.prompt_ids, &text) {
        (Some(ids), _) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab.len()) {
                return Err(UsageError(format!(
                    "--prompt-ids: id {bad} is past the model's vocabulary of {}",
                    vocab.len()
                ))
                .into());
            }
            ids.clone()
        }
        (None, Text::Chars(v)) => v.encode(&a.prompt).map_err(|(c, at)| {
            UsageError(format!(
                "--prompt: character {c:?} (at {at}) is not in the model's vocabulary of {} \
                 characters",
                v.len()
            ))
        })?,
        (None, Text::Tokenizer(t)) => t.encode(&a.prompt)?,
        (None, Text::Ids) => {
            return Err(UsageError(
                "the model was trained on token ids (.bin files): give the prompt as --prompt-ids"
                    .into(),
            )
            .into());
        }
    };
    if prompt.is_empty() {
        return Err(UsageError("--prompt: empty (at least one token to start from)".into()).into());
    }

    let layers = manifest
        .model
        .build_for(&Shape::flat(context), &Shape(vec![context, vocab.len()]))?;
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let mut stage = Stage::new(&layers, 0..layers.len(), manifest.seed, threads);
    checkpoint::read_params(&dir, &manifest, &mut stage)?;
    Decoder::new(&stage).map_err(|e| UsageError(e.to_string()))?;
    eprintln!(
        "generate: {} ({} parameters, context {context}, {}) from {} step {} ({})",
        manifest.model.name,
        stage.params().len(),
        vocab.describe(),
        manifest.strategy,
        manifest.step,
        dir.display()
    );
    let mut chain = LocalChain::new(vec![stage])?;
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
    };
    let mut out = std::io::stdout().lock();
    let mut printed = String::new();
    let mut drawn: Vec<u32> = Vec::new();
    write!(out, "{}", text.decode(&prompt)?)?;
    let generated = generate(&mut chain, &prompt, a.tokens, &sampling, &mut |token| {
        // Decoded as a whole so far: a byte-level token may end inside a character.
        drawn.push(token);
        let whole = text
            .decode(&drawn)
            .map_err(|e| ringtmp_model::Error::Config {
                source_name: "generate".into(),
                reason: e.to_string(),
            })?;
        if let Some(new) = whole.strip_prefix(printed.as_str()) {
            let _ = write!(out, "{new}");
            let _ = out.flush();
            printed = whole;
        }
        Ok(())
    })
    .context("generating")?;
    writeln!(out)?;
    eprintln!(
        "generate: {} prompt tokens, {} generated; first token after {:.3} s, then {:.1} tokens/s; \
         KV cache {:.2} MB; context refilled {} times",
        prompt.len(),
        generated.tokens.len(),
        generated.first_token_seconds,
        generated.tokens_per_second(),
        chain.cache_bytes() as f64 / 1e6,
        generated.refills
    );
    Ok(())
}
