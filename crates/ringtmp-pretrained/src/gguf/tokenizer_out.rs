//! A vocabulary written as GGUF metadata, as llama.cpp's converter writes a byte-level BPE
//! (`tokenizer.ggml.model = "gpt2"`) or a SentencePiece BPE with byte fallback (`"llama"`, its
//! byte pieces marked as bytes, its merges listed): the tokens in id order, padded to the embedding's rows
//! with `[PAD{id}]` tokens marked unused; each token's type (control for the special added
//! tokens, user-defined for the other added ones, normal otherwise); the merges; the
//! pre-tokenizer's kind where its split is one llama.cpp names; BOS, EOS, whether a sequence
//! starts with BOS, and the chat template.
//!
//! Invariant: what [`super::Gguf::vocabulary`] builds from the metadata encodes text to the same
//! ids as the vocabulary written (the tests check it on the shared SmolLM2 file's tokenizer and
//! a `tokenizer.json`'s).

use super::Value;
use super::tokenizer::{GPT4O_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, TEKKEN_SPLIT};
use crate::vocabulary::Vocabulary;

/// GGUF's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNKNOWN: i32 = 2;
const UNUSED: i32 = 5;
/// SentencePiece's unknown piece.
const UNKNOWN_PIECE: &str = "<unk>";
const BYTE: i32 = 6;

/// Whether `token` is a SentencePiece byte piece (`<0x0A>`).
fn is_byte_piece(token: &str) -> bool {
    token.len() == 6
        && token.starts_with("<0x")
        && token.ends_with('>')
        && token[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

/// The `tokenizer.*` metadata of `vocabulary` for a model whose embedding has `rows` rows
/// (at least the tokenizer's tokens); an error saying why for a tokenizer that is not a
/// byte-level BPE (the one kind written).
pub fn tokenizer_metadata(
    vocabulary: &Vocabulary,
    rows: usize,
) -> Result<Vec<(String, Value)>, String> {
    let json: serde_json::Value = serde_json::from_str(
        &vocabulary
            .tokenizer
            .to_string(false)
            .map_err(|e| format!("the tokenizer does not serialise: {e}"))?,
    )
    .map_err(|e| format!("the tokenizer's JSON does not parse: {e}"))?;
    let model = &json["model"];
    let sentencepiece = model["type"] == "BPE" && model["byte_fallback"] == true;
    if model["type"] != "BPE" || !(sentencepiece || json["decoder"]["type"] == "ByteLevel") {
        return Err(format!(
            "its tokenizer is a {} model decoded by {}: GGUF export writes byte-level and \
             SentencePiece BPE tokenizers",
            model["type"], json["decoder"]["type"]
        ));
    }
    let vocab = vocabulary.tokenizer.get_vocab(true);
    if vocab.len() > rows {
        return Err(format!(
            "its tokenizer has {} tokens but the model's embedding {rows} rows",
            vocab.len()
        ));
    }
    let mut tokens: Vec<Option<String>> = vec![None; rows];
    for (token, id) in vocab {
        match tokens.get_mut(id as usize) {
            Some(slot) => *slot = Some(token),
            None => return Err(format!("token {token:?} has id {id}, past {rows} rows")),
        }
    }
    let mut types = vec![NORMAL; rows];
    if sentencepiece {
        for (token, kind) in tokens.iter().zip(&mut types) {
            if token.as_deref().is_some_and(is_byte_piece) {
                *kind = BYTE;
            } else if token.as_deref() == Some(UNKNOWN_PIECE) {
                *kind = UNKNOWN;
            }
        }
    }
    for (id, added) in vocabulary.tokenizer.get_added_tokens_decoder() {
        if let Some(t) = types.get_mut(id as usize) {
            *t = if added.special { CONTROL } else { USER_DEFINED };
        }
    }
    let tokens: Vec<Value> = tokens
        .into_iter()
        .zip(&mut types)
        .enumerate()
        .map(|(id, (token, kind))| {
            Value::String(token.unwrap_or_else(|| {
                *kind = UNUSED;
                format!("[PAD{id}]")
            }))
        })
        .collect();
    let merges = merges(&model["merges"])?;
    let (kind, pre) = if sentencepiece {
        ("llama", "default")
    } else {
        ("gpt2", pre_kind(&json["pre_tokenizer"]))
    };
    let mut out = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String(kind.into()),
        ),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            Value::Bool(vocabulary.add_bos || adds_bos(vocabulary)),
        ),
    ];
    if let Some(unk) = vocabulary
        .tokenizer
        .token_to_id(UNKNOWN_PIECE)
        .filter(|_| sentencepiece)
    {
        out.push(("tokenizer.ggml.unknown_token_id".into(), Value::U32(unk)));
    }
    if let Some(bos) = vocabulary.bos {
        out.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    if let Some(&eos) = vocabulary.stop.first() {
        out.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }
    if let Some(template) = &vocabulary.chat_template {
        out.push((
            "tokenizer.chat_template".into(),
            Value::String(template.clone()),
        ));
    }
    Ok(out)
}

/// Whether the tokenizer's post-processor puts BOS first itself (GGUF's reader leaves that to
/// the caller, through `add_bos_token`).
fn adds_bos(vocabulary: &Vocabulary) -> bool {
    let first = vocabulary
        .tokenizer
        .encode("a", true)
        .ok()
        .and_then(|e| e.get_ids().first().copied());
    vocabulary.bos.is_some() && first == vocabulary.bos
}

/// A `tokenizer.json`'s merges (`"a b"` strings, or `["a", "b"]` pairs in newer files) as
/// GGUF's `"a b"` strings.
fn merges(merges: &serde_json::Value) -> Result<Vec<Value>, String> {
    let list = merges
        .as_array()
        .ok_or("the tokenizer's merges are not a list")?;
    list.iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(Value::String(s.clone())),
            serde_json::Value::Array(pair) => match &pair[..] {
                [serde_json::Value::String(a), serde_json::Value::String(b)] => {
                    Ok(Value::String(format!("{a} {b}")))
                }
                _ => Err(format!("merge {m} is not two tokens")),
            },
            _ => Err(format!("merge {m} is not two tokens")),
        })
        .collect()
}

/// llama.cpp's name of the pre-tokenizer `pre` (a `tokenizer.json`'s): the kind whose split it
/// is, `"gpt-2"` for a plain byte-level split or one llama.cpp does not name.
fn pre_kind(pre: &serde_json::Value) -> &'static str {
    let pieces: Vec<&serde_json::Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .map(|p| p.iter().collect())
            .unwrap_or_default(),
        _ => vec![pre],
    };
    let regex = pieces
        .iter()
        .find(|p| p["type"] == "Split")
        .and_then(|p| p["pattern"]["Regex"].as_str());
    match regex {
        Some(r) if r == LLAMA3_SPLIT => "llama-bpe",
        Some(r) if r == QWEN2_SPLIT => "qwen2",
        Some(r) if r == TEKKEN_SPLIT => "tekken",
        Some(r) if r == GPT4O_SPLIT => "gpt-4o",
        _ => "gpt-2",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{Gguf, GgufWriter};
    use std::path::{Path, PathBuf};

    const TEXT: &str = "Hello, world! Grüße aus Köln — 東京は晴れ 12345 <|im_start|>user\n\
                        naïve café  tabs\tand\n\nnewlines 🙂";

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// Writes `vocabulary`'s metadata into a GGUF file and builds its vocabulary back.
    fn round_trip(vocabulary: &Vocabulary, rows: usize, dir: &Path) -> Vocabulary {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .unwrap();
        for (k, v) in tokenizer_metadata(vocabulary, rows).unwrap() {
            w.metadata(&k, v).unwrap();
        }
        let path = dir.join("t.gguf");
        w.write(&path).unwrap();
        Gguf::open(&path).unwrap().vocabulary().unwrap()
    }

    /// The ids of a sequence of `TEXT` as a caller frames it (BOS first where asked for).
    fn ids(v: &Vocabulary, special: bool) -> Vec<u32> {
        let mut ids = v
            .tokenizer
            .encode(TEXT, special)
            .unwrap()
            .get_ids()
            .to_vec();
        if let (true, true, Some(bos)) = (special, v.add_bos, v.bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        ids
    }

    #[test]
    fn a_tokenizer_json_round_trips_through_gguf_metadata_to_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = repo().join("benches/reference/hf-tiny/tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&path).unwrap();
        let size = tokenizer.get_vocab_size(true);
        let vocabulary = Vocabulary {
            tokenizer,
            bos: Some(1),
            stop: vec![2],
            add_bos: false,
            chat_template: Some("{{ messages }}".into()),
        };
        // Rows past the tokenizer's are padding the reader keeps as tokens of their own.
        let back = round_trip(&vocabulary, size + 3, dir.path());
        for special in [false, true] {
            assert_eq!(ids(&back, special), ids(&vocabulary, special));
        }
        assert_eq!(back.tokenizer.get_vocab_size(true), size + 3);
        // Its post-processor puts BOS first; GGUF's reader asks the caller to.
        assert_eq!(
            (back.bos, &back.stop, back.add_bos),
            (Some(1), &vec![2], true)
        );
        assert_eq!(back.chat_template, vocabulary.chat_template);
        let e = tokenizer_metadata(&vocabulary, size - 1).unwrap_err();
        assert!(e.contains("rows"), "{e}");
    }

    #[test]
    fn a_sentencepiece_vocabulary_round_trips_to_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let file = Gguf::open(&repo().join("benches/reference/gguf/spm-tokenizer.gguf")).unwrap();
        let vocabulary = file.vocabulary().unwrap();
        let rows = vocabulary.tokenizer.get_vocab_size(true);
        let keys: std::collections::BTreeMap<String, Value> = tokenizer_metadata(&vocabulary, rows)
            .unwrap()
            .into_iter()
            .collect();
        assert!(keys["tokenizer.ggml.model"] == Value::String("llama".into()));
        for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"] {
            assert!(keys[key] == file.metadata[key], "{key}");
        }
        let back = round_trip(&vocabulary, rows, dir.path());
        for special in [false, true] {
            assert_eq!(ids(&back, special), ids(&vocabulary, special));
        }
        assert_eq!(back.tokenizer.decode(&ids(&back, true), false).unwrap(), {
            vocabulary
                .tokenizer
                .decode(&ids(&vocabulary, true), false)
                .unwrap()
        });
    }
}
