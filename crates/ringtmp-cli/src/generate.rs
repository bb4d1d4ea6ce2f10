//! `ringtmp generate`: text from a language model's checkpoint, whichever strategy and partition
//! wrote it, or from a pretrained model (`--pretrained`: a GGUF file or a Hugging Face
//! directory; `--chat` renders a message through its chat template, and generation stops at its
//! end of turn). The model is assembled from the checkpoint's stage files by tensor name, decoded
//! with a KV cache ([`ringtmp_model::decode`]) and sampled as nanoGPT samples
//! ([`ringtmp_model::generate`]); the text goes to stdout as it is drawn, the figures (time to
//! first token, tokens per second, the cache's size) to stderr. With `--nodes N` the model stays
//! split over N local node processes, each reading and caching only its own layers
//! ([`ringtmp_strategy::generate`]); rank 0 draws the tokens and prints them.
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
use ringtmp_model::packed::InferenceStage;
use ringtmp_model::{Shape, Stage};
use ringtmp_strategy::generate::GenerateJob;
use ringtmp_strategy::per_node::{Bytes, PerNode};

use crate::error::UsageError;

/// `ringtmp generate` options.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint directory, a run's `checkpoints/` directory or a run directory (its latest
    /// checkpoint), from any strategy.
    #[arg(
        long,
        required_unless_present = "pretrained",
        conflicts_with = "pretrained"
    )]
    pub checkpoint: Option<PathBuf>,
    /// A pretrained model: a `.gguf` file or a Hugging Face model directory (`config.json`,
    /// safetensors, `tokenizer.json`).
    #[arg(long, value_name = "PATH")]
    pub pretrained: Option<PathBuf>,
    /// A message to the model, rendered by its chat template with the assistant's turn opened;
    /// only the answer is printed.
    #[arg(long, value_name = "MESSAGE", conflicts_with_all = ["prompt", "prompt_ids"])]
    pub chat: Option<String>,
    /// With --chat: the system message before it.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// The prompt as token ids (comma-separated), for a model trained on `.bin` token files.
    #[arg(long, conflicts_with = "prompt", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 500)]
    pub tokens: usize,
    /// Divides the logits before sampling; 0 takes the most likely token [default: 0.8; a
    /// pretrained model's generation_config.json's, or 0 where it does not sample]
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample among the K most likely tokens only; 0 = all [default: 200; a pretrained
    /// model's generation_config.json's]
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities sum to P only (nucleus
    /// sampling); 1 = all [default: 1; a pretrained model's generation_config.json's]
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seeds the sampling: the same checkpoint, prompt and seed give the same text.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// The `tokenizer.json` the model was trained with (a BPE run's; checked against the
    /// checkpoint's record of it).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// How the weights of matrices are held while generating: `file` (as a pretrained file
    /// stores them where a kernel reads that format — bf16, f16, q8_0, q4_0, q4_1 — else
    /// f32), `f32`, `bf16` or `q8_0` (converted on load). Fewer bytes, faster tokens:
    /// decoding reads every weight once per token.
    #[arg(long, default_value = "file", value_parser = clap::builder::ValueParser::new(ringtmp_pretrained::held::WeightsDtype::parse))]
    pub weights_dtype: ringtmp_pretrained::held::WeightsDtype,
    /// How products over 8- and 4-bit blocks (q8_0, q4_0, q4_1) take the decoded vector:
    /// `f32` (the blocks dequantised in the loop), `int16` (the vector quantised to 16 bits
    /// in blocks of 32 and the sums taken in integers: SmolLM2's logits move by a two-thousandth
    /// of their range) or `int8` (llama.cpp's 8 bits: faster, and coarse enough to change a
    /// small model's greedy answer) [default: int16 where the CPU has AVX-512 VNNI, else f32]
    #[arg(long, value_parser = clap::builder::ValueParser::new(ringtmp_model::packed::Activations::parse))]
    pub activations: Option<ringtmp_model::packed::Activations>,
    /// Compute threads (default: every core; with --nodes, the cores shared out).
    #[arg(long, value_parser = crate::args::at_least_one)]
    pub threads: Option<usize>,
    /// Split the model over N local node processes (its layers balanced by parameters): no
    /// process holds the whole model or its cache.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nodes: u32,
    /// With --nodes: each node's memory (`768M`, or `RANK:LIMIT` entries); a split whose node
    /// would hold more parameters than its limit is refused before any node starts.
    #[arg(long, value_name = "LIMIT", num_args = 1..)]
    pub node_memory_limit: Option<Vec<PerNode<Bytes>>>,
    /// With --node-memory-limit: hold each node process to its limit (a cgroup v2 memory
    /// limit; a node that outgrows it is ended by the kernel).
    #[arg(long)]
    pub enforce_memory_limit: bool,
}

/// How ids become text and back for this checkpoint.
pub(crate) enum Text {
    Chars(Vocabulary),
    Tokenizer(Box<TextTokenizer>),
    Ids,
    /// A pretrained model's tokenizer; its special tokens are not printed.
    Pretrained(Box<tokenizers::Tokenizer>),
}

impl Text {
    /// The text of `ids`.
    pub(crate) fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        Ok(match self {
            Self::Chars(v) => v.decode(ids).unwrap_or_default(),
            Self::Tokenizer(t) => t.decode(ids)?,
            Self::Ids => ids.iter().map(|i| format!("{i} ")).collect::<String>(),
            Self::Pretrained(t) => t
                .decode(ids, true)
                .map_err(|e| anyhow::anyhow!("decoding tokens: {e}"))?,
        })
    }
}

/// Checks the options every generation shares (a checkpoint's or a pretrained model's).
pub fn check(a: &GenerateArgs) -> anyhow::Result<()> {
    if a.tokens == 0 {
        return Err(
            UsageError("--tokens 0: nothing to generate (ask for at least 1)".into()).into(),
        );
    }
    if let Some(t) = a.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        return Err(UsageError(format!(
            "--temperature {t}: must be 0 (the most likely token) or more"
        ))
        .into());
    }
    if let Some(p) = a.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(UsageError(format!("--top-p {p}: must be above 0 and at most 1")).into());
    }
    Ok(())
}

/// `ringtmp generate --checkpoint`.
pub fn run(a: &GenerateArgs) -> anyhow::Result<()> {
    check(a)?;
    let checkpoint = a
        .checkpoint
        .as_deref()
        .expect("clap: --checkpoint or --pretrained");
    // A run from a pretrained model keeps its tokenizer, template and stop tokens beside its
    // checkpoints.
    let kept = crate::pretrained::run_of(checkpoint)?;
    let (prompt_ids, stop) = match (&kept, &a.chat) {
        (Some((_, v)), Some(message)) => {
            let ids = crate::pretrained::chat_ids(v, message, a.system.as_deref(), checkpoint)?;
            (Some(ids), v.stop.clone())
        }
        (None, Some(_)) => {
            return Err(UsageError(format!(
                "--chat: {} is not a run from a pretrained model (no chat template kept); give \
                 one with --pretrained PATH",
                checkpoint.display()
            ))
            .into());
        }
        (Some((_, v)), None) => (a.prompt_ids.clone(), v.stop.clone()),
        (None, None) => (a.prompt_ids.clone(), Vec::new()),
    };
    let tokenizer = a
        .tokenizer
        .clone()
        .or_else(|| kept.as_ref().map(|(run, _)| run.join("tokenizer.json")));
    let mut opened = open(
        checkpoint,
        tokenizer.as_deref(),
        &a.prompt,
        prompt_ids.as_ref(),
    )?;
    // A model without learned positions (RoPE) reads as far as its base model's context, not
    // only the windows it was fine-tuned on.
    let rotary = matches!(
        opened.manifest.model.layers.first(),
        Some(ringtmp_model::LayerSpec::Embedding {
            positions: false,
            ..
        })
    );
    if let (true, Some((run, _))) = (rotary, &kept)
        && let Some(context) = crate::pretrained::run_info(run).and_then(|v| v.context)
    {
        opened.context = opened.context.max(context);
    }
    if a.nodes > 1 {
        return split(a, &opened, stop, tokenizer.as_deref());
    }
    if a.node_memory_limit.is_some() || a.enforce_memory_limit {
        return Err(UsageError(
            "--node-memory-limit and --enforce-memory-limit apply to a split over --nodes N".into(),
        )
        .into());
    }
    let layers = manifest_layers(&opened)?;
    let Opened {
        dir,
        manifest,
        vocab,
        context,
        text,
        prompt,
    } = opened;
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let mut stage = Stage::new(&layers, 0..layers.len(), manifest.seed, threads);
    checkpoint::read_params(&dir, &manifest, &mut stage)?;
    Decoder::new(&stage).map_err(|e| UsageError(e.to_string()))?;
    ringtmp_strategy::generate::release_freed_memory();
    let params = stage.params().len();
    let stage = InferenceStage::from_stage(&stage, a.weights_dtype.format())
        .with_activations(activations(a.activations));
    eprintln!(
        "generate: {} ({} parameters, context {context}, {}) from {} step {} ({})",
        manifest.model.name,
        params,
        vocab.describe(),
        manifest.strategy,
        manifest.step,
        dir.display()
    );
    let mut chain = LocalChain::new(vec![stage])?;
    let sampling = Sampling {
        top_p: a.top_p.unwrap_or(1.0),
        stop,
        ..Sampling::top_k(a.temperature.unwrap_or(0.8), a.top_k.unwrap_or(200), a.seed)
    };
    stream(a, &mut chain, &text, &prompt, &sampling)?;
    Ok(())
}

/// Generates `a.tokens` tokens after `prompt` from `chain`, printing each as it comes (after
/// the prompt's text, unless `--chat`) and the figures at the end.
pub(crate) fn stream(
    a: &GenerateArgs,
    chain: &mut LocalChain<InferenceStage>,
    text: &Text,
    prompt: &[u32],
    sampling: &Sampling,
) -> anyhow::Result<ringtmp_model::generate::Generated> {
    let shown: &[u32] = if a.chat.is_some() { &[] } else { prompt };
    let mut printer = Printer::new(text, shown)?;
    let generated = generate(chain, prompt, a.tokens, sampling, &mut |token| {
        printer
            .token(token)
            .map_err(|e| ringtmp_model::Error::Config {
                source_name: "generate".into(),
                reason: e.to_string(),
            })
    })
    .context("generating")?;
    printer.end()?;
    eprintln!("{}", figures(&generated, prompt.len(), chain.cache_bytes()));
    Ok(generated)
}

/// A checkpoint opened for generation, with everything the user gave checked against it.
pub(crate) struct Opened {
    pub dir: PathBuf,
    pub manifest: checkpoint::Manifest,
    pub vocab: Vocabulary,
    pub context: usize,
    pub text: Text,
    pub prompt: Vec<u32>,
}

/// Opens the checkpoint `path` means and encodes the prompt (`prompt_ids` when given); every
/// mistake a usage error.
pub(crate) fn open(
    path: &std::path::Path,
    tokenizer: Option<&std::path::Path>,
    prompt_text: &str,
    prompt_ids: Option<&Vec<u32>>,
) -> anyhow::Result<Opened> {
    let dir = crate::export::weights_dir(path)?;
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
    let text = match (&vocab, tokenizer) {
        (Vocabulary::Chars(_), _) => Text::Chars(vocab.clone()),
        (Vocabulary::Tokenizer { .. }, Some(path)) => {
            let t = TextTokenizer::open(path)?;
            if !vocab.is_spelled_by(&t.vocab) {
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
    let prompt: Vec<u32> = match (prompt_ids, &text) {
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
        (None, Text::Chars(v)) => v.encode(prompt_text).map_err(|(c, at)| {
            UsageError(format!(
                "--prompt: character {c:?} (at {at}) is not in the model's vocabulary of {} \
                 characters",
                v.len()
            ))
        })?,
        (None, Text::Tokenizer(t)) => t.encode(prompt_text)?,
        (None, Text::Pretrained(_)) => {
            unreachable!("a checkpoint's text is never a pretrained model's")
        }
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

    Ok(Opened {
        dir,
        manifest,
        vocab,
        context,
        text,
        prompt,
    })
}

/// Prints the prompt, then each token as it is drawn. A byte-level token may end inside a
/// character, so the text is decoded over a short window of the last tokens (the incremental
/// decoding of Hugging Face's text-generation-inference): the window from `prefix` to `read`
/// was printed, and the text past it is printed once it no longer ends in an incomplete
/// character. Each token costs a decode of a few tokens, not of everything drawn.
pub(crate) struct Printer<'a> {
    text: &'a Text,
    drawn: Vec<u32>,
    /// Where the window of tokens decoded together starts.
    prefix: usize,
    /// Tokens up to here are printed.
    read: usize,
}

impl<'a> Printer<'a> {
    pub(crate) fn new(text: &'a Text, prompt: &[u32]) -> anyhow::Result<Self> {
        let mut out = std::io::stdout().lock();
        write!(out, "{}", text.decode(prompt)?)?;
        out.flush()?;
        Ok(Self {
            text,
            drawn: Vec::new(),
            prefix: 0,
            read: 0,
        })
    }

    pub(crate) fn token(&mut self, token: u32) -> anyhow::Result<()> {
        self.drawn.push(token);
        if let Some(new) = self.unprinted(false)? {
            let mut out = std::io::stdout().lock();
            write!(out, "{new}")?;
            out.flush()?;
        }
        Ok(())
    }

    /// The text past what is printed, once it is complete (or `last`: whatever there is); the
    /// window moves on past it.
    fn unprinted(&mut self, last: bool) -> anyhow::Result<Option<String>> {
        let printed = self.text.decode(&self.drawn[self.prefix..self.read])?;
        let whole = self.text.decode(&self.drawn[self.prefix..])?;
        let complete = !whole.ends_with('\u{FFFD}');
        if whole.len() <= printed.len() || !(complete || last) {
            return Ok(None);
        }
        let new = match whole.strip_prefix(printed.as_str()) {
            Some(new) => new.to_string(),
            None => whole,
        };
        self.prefix = self.read;
        self.read = self.drawn.len();
        Ok(Some(new))
    }

    pub(crate) fn end(mut self) -> anyhow::Result<()> {
        let rest = self.unprinted(true)?.unwrap_or_default();
        writeln!(std::io::stdout().lock(), "{rest}")?;
        Ok(())
    }
}

/// The figures line (stderr).
pub(crate) fn figures(
    generated: &ringtmp_model::generate::Generated,
    prompt: usize,
    cache_bytes: usize,
) -> String {
    format!(
        "generate: {prompt} prompt tokens, {} generated; first token after {:.3} s, then {:.1} \
         tokens/s; KV cache {:.2} MB; context refilled {} times",
        generated.tokens.len(),
        generated.first_token_seconds,
        generated.tokens_per_second(),
        cache_bytes as f64 / 1e6,
        generated.refills
    )
}

/// `--nodes N`: the model split over N local node processes; `stop` ends the generation (a
/// pretrained run's end of turn); `tokenizer` decodes the text (`--tokenizer`, or the one a
/// pretrained run kept).
fn split(
    a: &GenerateArgs,
    opened: &Opened,
    stop: Vec<u32>,
    tokenizer: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let layers = manifest_layers(opened)?;
    // A checkpoint's stages hold their own copies: a tied head stays on the last node (on
    // rank 0 it would be a second copy beside the table).
    let partition = ringtmp_strategy::generate::partition(&layers, a.nodes as usize)
        .map_err(|e| UsageError(e.to_string()))?;
    // A split generation decodes position by position on every node: check each stage can.
    for (start, end) in &partition {
        Decoder::for_layers(&layers[*start..*end]).map_err(|e| UsageError(e.to_string()))?;
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let job = GenerateJob {
        checkpoint: std::path::absolute(&opened.dir).unwrap_or_else(|_| opened.dir.clone()),
        pretrained: false,
        partition: partition.clone(),
        tail: None,
        context: opened.context,
        vocab: opened.vocab.len(),
        prompt: opened.prompt.clone(),
        tokens: a.tokens,
        temperature: a.temperature.unwrap_or(0.8),
        top_k: a.top_k.unwrap_or(200),
        top_p: a.top_p.unwrap_or(1.0),
        seed: a.seed,
        stop,
        print_prompt: a.chat.is_none(),
        threads: a
            .threads
            .unwrap_or_else(|| (cores / a.nodes as usize).max(1)),
        recv_timeout_secs: ringtmp_strategy::DEFAULT_RECV_TIMEOUT_SECS,
        tokenizer: tokenizer.map(|t| std::path::absolute(t).unwrap_or_else(|_| t.to_path_buf())),
        weights_dtype: a.weights_dtype,
        activations: a.activations,
    };
    launch_split(a, &job, &layers, &opened.manifest.model.name)
}

/// Launches a split generation of `job` over `a.nodes` local node processes, each holding its
/// share of `layers`.
pub(crate) fn launch_split(
    a: &GenerateArgs,
    job: &GenerateJob,
    layers: &[ringtmp_model::Layer],
    name: &str,
) -> anyhow::Result<()> {
    let partition = job.partition.clone();
    // Rank 0 holds the tail too: its norm, and a head reading rank 0's own table.
    let tail: usize = job.tail.map_or(0, |(s, e)| {
        layers[s..e]
            .iter()
            .filter(|l| l.tied_to.is_none())
            .map(|l| l.param_count())
            .sum()
    });
    let share = |r: &(usize, usize)| -> usize {
        let own: usize = layers[r.0..r.1].iter().map(|l| l.param_count()).sum();
        own + if r.0 == 0 { tail } else { 0 }
    };
    let memory = node_memory(a, &partition, &share)?;
    let then = job.tail.map_or(String::new(), |(s, e)| {
        format!(", then {s}..{e} on node 0 beside the table its head reads")
    });
    eprintln!(
        "generate: {name} split over {} nodes (layers {}{then}; parameters per node {})",
        a.nodes,
        partition
            .iter()
            .map(|(s, e)| format!("{s}..{e}"))
            .collect::<Vec<_>>()
            .join(", "),
        partition
            .iter()
            .map(|r| share(r).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let dir = tempfile_dir()?;
    let job_file = dir.join("generate-job.json");
    std::fs::write(&job_file, serde_json::to_string(job)?)
        .with_context(|| format!("writing {}", job_file.display()))?;
    let job_arg = job_file.display().to_string();
    let node_args = |rank: u32| {
        let mut args = vec!["--job".to_string(), "generate".into()];
        if rank == 0 {
            args.extend(["--job-file".into(), job_arg.clone()]);
        }
        args
    };
    let cgroups = std::cell::RefCell::new(crate::cgroup::NodeCgroups::default());
    let on_spawn = |rank: u32, pid: u32| -> anyhow::Result<()> {
        if let Some(bytes) = memory.get(rank as usize).copied().flatten() {
            cgroups.borrow_mut().limit_memory(rank, pid, bytes)?;
            eprintln!(
                "launcher: node {rank} is held to {} MiB of memory",
                bytes >> 20
            );
        }
        Ok(())
    };
    let explain = |rank: u32| cgroups.borrow().explain(rank);
    let ended = crate::launcher::run(&crate::launcher::Launch {
        nodes: a.nodes,
        pin: false,
        verbose: false,
        args: &node_args,
        expendable: &|_| false,
        on_spawn: &on_spawn,
        explain: &explain,
        raw_rank0_stdout: true,
    });
    drop(cgroups);
    let _ = std::fs::remove_dir_all(&dir);
    ended.map(|_| ())
}

/// The nodes' memory limits from `--node-memory-limit`, checked against what each node of the
/// split holds at least (its parameters and the process's baseline); `Some` per node only where
/// `--enforce-memory-limit` asks the kernel to hold it to its limit.
fn node_memory(
    a: &GenerateArgs,
    partition: &[(usize, usize)],
    params_of: &dyn Fn(&(usize, usize)) -> usize,
) -> anyhow::Result<Vec<Option<u64>>> {
    let Some(entries) = a.node_memory_limit.as_deref() else {
        if a.enforce_memory_limit {
            return Err(UsageError(
                "--enforce-memory-limit needs --node-memory-limit (the limit to enforce)".into(),
            )
            .into());
        }
        return Ok(vec![None; a.nodes as usize]);
    };
    let limits = ringtmp_strategy::Cluster::local(a.nodes)
        .with_memory_limits(Some(&PerNode::joined(entries)))
        .map_err(|e| UsageError(e.to_string()))?
        .memory_limits;
    for (rank, (range, limit)) in partition.iter().zip(&limits).enumerate() {
        // Parameters only (no gradients or optimizer state), and the process's baseline.
        let floor = ringtmp_strategy::memory_floor::Floor {
            who: format!("node {rank}"),
            params: params_of(range) as u64,
            values: 1,
            what: String::new(),
        }
        .bytes();
        if let Some(limit) = limit
            && floor > *limit
        {
            return Err(UsageError(format!(
                "--node-memory-limit: node {rank} holds layers {}..{} ({:.1} M parameters, {} MiB \
                 with the process's baseline), more than its limit of {} MiB; split the model \
                 over more nodes (--nodes)",
                range.0,
                range.1,
                params_of(range) as f64 / 1e6,
                floor >> 20,
                limit >> 20
            ))
            .into());
        }
    }
    if !a.enforce_memory_limit {
        return Ok(vec![None; a.nodes as usize]);
    }
    crate::cgroup::NodeCgroups::check(&vec![None; a.nodes as usize], &limits)?;
    Ok(limits)
}

fn manifest_layers(opened: &Opened) -> anyhow::Result<Vec<ringtmp_model::Layer>> {
    Ok(opened.manifest.model.build_for(
        &Shape::flat(opened.context),
        &Shape(vec![opened.context, opened.vocab.len()]),
    )?)
}

/// A fresh directory for the launch's job file.
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "ringtmp-generate-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// `--activations`, or where unsaid what this CPU computes fastest without changing the
/// answers.
pub fn activations(
    asked: Option<ringtmp_model::packed::Activations>,
) -> ringtmp_model::packed::Activations {
    asked.unwrap_or_else(ringtmp_model::packed::Activations::default_for_cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    // A byte-level token may end inside a character: the characters still come out whole and
    // in full, however the text is split into tokens.
    #[test]
    fn characters_split_over_tokens_are_printed_whole() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("corpus.txt");
        let sample = "héllo wörld ✓ 日本語のテキスト — ünïcödé ☃ ".repeat(3);
        std::fs::write(&corpus, &sample).unwrap();
        let path = dir.path().join("tokenizer.json");
        ringtmp_data::text::train_byte_level_bpe(&[corpus], 270, &path).unwrap();
        let tokenizer = ringtmp_data::TextTokenizer::open(&path).unwrap();
        let ids = tokenizer.encode(&sample).unwrap();
        let text = Text::Tokenizer(Box::new(tokenizer));
        let mut printer = Printer::new(&text, &[]).unwrap();
        let mut out = String::new();
        for id in ids {
            printer.drawn.push(id);
            if let Some(new) = printer.unprinted(false).unwrap() {
                assert!(!new.contains('\u{FFFD}'), "{new:?}");
                out.push_str(&new);
            }
            // The window never grows past the tokens of one character.
            assert!(printer.drawn.len() - printer.prefix <= 8);
        }
        out.push_str(&printer.unprinted(true).unwrap().unwrap_or_default());
        assert_eq!(out, sample);
    }
}
