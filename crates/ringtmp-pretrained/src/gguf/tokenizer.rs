//! The tokenizer a GGUF file embeds, built into the `tokenizers` crate's type — the one the rest
//! of ringtmp reads text with — as `transformers` builds it from the same file
//! (`integrations/gguf`): a byte-level BPE (`tokenizer.ggml.model = "gpt2"`) from the file's
//! tokens and merges, or a SentencePiece BPE with byte fallback (`"llama"`) from its pieces and
//! the merges their scores imply; the pre-tokenizer's split for the `tokenizer.ggml.pre` kinds whose
//! vocabularies were learned on one (Llama 3's, Qwen 2's, GPT-4o's, Tekken's), GPT-2's
//! otherwise; the tokens the file marks as control added as special tokens (never split, never
//! merged into text), the user-defined ones as plain added tokens; BOS, EOS and the chat
//! template from the metadata.
//!
//! Invariant: token ids are the file's indices; a file whose tokenizer cannot be built (a kind
//! not read, merges that name tokens not in the vocabulary) is an error naming the file.

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::{Gguf, GgufError, Value};
use crate::vocabulary::Vocabulary;

/// Llama 3's split (and the vocabularies llama.cpp files under its kinds).
pub(super) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split: digits one by one.
pub(super) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken split.
pub(super) const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's split (o200k).
pub(super) const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split of pre-tokenizer kind `pre`, where its vocabulary was learned on one other than
/// GPT-2's (the kinds `transformers` maps).
fn split_of(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" => QWEN2_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GGUF's token types.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

impl Gguf {
    /// The file's tokenizer, built as `transformers` builds it from the file.
    pub fn vocabulary(&self) -> Result<Vocabulary, GgufError> {
        let bad = |what: String| GgufError::Malformed {
            path: self.path().to_path_buf(),
            offset: 0,
            what,
        };
        if self.weights_only() {
            return Err(bad(
                "opened for its weights alone: its tokenizer was not read".into(),
            ));
        }
        let kind = self
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no tokenizer.ggml.model".into()))?;
        let tokens = strings(self.get("tokenizer.ggml.tokens"))
            .ok_or_else(|| bad("tokenizer.ggml.tokens is not a list of strings".into()))?;
        let types: Vec<i64> = match self.get("tokenizer.ggml.token_type") {
            Some(Value::Array(items)) => items.iter().map(integer).collect(),
            _ => Vec::new(),
        };
        let mut tokenizer = match kind {
            "gpt2" => self.byte_level_bpe(&tokens)?,
            "llama" => self.sentencepiece_bpe(&tokens)?,
            other => {
                return Err(bad(format!(
                    "tokenizer.ggml.model {other:?}: ringtmp builds byte-level BPE (\"gpt2\") \
                     and SentencePiece BPE (\"llama\") tokenizers"
                )));
            }
        };
        let of_type = |wanted: i64| -> Vec<&str> {
            tokens
                .iter()
                .zip(&types)
                .filter(|(_, t)| **t == wanted)
                .map(|(token, _)| *token)
                .collect()
        };
        // A control token outside the byte-level alphabet in a byte-level vocabulary is a
        // mislabel of llama.cpp's (as `transformers` skips it).
        let byte_level = kind == "gpt2";
        let special: Vec<AddedToken> = of_type(CONTROL)
            .into_iter()
            .filter(|t| !byte_level || t.chars().all(is_byte_level))
            .map(|t| AddedToken::from(t.to_string(), true).normalized(false))
            .collect();
        tokenizer.add_special_tokens(&special);
        let user: Vec<AddedToken> = of_type(USER_DEFINED)
            .into_iter()
            .map(|t| AddedToken::from(t.to_string(), false).normalized(false))
            .collect();
        tokenizer.add_tokens(&user);
        let id = |key: &str| {
            self.get(key)
                .and_then(Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| (*v as usize) < tokens.len())
        };
        // A SentencePiece vocabulary starts a sequence with BOS unless the file says otherwise
        // (llama.cpp's default, and `transformers'`).
        let add_bos = match self.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => kind == "llama",
        };
        Ok(Vocabulary {
            tokenizer,
            bos: id("tokenizer.ggml.bos_token_id"),
            stop: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            add_bos,
            chat_template: self
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    fn malformed(&self, what: String) -> GgufError {
        GgufError::Malformed {
            path: self.path().to_path_buf(),
            offset: 0,
            what,
        }
    }

    /// A byte-level BPE from the file's tokens and merges, split as its `tokenizer.ggml.pre`
    /// kind's vocabulary was learned.
    fn byte_level_bpe(&self, tokens: &[&str]) -> Result<Tokenizer, GgufError> {
        let bad = |what: String| self.malformed(what);
        let merges = strings(self.get("tokenizer.ggml.merges"))
            .ok_or_else(|| bad("tokenizer.ggml.merges is not a list of strings".into()))?;
        // A token the file spells outside the byte-level alphabet is its UTF-8 bytes, spelled in
        // it (as `transformers` reads such files).
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (byte_level_spelling(t), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| bad(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| bad(format!("its BPE does not build: {e}")))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let pre = self.get("tokenizer.ggml.pre").and_then(Value::as_str);
        let add_prefix_space = matches!(
            self.get("tokenizer.ggml.add_space_prefix"),
            Some(Value::Bool(true))
        );
        match pre.and_then(split_of) {
            Some(split) => {
                let split = Split::new(
                    SplitPattern::Regex(split.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| bad(format!("the split of {pre:?} does not compile: {e}")))?;
                tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                    split.into(),
                    ByteLevel::new(false, true, false).into(),
                ])));
            }
            None => {
                tokenizer.with_pre_tokenizer(Some(ByteLevel::new(add_prefix_space, true, true)));
            }
        }
        tokenizer.with_decoder(Some(ByteLevel::default()));
        Ok(tokenizer)
    }

    /// A SentencePiece BPE as `transformers`' `LlamaTokenizer` builds it: the file's pieces
    /// (`▁` for a space, `<0xNN>` byte pieces for what the vocabulary lacks), the merges the
    /// file lists or else those its pieces and scores imply, `▁` put before the text's start.
    fn sentencepiece_bpe(&self, tokens: &[&str]) -> Result<Tokenizer, GgufError> {
        let bad = |what: String| self.malformed(what);
        let merges = match strings(self.get("tokenizer.ggml.merges")) {
            Some(merges) => merges
                .iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| bad(format!("merge {m:?} is not two tokens")))
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let scores: Vec<f64> = match self.get("tokenizer.ggml.scores") {
                    Some(Value::Array(items)) if items.len() == tokens.len() => {
                        items.iter().map(float).collect()
                    }
                    _ => {
                        return Err(bad(
                            "a SentencePiece vocabulary needs tokenizer.ggml.merges or one \
                             tokenizer.ggml.scores per token"
                                .into(),
                        ));
                    }
                };
                merges_from_scores(tokens, &scores)
            }
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .fuse_unk(true)
            .byte_fallback(true)
            .build()
            .map_err(|e| bad(format!("its BPE does not build: {e}")))?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(Metaspace::new(SPACE, PrependScheme::First, false)));
        let replace = Replace::new(SPACE.to_string(), " ")
            .map_err(|e| bad(format!("its decoder does not build: {e}")))?;
        tokenizer.with_decoder(Some(DecoderSequence::new(vec![
            DecoderWrapper::Replace(replace),
            DecoderWrapper::ByteFallback(ByteFallback::default()),
            DecoderWrapper::Fuse(Fuse::default()),
            DecoderWrapper::Strip(Strip::new(' ', 1, 0)),
        ])));
        Ok(tokenizer)
    }
}

/// SentencePiece's space.
const SPACE: char = '\u{2581}';

/// The merges a SentencePiece vocabulary implies, as `transformers`' `generate_merges` derives
/// them from its pieces and scores: every cut of a piece into two pieces of the vocabulary
/// (cuts of one piece ordered by their pieces' ids), all ordered by the piece's score, then
/// the left and right lengths, highest first (ties keeping that order).
fn merges_from_scores(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    // A piece listed twice: its last id and score, its first place (a Python dict's).
    let mut id: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut score: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (i, (&t, &s)) in tokens.iter().zip(scores).enumerate() {
        if id.insert(t, i).is_none() {
            order.push(t);
        }
        score.insert(t, s);
    }
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for piece in order {
        let mut local: Vec<(&str, &str, f64)> = piece
            .char_indices()
            .skip(1)
            .map(|(at, _)| piece.split_at(at))
            .filter(|(l, r)| id.contains_key(l) && id.contains_key(r))
            .map(|(l, r)| (l, r, score[piece]))
            .collect();
        local.sort_by_key(|(l, r, _)| (id[l], id[r]));
        merges.extend(local);
    }
    let key = |m: &(&str, &str, f64)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (a, b) = (key(a), key(b));
        b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2))
    });
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

/// A metadata array of strings.
fn strings(value: Option<&Value>) -> Option<Vec<&str>> {
    match value {
        Some(Value::Array(items)) => items.iter().map(Value::as_str).collect(),
        _ => None,
    }
}

fn float(value: &Value) -> f64 {
    match *value {
        Value::F32(v) => v.into(),
        Value::F64(v) => v,
        _ => integer(value) as f64,
    }
}

fn integer(value: &Value) -> i64 {
    match *value {
        Value::I32(v) => v.into(),
        Value::I64(v) => v,
        _ => value
            .as_u64()
            .and_then(|v| i64::try_from(v).ok())
            .unwrap_or(0),
    }
}

/// `token` in the byte-level alphabet: itself when it is spelled in it, else its UTF-8 bytes'
/// characters.
fn byte_level_spelling(token: &str) -> String {
    if token.chars().all(is_byte_level) {
        return token.to_string();
    }
    token.bytes().map(byte_char).collect()
}

/// Byte `b`'s character in GPT-2's `bytes_to_unicode`.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|x| !printable(*x)).count() as u32;
    char::from_u32(256 + rank).expect("below 0x144")
}

/// Whether `c` is a character of the byte-level alphabet (GPT-2's `bytes_to_unicode`: the
/// printable Latin-1 characters, and 256 + the rest of the bytes).
fn is_byte_level(c: char) -> bool {
    let c = c as u32;
    (0x21..=0x7E).contains(&c)
        || (0xA1..=0xAC).contains(&c)
        || (0xAE..=0xFF).contains(&c)
        || (0x100..=0x143).contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// Each split compiles and cuts as its vocabulary's reference does (Llama 3's: numbers in
    /// threes; Qwen 2's: digits one by one).
    #[test]
    fn every_split_compiles_and_cuts_numbers_as_its_kind_does() {
        let pieces = |split: &str, text: &str| -> Vec<String> {
            let split = Split::new(
                SplitPattern::Regex(split.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .expect("compiles");
            let mut s = PreTokenizedString::from(text);
            split.pre_tokenize(&mut s).unwrap();
            s.get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(p, _, _)| p.to_string())
                .collect()
        };
        assert_eq!(
            pieces(LLAMA3_SPLIT, "x 1234567"),
            ["x", " ", "123", "456", "7"]
        );
        assert_eq!(pieces(QWEN2_SPLIT, "ab12"), ["ab", "1", "2"]);
        for split in [TEKKEN_SPLIT, GPT4O_SPLIT] {
            assert!(!pieces(split, "Hello world 42").is_empty());
        }
    }

    #[test]
    fn the_byte_level_alphabet_is_gpt2s() {
        // Space is Ġ (U+0120), newline Ċ (U+010A); printable ASCII is itself.
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(0xAD), '\u{143}');
        assert!((0..=255u8).all(|b| is_byte_level(byte_char(b))));
        assert_eq!(byte_level_spelling("é"), "é", "in the alphabet");
        assert_eq!(
            byte_level_spelling("€"),
            "âĤ¬",
            "GPT-2's spelling of its bytes"
        );
    }
}
