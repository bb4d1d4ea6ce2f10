//! `--pretrained PATH` in the commands: a GGUF file or a Hugging Face model directory opened
//! once, every mistake in it a usage error (one line naming the file and what, exit status 2,
//! before any node starts); the prompt made from `--chat` and `--system` through the model's
//! chat template (as `apply_chat_template` with the generation prompt) or from `--prompt` with
//! the model's framing tokens; and the sampling defaults its `generation_config.json` states
//! (`transformers`' own where it states none: the most likely token).

use std::path::Path;

use ringtmp_pretrained::model::Pretrained;
use ringtmp_pretrained::template::{ChatMessage, ChatTemplate};
use ringtmp_pretrained::vocabulary::Vocabulary;

use crate::error::UsageError;

/// A pretrained model and its vocabulary.
pub struct Opened {
    /// The model's files.
    pub model: Pretrained,
    /// Its tokenizer, framing tokens and template.
    pub vocabulary: Vocabulary,
}

/// Opens `path` (a `.gguf` file or a model directory): its architecture and tensor table.
pub fn open_model(path: &Path) -> anyhow::Result<Pretrained> {
    if !path.exists() {
        return Err(UsageError(format!(
            "--pretrained {}: no such file or directory",
            path.display()
        ))
        .into());
    }
    Ok(Pretrained::open(path).map_err(|e| UsageError(format!("--pretrained {e}")))?)
}

/// Opens `path` (a `.gguf` file or a model directory) and its vocabulary.
pub fn open(path: &Path) -> anyhow::Result<Opened> {
    let model = open_model(path)?;
    let vocabulary = model
        .vocabulary()
        .map_err(|e| UsageError(format!("--pretrained {e}")))?;
    let tokens = vocabulary.tokenizer.get_vocab_size(true);
    if tokens > model.config.vocab {
        return Err(UsageError(format!(
            "--pretrained {}: its tokenizer has {tokens} tokens but the model's embedding {} rows",
            path.display(),
            model.config.vocab
        ))
        .into());
    }
    Ok(Opened { model, vocabulary })
}

impl Opened {
    /// The ids of `--chat MESSAGE` (after `--system TEXT` when given) rendered by the model's
    /// chat template with the assistant's turn opened.
    pub fn chat_prompt(&self, message: &str, system: Option<&str>) -> anyhow::Result<Vec<u32>> {
        chat_ids(&self.vocabulary, message, system, self.model.path())
    }

    /// The ids of `--prompt TEXT`, framed as the model frames a sequence (BOS first where it
    /// asks for one).
    pub fn text_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut ids = self.encode(text, true)?;
        if let (true, Some(bos)) = (self.vocabulary.add_bos, self.vocabulary.bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// `--prompt-ids`, checked against the vocabulary.
    pub fn checked_ids(&self, ids: &[u32]) -> anyhow::Result<Vec<u32>> {
        let vocab = self.model.config.vocab;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(UsageError(format!(
                "--prompt-ids: id {bad} is past the model's vocabulary of {vocab}"
            ))
            .into());
        }
        Ok(ids.to_vec())
    }

    fn encode(&self, text: &str, special: bool) -> anyhow::Result<Vec<u32>> {
        let encoding = self
            .vocabulary
            .tokenizer
            .encode(text, special)
            .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }
}

/// The ids of `message` (after `system` when given) rendered by `vocabulary`'s chat template
/// with the assistant's turn opened (`path` names the model in errors).
pub fn chat_ids(
    vocabulary: &Vocabulary,
    message: &str,
    system: Option<&str>,
    path: &Path,
) -> anyhow::Result<Vec<u32>> {
    let path = path.display();
    let source = vocabulary.chat_template.as_deref().ok_or_else(|| {
        UsageError(format!(
            "--chat: {path} has no chat template (give the text to continue with --prompt)"
        ))
    })?;
    let token_text = |id: Option<u32>| {
        id.and_then(|i| vocabulary.tokenizer.id_to_token(i))
            .unwrap_or_default()
    };
    let template = ChatTemplate::new(
        source,
        &token_text(vocabulary.bos),
        &token_text(vocabulary.stop.first().copied()),
    )
    .map_err(|e| UsageError(format!("{path}: its chat template does not compile: {e}")))?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: system.into(),
        });
    }
    messages.push(ChatMessage {
        role: "user".into(),
        content: message.into(),
    });
    let text = template
        .render(&messages, true, &serde_json::Map::new())
        .map_err(|e| UsageError(format!("{path}: its chat template fails to render: {e}")))?;
    // The template writes the framing tokens itself (apply_chat_template adds none).
    let encoding = vocabulary
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    Ok(encoding.get_ids().to_vec())
}

/// The run directory of the checkpoint `path` names (a checkpoint directory, a run's
/// `checkpoints/` or the run itself) and the vocabulary it kept from a pretrained model;
/// `None` for a run that kept none.
pub fn run_of(path: &Path) -> anyhow::Result<Option<(std::path::PathBuf, Vocabulary)>> {
    for run in path.ancestors().take(3) {
        if let Some(vocabulary) = read_run_vocabulary(run)? {
            return Ok(Some((run.to_path_buf(), vocabulary)));
        }
    }
    Ok(None)
}

/// How a pretrained model samples unless told otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingDefaults {
    /// 0: the most likely token.
    pub temperature: f32,
    /// 0: all.
    pub top_k: usize,
    /// 1: all.
    pub top_p: f32,
}

/// The sampling `generation_config.json` beside a model directory's weights states:
/// `do_sample` with its `temperature`, `top_k` and `top_p` (`transformers`' defaults 1, 50 and 1
/// for those it leaves out), or the most likely token where it does not sample (and for a GGUF
/// file, which has no such file).
pub fn sampling_defaults(path: &Path) -> SamplingDefaults {
    let greedy = SamplingDefaults {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };
    let Some(config) = std::fs::read_to_string(path.join("generation_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return greedy;
    };
    if config.get("do_sample").and_then(serde_json::Value::as_bool) != Some(true) {
        return greedy;
    }
    let number = |key: &str, default: f64| {
        config
            .get(key)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(default)
    };
    SamplingDefaults {
        temperature: number("temperature", 1.0) as f32,
        top_k: number("top_k", 50.0) as usize,
        top_p: number("top_p", 1.0) as f32,
    }
}

/// What a run from a pretrained model keeps of its vocabulary beside its checkpoints, so that
/// `generate --checkpoint` reads and chats as the model did: `tokenizer.json` (the model
/// directory's bytes, or the GGUF file's tokenizer serialised: the bytes whose SHA-256 the
/// checkpoints' vocabulary names), `chat_template.jinja` when the model has one, and
/// `vocabulary.json` (the base model, its framing and stop tokens).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct RunVocabulary {
    /// The pretrained model the run started from.
    pub base: std::path::PathBuf,
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// Whether a sequence starts with BOS that the tokenizer does not add.
    pub add_bos: bool,
    /// The tokens generation stops at.
    pub stop: Vec<u32>,
    /// The base model's context (positions).
    #[serde(default)]
    pub context: Option<usize>,
}

/// Writes the run's vocabulary files (see [`RunVocabulary`]) into `out`; nothing for a model
/// without a tokenizer (trained on token ids).
pub fn write_run_vocabulary(out: &Path, base: &Path) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let model = open_model(base)?;
    let Ok(vocabulary) = model.vocabulary() else {
        return Ok(());
    };
    let opened = Opened { model, vocabulary };
    let tokenizer = out.join("tokenizer.json");
    if base.is_dir() {
        std::fs::copy(base.join("tokenizer.json"), &tokenizer)
            .with_context(|| format!("writing {}", tokenizer.display()))?;
    } else {
        let json = opened
            .vocabulary
            .tokenizer
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))?;
        std::fs::write(&tokenizer, json)
            .with_context(|| format!("writing {}", tokenizer.display()))?;
    }
    if let Some(template) = &opened.vocabulary.chat_template {
        let path = out.join("chat_template.jinja");
        std::fs::write(&path, template).with_context(|| format!("writing {}", path.display()))?;
    }
    let info = RunVocabulary {
        base: base.to_path_buf(),
        bos: opened.vocabulary.bos,
        add_bos: opened.vocabulary.add_bos,
        stop: opened.vocabulary.stop.clone(),
        context: Some(opened.model.config.context),
    };
    let path = out.join("vocabulary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&info)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The vocabulary a run from a pretrained model kept (`run` is its output directory), as
/// [`Opened`]'s vocabulary; `None` when the run kept none.
pub fn read_run_vocabulary(run: &Path) -> anyhow::Result<Option<Vocabulary>> {
    let info_path = run.join("vocabulary.json");
    let Ok(text) = std::fs::read_to_string(&info_path) else {
        return Ok(None);
    };
    let info: RunVocabulary = serde_json::from_str(&text)
        .map_err(|e| UsageError(format!("{}: {e}", info_path.display())))?;
    let tokenizer_path = run.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| UsageError(format!("{}: {e}", tokenizer_path.display())))?;
    let chat_template = std::fs::read_to_string(run.join("chat_template.jinja")).ok();
    Ok(Some(Vocabulary {
        tokenizer,
        bos: info.bos,
        stop: info.stop,
        add_bos: info.add_bos,
        chat_template,
    }))
}

/// What the run of the checkpoint `path` names (a checkpoint directory, a run's
/// `checkpoints/` or the run itself) kept in its `vocabulary.json` (the base model, its framing
/// tokens and context), without reading its tokenizer; `None` for a run that kept none.
pub fn run_info(path: &Path) -> Option<RunVocabulary> {
    path.ancestors().take(3).find_map(|run| {
        let text = std::fs::read_to_string(run.join("vocabulary.json")).ok()?;
        serde_json::from_str(&text).ok()
    })
}
