//! What the export of a language model carries beside its weights, so that its files alone say
//! how to use them: the vocabulary and context it reads (`recipe.json`; `encode`, `decode` and
//! `CONTEXT` in `model.py`; the `tokenizer.json` of a tokenizer's model, when given) and its
//! architecture (in the weights file's metadata under nanoGPT's names, which `--init-from`
//! checks).
//!
//! Invariant: `encode` of `model.py` gives the ids ringtmp trained on, `decode` inverts it.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use ringtmp_data::{TextTokenizer, Vocabulary};
use ringtmp_model::arch::Architecture;
use ringtmp_model::checkpoint;

use super::opened::Opened;
use crate::error::UsageError;

/// A language model's checkpoint: what the export writes of its text.
pub struct Language {
    /// Positions per window.
    pub context: usize,
    /// The ids it reads.
    pub vocabulary: Vocabulary,
    /// The tokenizer the user gave for a tokenizer's model (checked to be the run's).
    tokenizer: Option<std::path::PathBuf>,
}

impl Language {
    /// The text side of `opened`, `None` for a model that does not read tokens. `tokenizer` is
    /// the `tokenizer.json` of a model trained with one: refused when it is another.
    pub fn of(opened: &Opened, tokenizer: Option<&Path>) -> Result<Option<Self>> {
        if !opened.manifest.model.reads_tokens() {
            if let Some(t) = tokenizer {
                return Err(UsageError(format!(
                    "--tokenizer {}: model {} does not read text",
                    t.display(),
                    opened.manifest.model.name
                ))
                .into());
            }
            return Ok(None);
        }
        let Some(line) = opened.manifest.vocabulary.as_deref() else {
            return Ok(None);
        };
        let vocabulary = Vocabulary::from_line(line, &opened.dir.display().to_string())?;
        let context = opened.layers.first().map_or(0, |l| l.input.numel());
        if let Some(path) = tokenizer {
            let theirs = TextTokenizer::open(path)?.vocab;
            if theirs != vocabulary {
                return Err(UsageError(format!(
                    "--tokenizer {}: {}, but the model was trained with {}",
                    path.display(),
                    theirs.describe(),
                    vocabulary.describe()
                ))
                .into());
            }
        }
        Ok(Some(Self {
            context,
            vocabulary,
            tokenizer: tokenizer.map(Path::to_path_buf),
        }))
    }

    /// The architecture of the opened model at this context.
    pub fn architecture(&self, opened: &Opened) -> Option<Architecture> {
        Architecture::of(&opened.manifest.model, Some(self.context))
    }

    /// `recipe.json`: the vocabulary, the context and the architecture.
    pub fn recipe(&self, opened: &Opened) -> serde_json::Value {
        let vocabulary = match &self.vocabulary {
            Vocabulary::Chars(chars) => serde_json::json!({
                "kind": "characters",
                "tokens": chars.iter().map(char::to_string).collect::<Vec<_>>(),
            }),
            Vocabulary::Ids { size } => serde_json::json!({"kind": "ids", "size": size}),
            Vocabulary::Tokenizer { size, sha256 } => serde_json::json!({
                "kind": "tokenizer",
                "size": size,
                "sha256": sha256,
                "file": self.tokenizer.as_ref().map(|_| "tokenizer.json"),
            }),
        };
        let architecture: serde_json::Map<String, serde_json::Value> = self
            .architecture(opened)
            .map(|a| a.named())
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        serde_json::json!({
            "task": "next-token",
            "context": self.context,
            "vocabulary": vocabulary,
            "architecture": architecture,
        })
    }

    /// Copies the tokenizer into `out` when one was given; the files written.
    pub fn write_files(&self, out: &Path) -> Result<Vec<&'static str>> {
        let Some(path) = &self.tokenizer else {
            if let Vocabulary::Tokenizer { .. } = self.vocabulary {
                eprintln!(
                    "note: the model was trained with a tokenizer ({}); pass its file with \
                     --tokenizer for model.py's encode and decode",
                    self.vocabulary.describe()
                );
            }
            return Ok(Vec::new());
        };
        let bytes = std::fs::read(path)
            .map_err(|e| UsageError(format!("--tokenizer {}: {e}", path.display())))?;
        checkpoint::write_atomic(&out.join("tokenizer.json"), &bytes)?;
        Ok(vec!["tokenizer.json"])
    }

    /// `model.py`'s text functions: `CONTEXT`, `encode` and `decode`.
    pub fn python(&self) -> Result<String> {
        let mut py = String::new();
        writeln!(py, "\n\nCONTEXT = {}  # positions per window", self.context)?;
        match &self.vocabulary {
            Vocabulary::Chars(chars) => {
                let tokens: Vec<String> = chars.iter().map(char::to_string).collect();
                // A JSON list of strings is a Python list literal (its escapes are Python's).
                writeln!(
                    py,
                    "VOCABULARY = {}  # id i is VOCABULARY[i]",
                    serde_json::to_string(&tokens)?
                )?;
                py.push_str(CHAR_CODEC);
            }
            Vocabulary::Tokenizer { sha256, .. } if self.tokenizer.is_some() => {
                writeln!(py, "TOKENIZER_SHA256 = {sha256:?}")?;
                py.push_str(TOKENIZER_CODEC);
            }
            other => {
                writeln!(py, "VOCABULARY_SIZE = {}", other.len())?;
                writeln!(
                    py,
                    "\n\ndef encode(text):\n    raise NotImplementedError({:?})\n\n\n\
                     def decode(ids):\n    raise NotImplementedError({:?})",
                    format!(
                        "{}: encode with the tokenizer that made them",
                        other.describe()
                    ),
                    format!(
                        "{}: decode with the tokenizer that made them",
                        other.describe()
                    ),
                )?;
            }
        }
        Ok(py)
    }
}

const CHAR_CODEC: &str = r#"_IDS = {c: i for i, c in enumerate(VOCABULARY)}


def encode(text):
    """Text to token ids, one per character (as ringtmp read the training text)."""
    try:
        return [_IDS[c] for c in text]
    except KeyError as missing:
        raise ValueError(f"character {missing.args[0]!r} is not in the model's vocabulary") from None


def decode(ids):
    """Token ids to text."""
    return "".join(VOCABULARY[int(i)] for i in ids)
"#;

const TOKENIZER_CODEC: &str = r#"

def _tokenizer():
    import os
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(os.path.dirname(__file__), "tokenizer.json"))


def encode(text):
    """Text to token ids with the run's tokenizer.json (Hugging Face's `tokenizers`)."""
    return _tokenizer().encode(text, add_special_tokens=False).ids


def decode(ids):
    """Token ids to text."""
    return _tokenizer().decode([int(i) for i in ids], skip_special_tokens=False)
"#;
