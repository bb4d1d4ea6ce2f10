//! Text for language models: a corpus read into token ids, the vocabulary that made them, and
//! windows of `seq_len + 1` tokens — a model's inputs and, shifted by one, their next-token
//! targets — drawn by a seeded sampler.
//!
//! Three sources:
//! - **UTF-8 text** (one or several files, raw or `.gz`): a character vocabulary built from the
//!   training split (the first `1 − validation` of the characters), sorted by code point, so the
//!   same text always gives the same ids. A character of the validation split that the training
//!   split lacks is an error naming it and its place: the model could never predict it.
//! - **UTF-8 text and a `tokenizer.json`** (Hugging Face's format; GPT-2's byte-level BPE, or one
//!   [`train_byte_level_bpe`] makes): each split encoded on its own; the vocabulary is the
//!   tokenizer's size and the SHA-256 of its file.
//! - **Pre-tokenised `.bin` files**: nanoGPT's layout (little-endian `u16` ids, nothing else) or
//!   llm.c's (a header of 256 little-endian `i32`: magic 20240520, version 1, the token count;
//!   then `u16` ids). Their vocabulary is a size (GPT-2's 50,257 by default); an id at or past it
//!   is an error naming the file and the token's position.
//!
//! Invariants: every id in a split is below the vocabulary's size; a window's start leaves room
//! for its `seq_len` inputs and the target after the last (`start + seq_len < len`); every
//! window of the training split is an example (`Split::every_window`), drawn by the run's seeded
//! `BatchPlan` like an image, so every process and a resumed run draw the same ones without
//! communicating; the validation windows are fixed (contiguous, non-overlapping, from the split's
//! start), so validation losses of different runs compare.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// GPT-2's vocabulary size: the default for `.bin` files (nanoGPT's OpenWebText and
/// Shakespeare-BPE preparations).
pub const GPT2_VOCAB: usize = 50_257;

/// llm.c's `.bin` header: 256 `i32`, of which the first three are the magic, the version and the
/// token count.
const LLMC_MAGIC: i32 = 20_240_520;
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// The bundled corpus's text: its file name and the SHA-256 of its (uncompressed) content.
pub const SHAKESPEARE: (&str, &str) = (
    "shakespeare.txt",
    "d5bf167794872ce98da053751709efb6ef7638efee765516cb28c79e89592378",
);

/// How token ids map to text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Vocabulary {
    /// One token per character: id `i` is `chars[i]` (sorted by code point).
    Chars(Vec<char>),
    /// Ids from a tokenizer elsewhere (a `.bin` file): only the size is known here.
    Ids {
        /// Number of ids.
        size: usize,
    },
    /// Ids from a `tokenizer.json` (byte-level BPE, or any model the `tokenizers` crate reads):
    /// its size and the SHA-256 of the file, which names it.
    Tokenizer {
        /// Number of ids (added tokens included).
        size: usize,
        /// SHA-256 of the `tokenizer.json`.
        sha256: String,
    },
}

impl Vocabulary {
    /// Number of token ids.
    pub fn len(&self) -> usize {
        match self {
            Self::Chars(chars) => chars.len(),
            Self::Ids { size } | Self::Tokenizer { size, .. } => *size,
        }
    }

    /// Whether it has no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The text of token ids (characters; `None` for a vocabulary of bare ids or an id past it).
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        match self {
            Self::Chars(chars) => ids
                .iter()
                .map(|&i| chars.get(i as usize).copied())
                .collect(),
            Self::Ids { .. } | Self::Tokenizer { .. } => None,
        }
    }

    /// The ids of `text`, or the first character the vocabulary lacks (with its character
    /// position).
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, (char, usize)> {
        let Self::Chars(chars) = self else {
            return Err(text.chars().next().map_or(('\0', 0), |c| (c, 0)));
        };
        text.chars()
            .enumerate()
            .map(|(at, c)| {
                chars
                    .binary_search(&c)
                    .map(|i| i as u32)
                    .map_err(|_| (c, at))
            })
            .collect()
    }

    /// The vocabulary as one line of text to store with a run and its checkpoints:
    /// `chars:` and the characters, or `ids:` and the size.
    pub fn to_line(&self) -> String {
        match self {
            Self::Chars(chars) => {
                let escaped: String = chars
                    .iter()
                    .map(|c| match c {
                        '\\' => "\\\\".to_string(),
                        '\n' => "\\n".to_string(),
                        '\r' => "\\r".to_string(),
                        '\t' => "\\t".to_string(),
                        c => c.to_string(),
                    })
                    .collect();
                format!("chars:{escaped}")
            }
            Self::Ids { size } => format!("ids:{size}"),
            Self::Tokenizer { size, sha256 } => format!("tokenizer:{sha256}:{size}"),
        }
    }

    /// Reads what [`Vocabulary::to_line`] wrote (`what` names where it came from in errors).
    pub fn from_line(line: &str, what: &str) -> Result<Self> {
        let bad = |reason: String| Error::Batching(format!("{what}: {reason}"));
        if let Some(size) = line.strip_prefix("ids:") {
            let size: usize = size
                .trim()
                .parse()
                .map_err(|_| bad(format!("vocabulary size {size:?} is not a number")))?;
            return Ok(Self::Ids { size });
        }
        if let Some(rest) = line.strip_prefix("tokenizer:") {
            let (sha256, size) = rest
                .rsplit_once(':')
                .ok_or_else(|| bad("a tokenizer vocabulary is `tokenizer:SHA256:SIZE`".into()))?;
            let size: usize = size
                .trim()
                .parse()
                .map_err(|_| bad(format!("vocabulary size {size:?} is not a number")))?;
            return Ok(Self::Tokenizer {
                size,
                sha256: sha256.to_string(),
            });
        }
        let Some(escaped) = line.strip_prefix("chars:") else {
            return Err(bad(
                "a vocabulary starts with `chars:`, `ids:` or `tokenizer:`".into(),
            ));
        };
        let mut chars = Vec::new();
        let mut it = escaped.chars();
        while let Some(c) = it.next() {
            chars.push(match c {
                '\\' => match it.next() {
                    Some('\\') => '\\',
                    Some('n') => '\n',
                    Some('r') => '\r',
                    Some('t') => '\t',
                    other => return Err(bad(format!("unknown escape \\{other:?}"))),
                },
                c => c,
            });
        }
        if chars.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("the characters are not sorted and distinct".into()));
        }
        Ok(Self::Chars(chars))
    }

    /// Checks that a checkpoint's vocabulary (`self`) is the data's: the same ids for the same
    /// text. Names the first difference.
    pub fn check_matches(&self, data: &Vocabulary) -> std::result::Result<(), String> {
        match (self, data) {
            (Self::Chars(a), Self::Chars(b)) => {
                if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                    return Err(format!(
                        "the checkpoint's vocabulary of {} characters and the data's of {} differ \
                         at id {i} ({} against {})",
                        a.len(),
                        b.len(),
                        a.get(i).map_or("none".into(), |c| format!("{c:?}")),
                        b.get(i).map_or("none".into(), |c| format!("{c:?}"))
                    ));
                }
                Ok(())
            }
            (Self::Ids { size: a }, Self::Ids { size: b }) if a == b => Ok(()),
            (Self::Tokenizer { size: a, sha256: x }, Self::Tokenizer { size: b, sha256: y })
                if a == b && x == y =>
            {
                Ok(())
            }
            (a, b) => Err(format!(
                "the checkpoint's vocabulary ({}) is not the data's ({})",
                a.describe(),
                b.describe()
            )),
        }
    }

    /// Whether `tokenizer` (a tokenizer file's vocabulary) spells this one's ids: the same
    /// file, whose tokens are all of this vocabulary's ids or its first ones (a pretrained
    /// model's embedding may have rows past its tokenizer's).
    pub fn is_spelled_by(&self, tokenizer: &Self) -> bool {
        match (self, tokenizer) {
            (Self::Tokenizer { size: a, sha256: x }, Self::Tokenizer { size: b, sha256: y }) => {
                x == y && b <= a
            }
            (a, b) => a == b,
        }
    }

    /// In words, for messages.
    pub fn describe(&self) -> String {
        match self {
            Self::Chars(c) => format!("{} characters", c.len()),
            Self::Ids { size } => format!("{size} token ids"),
            Self::Tokenizer { size, sha256 } => {
                format!("{size} token ids of the tokenizer.json whose SHA-256 is {sha256}")
            }
        }
    }
}

/// One split's tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    ids: Vec<u32>,
}

impl Tokens {
    /// Tokens in the split.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the split is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Windows of `seq_len` inputs (and a target after the last) that fit: their starts are
    /// `0..windows(seq_len)`.
    pub fn windows(&self, seq_len: usize) -> usize {
        self.ids.len().saturating_sub(seq_len)
    }

    /// Writes the windows starting at `starts`: inputs `[starts.len(), seq_len]` as `f32` ids
    /// (exact below 2^24) into `x`, and each input's next token into `y`, reusing their
    /// allocations.
    ///
    /// # Panics
    /// If a window does not fit (starts come from the training split's windows or
    /// [`Tokens::validation_starts`]).
    pub fn gather(&self, starts: &[u32], seq_len: usize, x: &mut Vec<f32>, y: &mut Vec<u32>) {
        x.clear();
        y.clear();
        for &s in starts {
            let s = s as usize;
            let window = &self.ids[s..s + seq_len + 1];
            x.extend(window[..seq_len].iter().map(|&t| t as f32));
            y.extend_from_slice(&window[1..]);
        }
    }

    /// The fixed validation windows: contiguous and non-overlapping from the split's start, at
    /// most `most` of them.
    pub fn validation_starts(&self, seq_len: usize, most: usize) -> Vec<u32> {
        let fit = self.windows(seq_len).div_ceil(seq_len.max(1));
        (0..fit.min(most))
            .map(|k| (k * seq_len.max(1)) as u32)
            .collect()
    }
}

/// A corpus ready to train on.
#[derive(Clone, Debug)]
pub struct TextCorpus {
    /// How ids map to text.
    pub vocab: Vocabulary,
    /// The training split.
    pub train: Tokens,
    /// The validation split.
    pub validation: Tokens,
    /// The files read, in order.
    pub files: Vec<PathBuf>,
}

impl TextCorpus {
    /// Checks that windows of `seq_len` fit both splits; names the split and file.
    pub fn check_seq_len(&self, seq_len: usize) -> Result<()> {
        if seq_len == 0 {
            return Err(Error::Batching("--seq-len must be at least 1".into()));
        }
        for (name, split) in [("training", &self.train), ("validation", &self.validation)] {
            if split.is_empty() {
                // No window length would fit: the text gave no token at all.
                return Err(Error::Batching(format!(
                    "the {name} split of {} holds no token: its text is empty, or the tokenizer \
                     makes no token of it (is it this text's tokenizer?)",
                    self.describe_files()
                )));
            }
            if split.windows(seq_len) == 0 {
                return Err(Error::Batching(format!(
                    "--seq-len {seq_len} does not fit the {name} split of {}: it holds {} \
                     token(s), and a window needs {} (its inputs and the next token)",
                    self.describe_files(),
                    split.len(),
                    seq_len + 1
                )));
            }
        }
        Ok(())
    }

    fn describe_files(&self) -> String {
        self.files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Memory a text costs per byte of the file while a tokenizer encodes it: the bytes, the
/// decoded string and the tokenizer's own copies are held at once.
const TEXT_COST_PER_BYTE: u64 = 16;

/// Memory a character-level corpus costs per byte of the file: its characters are streamed into
/// ids of 4 bytes (a character is at least a byte), and the validation split's are copied out
/// once.
const CHAR_COST_PER_BYTE: u64 = 5;

/// The most text bytes this machine can make a corpus of at `cost` bytes of memory per byte:
/// what memory is available (Linux's `MemAvailable`) divided by it; unbounded where that
/// cannot be read.
fn text_budget(cost: u64) -> u64 {
    available_memory().map_or(u64::MAX, |bytes| bytes / cost)
}

/// The memory this machine has available (Linux's `MemAvailable`), if it says.
pub(crate) fn available_memory() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    })
}

/// Reads a file, raw or gzip-compressed (by its `.gz` name), whole. Only a regular file is read
/// (a FIFO would block and a device never end), and no more than the budget of a tokenized
/// text, raw or decompressed: past it the error says how much memory the text would need.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    read_bytes_within(path, text_budget(TEXT_COST_PER_BYTE))
}

fn read_bytes_within(path: &Path, budget: u64) -> Result<Vec<u8>> {
    let mut text = BoundedText::open(path, budget, TEXT_COST_PER_BYTE)?;
    let mut bytes = Vec::new();
    text.reader
        .read_to_end(&mut bytes)
        .map_err(|e| text.io(e))?;
    text.check(bytes.len() as u64)?;
    Ok(bytes)
}

/// A text file opened for reading within a budget of bytes, raw or decompressed.
struct BoundedText {
    path: PathBuf,
    /// The text's bytes (decompressed), at most one past the budget.
    reader: Box<dyn Read>,
    budget: u64,
    /// Bytes of memory each byte of text costs (for the message past the budget).
    cost: u64,
    gzip: bool,
}

impl BoundedText {
    /// Opens `path`: a regular file only, whose size (raw) is within `budget`.
    fn open(path: &Path, budget: u64, cost: u64) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(Error::Format {
                path: path.to_path_buf(),
                offset: 0,
                reason: "not a regular file (a directory, a FIFO or a device): the text must be \
                         a file"
                    .into(),
            });
        }
        let gzip = path.extension().is_some_and(|e| e == "gz");
        let file = std::fs::File::open(path).map_err(io)?;
        let reader: Box<dyn Read> = if gzip {
            Box::new(flate2::read::GzDecoder::new(file).take(budget.saturating_add(1)))
        } else {
            Box::new(std::io::BufReader::new(file).take(budget.saturating_add(1)))
        };
        let text = Self {
            path: path.to_path_buf(),
            reader,
            budget,
            cost,
            gzip,
        };
        if !gzip && meta.len() > budget {
            return Err(text.too_large());
        }
        Ok(text)
    }

    fn io(&self, source: std::io::Error) -> Error {
        Error::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Refuses a text of `read` bytes past the budget.
    fn check(&self, read: u64) -> Result<()> {
        if read > self.budget {
            return Err(self.too_large());
        }
        Ok(())
    }

    fn too_large(&self) -> Error {
        let what = if self.gzip {
            "it decompresses to"
        } else {
            "it holds"
        };
        Error::Format {
            path: self.path.clone(),
            offset: 0,
            reason: format!(
                "{what} more than {} bytes of text, which would need about {} MiB of memory \
                 ({} bytes per byte of text) beyond what this machine has available; use a \
                 token file (.bin) or a smaller text",
                self.budget,
                self.budget.saturating_mul(self.cost) >> 20,
                self.cost
            ),
        }
    }
}

/// Reads UTF-8 text from `files` (concatenated in order) and makes a character-level corpus:
/// the last `validation` of the characters validate. Returns it and, per file, the SHA-256 of
/// its text. The text is streamed: what is held is each character's id (4 bytes), never the
/// text itself.
pub fn load_text(files: &[PathBuf], validation: f64) -> Result<(TextCorpus, Vec<String>)> {
    load_text_within(files, validation, text_budget(CHAR_COST_PER_BYTE))
}

fn load_text_within(
    files: &[PathBuf],
    validation: f64,
    budget: u64,
) -> Result<(TextCorpus, Vec<String>)> {
    if files.is_empty() {
        return Err(Error::Batching(
            "--dataset text needs --data-file FILE (one or several)".into(),
        ));
    }
    if !(validation > 0.0 && validation < 1.0) {
        return Err(Error::Batching(format!(
            "the validation fraction must be in (0, 1), got {validation}"
        )));
    }
    // Ids in order of first appearance while streaming; sorted into the vocabulary's at the end.
    let mut seen = CharIds::default();
    let raw: u64 = files
        .iter()
        .filter(|f| f.extension().is_none_or(|e| e != "gz"))
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    // A character is at least a byte: a raw text's ids fit its size (no growth, no copy).
    let mut ids: Vec<u32> = Vec::with_capacity(raw.min(budget) as usize);
    let mut hashes = Vec::new();
    for path in files {
        let hash = stream_chars(path, budget, &mut |c| {
            let id = seen.id(c, ids.len() as u64);
            ids.push(id);
        })?;
        hashes.push(hash);
    }
    let cut = ((ids.len() as f64) * (1.0 - validation)).floor() as usize;
    // Too short to split is its own error, not a character "in the validation split only".
    if cut < 2 || cut >= ids.len() {
        return Err(Error::Inconsistent {
            dataset: "text".into(),
            reason: format!(
                "the text has {} character(s): too short for a training split and a validation \
                 split of {:.0}% (each needs at least a window of text)",
                ids.len(),
                validation * 100.0
            ),
        });
    }
    if let Some((c, at)) = seen.first_at_or_after(cut as u64) {
        return Err(Error::Inconsistent {
            dataset: "text".into(),
            reason: format!(
                "character {c:?} (U+{:04X}) at character {at} of the text is in the validation \
                 split only: the training split never shows it, so the model could not predict \
                 it (move the split with the validation fraction, or remove it)",
                c as u32
            ),
        });
    }
    let (vocab, sorted) = seen.sorted();
    ids.iter_mut().for_each(|id| *id = sorted[*id as usize]);
    let valid = ids.split_off(cut);
    let corpus = TextCorpus {
        train: Tokens { ids },
        validation: Tokens { ids: valid },
        vocab: Vocabulary::Chars(vocab),
        files: files.to_vec(),
    };
    Ok((corpus, hashes))
}

/// Characters numbered in order of first appearance, with where each first appeared.
struct CharIds {
    /// ASCII's ids by code (`u32::MAX`: not seen yet): most characters of most texts, looked up
    /// without hashing.
    ascii: [u32; 128],
    ids: std::collections::HashMap<char, u32>,
    /// Per id: the character and the position of its first appearance.
    chars: Vec<(char, u64)>,
}

impl Default for CharIds {
    fn default() -> Self {
        Self {
            ascii: [u32::MAX; 128],
            ids: std::collections::HashMap::new(),
            chars: Vec::new(),
        }
    }
}

impl CharIds {
    fn id(&mut self, c: char, at: u64) -> u32 {
        let next = self.chars.len() as u32;
        if let Some(slot) = self.ascii.get_mut(c as usize) {
            if *slot == u32::MAX {
                *slot = next;
                self.chars.push((c, at));
            }
            return *slot;
        }
        *self.ids.entry(c).or_insert_with(|| {
            self.chars.push((c, at));
            next
        })
    }

    /// The first character that first appears at or after position `at`.
    fn first_at_or_after(&self, at: u64) -> Option<(char, u64)> {
        self.chars.iter().find(|(_, first)| *first >= at).copied()
    }

    /// The vocabulary (sorted characters), and each appearance id's place in it.
    fn sorted(&self) -> (Vec<char>, Vec<u32>) {
        let mut vocab: Vec<char> = self.chars.iter().map(|(c, _)| *c).collect();
        vocab.sort_unstable();
        let place = self
            .chars
            .iter()
            .map(|(c, _)| vocab.binary_search(c).expect("in the vocabulary") as u32)
            .collect();
        (vocab, place)
    }
}

/// Streams the UTF-8 characters of `path` (raw or `.gz`, within `budget` bytes) to `each` and
/// returns the SHA-256 of its bytes. An empty file, or bytes that are not UTF-8 (the byte and
/// its line named), are errors.
fn stream_chars(path: &Path, budget: u64, each: &mut dyn FnMut(char)) -> Result<String> {
    let mut text = BoundedText::open(path, budget, CHAR_COST_PER_BYTE)?;
    let bad = |offset: u64, reason: String| Error::Format {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    let mut hash = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    // Bytes of a character split between two reads, carried to the next.
    let mut carried = 0usize;
    let (mut offset, mut lines) = (0u64, 0u64);
    loop {
        let read = text
            .reader
            .read(&mut buffer[carried..])
            .map_err(|e| text.io(e))?;
        let filled = carried + read;
        if read == 0 {
            if carried > 0 {
                return Err(bad(
                    offset,
                    format!(
                        "not UTF-8 text: the file ends inside a character (line {})",
                        lines + 1
                    ),
                ));
            }
            break;
        }
        hash.update(&buffer[carried..filled]);
        let chunk = &buffer[..filled];
        let valid = match std::str::from_utf8(chunk) {
            Ok(s) => s,
            Err(e) if e.error_len().is_none() => {
                std::str::from_utf8(&chunk[..e.valid_up_to()]).expect("valid up to there")
            }
            Err(e) => {
                let at = e.valid_up_to();
                let before = chunk[..at].iter().filter(|&&b| b == b'\n').count() as u64;
                return Err(bad(
                    offset + at as u64,
                    format!(
                        "not UTF-8 text: byte 0x{:02x} (line {}) does not start or continue a \
                         character",
                        chunk[at],
                        lines + before + 1
                    ),
                ));
            }
        };
        valid.chars().for_each(&mut *each);
        let used = valid.len();
        lines += valid.bytes().filter(|&b| b == b'\n').count() as u64;
        offset += used as u64;
        text.check(offset)?;
        buffer.copy_within(used..filled, 0);
        carried = filled - used;
    }
    if offset == 0 {
        return Err(bad(0, "the file is empty".into()));
    }
    Ok(hex::encode(hash.finalize()))
}

/// Reads UTF-8 text from `files`, concatenated in order, with the SHA-256 of each file's text.
fn read_texts(files: &[PathBuf]) -> Result<(String, Vec<String>)> {
    let mut text = String::new();
    let mut hashes = Vec::new();
    for path in files {
        let bytes = read_bytes(path)?;
        if bytes.is_empty() {
            return Err(Error::Format {
                path: path.clone(),
                offset: 0,
                reason: "the file is empty".into(),
            });
        }
        hashes.push(hex::encode(Sha256::digest(&bytes)));
        match std::str::from_utf8(&bytes) {
            Ok(s) => text.push_str(s),
            Err(e) => {
                let at = e.valid_up_to();
                return Err(Error::Format {
                    path: path.clone(),
                    offset: at as u64,
                    reason: format!(
                        "not UTF-8 text: byte 0x{:02x} (line {}) does not start or continue a \
                         character",
                        bytes[at],
                        bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1
                    ),
                });
            }
        }
    }
    Ok((text, hashes))
}

/// Reads UTF-8 text from `files` and encodes it with the tokenizer in `tokenizer` (a
/// `tokenizer.json`, as Hugging Face's `tokenizers` writes it: GPT-2's byte-level BPE, say):
/// the last `validation` of the characters validate, each split encoded on its own. Returns the
/// corpus and, per file, the SHA-256 of its text.
pub fn load_text_with_tokenizer(
    files: &[PathBuf],
    validation: f64,
    tokenizer: &Path,
) -> Result<(TextCorpus, Vec<String>)> {
    if files.is_empty() {
        return Err(Error::Batching(
            "--dataset text needs --data-file FILE (one or several)".into(),
        ));
    }
    if !(validation > 0.0 && validation < 1.0) {
        return Err(Error::Batching(format!(
            "the validation fraction must be in (0, 1), got {validation}"
        )));
    }
    let (model, sha256) = read_tokenizer(tokenizer)?;
    let bad = |reason: String| Error::Format {
        path: tokenizer.to_path_buf(),
        offset: 0,
        reason,
    };
    let size = id_count(tokenizer, &model)?;
    let (text, hashes) = read_texts(files)?;
    let chars = text.chars().count();
    let cut_chars = ((chars as f64) * (1.0 - validation)).floor() as usize;
    let cut = text
        .char_indices()
        .nth(cut_chars)
        .map_or(text.len(), |(at, _)| at);
    let encode = |part: &str| -> Result<Tokens> {
        let encoding = model
            .encode(part, false)
            .map_err(|e| bad(format!("cannot encode the text: {e}")))?;
        let ids = encoding.get_ids().to_vec();
        if let Some(i) = ids.iter().position(|&t| t as usize >= size) {
            return Err(bad(format!(
                "it gave id {} (token {i}), past its own vocabulary of {size}",
                ids[i]
            )));
        }
        Ok(Tokens { ids })
    };
    let corpus = TextCorpus {
        train: encode(&text[..cut])?,
        validation: encode(&text[cut..])?,
        vocab: Vocabulary::Tokenizer { size, sha256 },
        files: files.to_vec(),
    };
    Ok((corpus, hashes))
}

/// The tokenizer at `path` and the SHA-256 that names it: a `tokenizer.json` (the hash of the
/// file), a pretrained model's directory (its `tokenizer.json`) or a `.gguf` file (the
/// tokenizer its metadata holds, built as `transformers` builds it; the hash of its JSON
/// serialisation, the same wherever it is built).
pub fn read_tokenizer(path: &Path) -> Result<(tokenizers::Tokenizer, String)> {
    let bad = |reason: String| Error::Format {
        path: path.to_path_buf(),
        offset: 0,
        reason,
    };
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let file = ringtmp_pretrained::gguf::Gguf::open(path).map_err(|e| bad(e.to_string()))?;
        let vocabulary = file.vocabulary().map_err(|e| bad(e.to_string()))?;
        let json = vocabulary
            .tokenizer
            .to_string(false)
            .map_err(|e| bad(format!("its tokenizer does not serialise: {e}")))?;
        let sha256 = hex::encode(Sha256::digest(json.as_bytes()));
        return Ok((vocabulary.tokenizer, sha256));
    }
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&file).map_err(|source| Error::Io {
        path: file.clone(),
        source,
    })?;
    let model = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        bad(format!(
            "not a tokenizer.json the tokenizers crate reads: {e}"
        ))
    })?;
    Ok((model, hex::encode(Sha256::digest(&bytes))))
}

/// How many token ids the text of `tokenizer` (read from `path`) is drawn from: its own size,
/// or for a pretrained model's files the rows of its embedding where they are more — models pad
/// their tables past their tokenizers (Qwen 2.5's 151,936 rows for 151,665 tokens), and a run
/// on them predicts over every row as `transformers` does.
fn id_count(path: &Path, tokenizer: &tokenizers::Tokenizer) -> Result<usize> {
    let size = tokenizer.get_vocab_size(true);
    let pretrained = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || path.join("config.json").is_file();
    if !pretrained {
        return Ok(size);
    }
    let bad = |reason: String| Error::Format {
        path: path.to_path_buf(),
        offset: 0,
        reason,
    };
    let rows = ringtmp_pretrained::model::Pretrained::open(path)
        .map_err(|e| bad(e.to_string()))?
        .config
        .vocab;
    if size > rows {
        return Err(bad(format!(
            "its tokenizer has {size} tokens but the model's embedding {rows} rows"
        )));
    }
    Ok(rows)
}

/// A `tokenizer.json` opened for encoding prompts and decoding generated ids, with the
/// vocabulary it stands for (its size and the SHA-256 of its file, as a run records it).
pub struct TextTokenizer {
    model: tokenizers::Tokenizer,
    path: PathBuf,
    /// The vocabulary the file stands for.
    pub vocab: Vocabulary,
}

impl TextTokenizer {
    /// Reads the tokenizer at `path` (see [`read_tokenizer`]).
    pub fn open(path: &Path) -> Result<Self> {
        let (model, sha256) = read_tokenizer(path)?;
        let vocab = Vocabulary::Tokenizer {
            size: id_count(path, &model)?,
            sha256,
        };
        Ok(Self {
            model,
            path: path.to_path_buf(),
            vocab,
        })
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.model.encode(text, false).map_err(|e| Error::Format {
            path: self.path.clone(),
            offset: 0,
            reason: format!("cannot encode the text: {e}"),
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` (an id past the vocabulary is an error naming it).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.model.decode(ids, false).map_err(|e| Error::Format {
            path: self.path.clone(),
            offset: 0,
            reason: format!("cannot decode ids: {e}"),
        })
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2's kind: bytes as its first 256 symbols, no space
/// added before the text) of `vocab_size` ids on `files` and saves it as a `tokenizer.json` at
/// `out`, for `--tokenizer`.
pub fn train_byte_level_bpe(files: &[PathBuf], vocab_size: usize, out: &Path) -> Result<()> {
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerBuilder,
    };
    let failed = |e: tokenizers::Error| Error::Batching(format!("training a tokenizer: {e}"));
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::default()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, true, true,
    ))))
    .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())))
    .build()
    .map_err(failed)?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let files = files.iter().map(|f| f.display().to_string()).collect();
    tokenizer
        .train_from_files(&mut trainer, files)
        .map_err(failed)?;
    tokenizer.save(out, false).map_err(failed)?;
    Ok(())
}

/// Reads one pre-tokenised `.bin` file (nanoGPT's bare `u16` ids, or llm.c's header and ids);
/// every id must be below `vocab`.
pub fn read_token_bin(path: &Path, vocab: usize) -> Result<Tokens> {
    let bytes = read_bytes(path)?;
    let format = |offset: usize, reason: String| Error::Format {
        path: path.to_path_buf(),
        offset: offset as u64,
        reason,
    };
    let header = |i: usize| -> Option<i32> {
        bytes
            .get(i * 4..i * 4 + 4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let body = if header(0) == Some(LLMC_MAGIC) {
        if bytes.len() < LLMC_HEADER_BYTES {
            return Err(format(
                bytes.len(),
                format!("llm.c header cut short: {LLMC_HEADER_BYTES} bytes expected"),
            ));
        }
        if header(1) != Some(1) {
            return Err(format(
                4,
                format!(
                    "llm.c version {} (only version 1, u16 tokens, is read)",
                    header(1).unwrap_or(0)
                ),
            ));
        }
        let count = header(2).unwrap_or(-1);
        let body = &bytes[LLMC_HEADER_BYTES..];
        if count < 0 || body.len() != count as usize * 2 {
            return Err(format(
                8,
                format!(
                    "the header says {count} tokens, the file holds {} bytes of them",
                    body.len()
                ),
            ));
        }
        (body, LLMC_HEADER_BYTES)
    } else {
        (&bytes[..], 0)
    };
    let (body, start) = body;
    if body.is_empty() {
        return Err(format(start, "no tokens".into()));
    }
    if body.len() % 2 != 0 {
        return Err(format(
            start + body.len() - 1,
            "an odd number of bytes: tokens are u16".into(),
        ));
    }
    let ids: Vec<u32> = body
        .chunks_exact(2)
        .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
        return Err(format(
            start + 2 * i,
            format!(
                "token {i} is id {}, past the vocabulary of {vocab} (--vocab-size sets it)",
                ids[i]
            ),
        ));
    }
    Ok(Tokens { ids })
}

/// A corpus from `.bin` files: `train` and, if given, `validation` (else the last `validation`
/// fraction of `train`'s tokens).
pub fn load_token_bins(
    train: &Path,
    validation_file: Option<&Path>,
    validation: f64,
    vocab: usize,
) -> Result<TextCorpus> {
    let train_tokens = read_token_bin(train, vocab)?;
    let (train_tokens, validation_tokens, files) = match validation_file {
        Some(v) => (
            train_tokens,
            read_token_bin(v, vocab)?,
            vec![train.to_path_buf(), v.to_path_buf()],
        ),
        None => {
            if !(validation > 0.0 && validation < 1.0) {
                return Err(Error::Batching(format!(
                    "the validation fraction must be in (0, 1), got {validation}"
                )));
            }
            let cut = ((train_tokens.len() as f64) * (1.0 - validation)).floor() as usize;
            let (a, b) = train_tokens.ids.split_at(cut);
            (
                Tokens { ids: a.to_vec() },
                Tokens { ids: b.to_vec() },
                vec![train.to_path_buf()],
            )
        }
    };
    Ok(TextCorpus {
        vocab: Vocabulary::Ids { size: vocab },
        train: train_tokens,
        validation: validation_tokens,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // What is read is bounded: a FIFO or a device is refused at once (it would block or never
    // end), and a text, or a .gz's decompressed text, past the budget is refused with the
    // memory it would need, after reading no more than the budget.
    #[test]
    fn only_regular_files_within_the_budget_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let err = read_bytes(&fifo).unwrap_err().to_string();
            assert!(err.contains("not a regular file"), "{err}");
        }
        let err = read_bytes(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let text = write(dir.path(), "t.txt", &[b'a'; 10_000]);
        assert_eq!(read_bytes_within(&text, 10_000).unwrap().len(), 10_000);
        let err = read_bytes_within(&text, 9_999).unwrap_err().to_string();
        assert!(err.contains("holds more than 9999 bytes"), "{err}");
        // 1 MB of zeros in a few kB of gzip: refused once the budget is passed.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, &vec![b'z'; 1 << 20]).unwrap();
        let bomb = write(dir.path(), "bomb.txt.gz", &gz.finish().unwrap());
        let err = read_bytes_within(&bomb, 100_000).unwrap_err().to_string();
        assert!(
            err.contains("decompresses to more than 100000 bytes"),
            "{err}"
        );
        assert_eq!(read_bytes_within(&bomb, 1 << 20).unwrap().len(), 1 << 20);
    }

    /// A text is streamed into ids: characters of several bytes split between two reads come
    /// out whole, raw and gzipped alike, the ids decode to the text, a bad byte far in is named
    /// with its line, and the budget bounds what is read.
    #[test]
    fn streamed_text_decodes_to_itself_across_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = "a\n".repeat((1 << 19) - 1);
        text.push_str("xé€😀 and the end é€😀\n");
        text.push_str(&"bc\n".repeat(1000));
        let raw = write(dir.path(), "t.txt", text.as_bytes());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, text.as_bytes()).unwrap();
        let zipped = write(dir.path(), "t.txt.gz", &gz.finish().unwrap());
        for path in [&raw, &zipped] {
            let (corpus, hashes) = load_text(std::slice::from_ref(path), 0.001).unwrap();
            assert_eq!(hashes[0], hex::encode(Sha256::digest(text.as_bytes())));
            let ids: Vec<u32> = [corpus.train.ids(), corpus.validation.ids()].concat();
            assert_eq!(
                corpus.vocab.decode(&ids).unwrap(),
                text,
                "{}",
                path.display()
            );
        }
        let mut bad = text.clone().into_bytes();
        let at = bad.len() - 5;
        bad[at] = 0xff;
        let bad = write(dir.path(), "bad.txt", &bad);
        let err = load_text(&[bad], 0.1).unwrap_err().to_string();
        let line = text[..at].matches('\n').count() + 1;
        assert!(err.contains(&format!("byte 0xff (line {line})")), "{err}");
        let err = load_text_within(&[zipped], 0.1, 100_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("decompresses to more than 100000 bytes"),
            "{err}"
        );
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn characters_become_sorted_ids_and_windows_pair_inputs_with_next_tokens() {
        let tmp = tempfile::tempdir().unwrap();
        let a = write(tmp.path(), "a.txt", "hello world\n".as_bytes());
        let b = write(tmp.path(), "b.txt", "low hole, old owl".as_bytes());
        let (corpus, hashes) = load_text(&[a, b], 0.1).unwrap();
        assert_eq!(hashes.len(), 2);
        let Vocabulary::Chars(chars) = &corpus.vocab else {
            panic!()
        };
        assert!(chars.windows(2).all(|w| w[0] < w[1]), "{chars:?}");
        // 29 characters: 26 train, 3 validate ("owl" is all known characters).
        assert_eq!((corpus.train.len(), corpus.validation.len()), (26, 3));
        assert_eq!(
            corpus.vocab.decode(corpus.train.ids()).unwrap(),
            "hello world\nlow hole, old "
        );
        let (mut x, mut y) = (Vec::new(), Vec::new());
        corpus.train.gather(&[0, 6], 4, &mut x, &mut y);
        let ids = |s: &str| corpus.vocab.encode(s).unwrap();
        let as_f32 = |v: Vec<u32>| v.into_iter().map(|t| t as f32).collect::<Vec<_>>();
        assert_eq!(x, [as_f32(ids("hell")), as_f32(ids("worl"))].concat());
        assert_eq!(y, [ids("ello"), ids("orld")].concat());
        // The vocabulary's line survives newlines and backslashes.
        let line = corpus.vocab.to_line();
        assert!(!line.contains('\n'));
        assert_eq!(Vocabulary::from_line(&line, "test").unwrap(), corpus.vocab);
        let odd = Vocabulary::Chars(vec!['\t', '\n', '\\', 'é']);
        assert_eq!(Vocabulary::from_line(&odd.to_line(), "t").unwrap(), odd);
    }

    #[test]
    fn every_training_window_fits_and_validation_windows_are_fixed() {
        let tokens = std::sync::Arc::new(Tokens {
            ids: (0..100).collect(),
        });
        let train = crate::Split::every_window(std::sync::Arc::clone(&tokens), 8);
        // The 92 windows that fit, each example its own start.
        assert_eq!(train.len(), 92);
        let mut plan = crate::BatchPlan::new(train.len(), 16, 42).unwrap();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        train.gather(plan.batch(0, 3), &mut x, &mut y);
        assert_eq!((x.len(), y.len()), (16 * 8, 16 * 8));
        for (w, labels) in x.chunks(8).zip(y.chunks(8)) {
            // Ids are their positions here: the labels are the inputs shifted by one.
            assert!(w.iter().zip(labels).all(|(&a, &b)| a as u32 + 1 == b));
        }
        let v = tokens.validation_starts(8, 1000);
        assert_eq!(v.len(), 12);
        assert!(v.windows(2).all(|w| w[1] - w[0] == 8));
        assert_eq!(tokens.validation_starts(8, 5).len(), 5);
    }

    #[test]
    fn bad_text_is_an_error_naming_the_file_and_the_place() {
        let tmp = tempfile::tempdir().unwrap();
        let empty = write(tmp.path(), "empty.txt", b"");
        let e = load_text(&[empty], 0.1).unwrap_err().to_string();
        assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
        let latin1 = write(tmp.path(), "latin1.txt", b"ab\ncaf\xe9 au lait\n");
        let e = load_text(&[latin1], 0.1).unwrap_err().to_string();
        assert!(
            e.contains("latin1.txt") && e.contains("at byte 6") && e.contains("0xe9"),
            "{e}"
        );
        assert!(e.contains("line 2"), "{e}");
        let unseen = write(tmp.path(), "unseen.txt", "aaaaaaaaab".as_bytes());
        let e = load_text(&[unseen], 0.1).unwrap_err().to_string();
        assert!(e.contains("'b'") && e.contains("character 9"), "{e}");
        let missing = tmp.path().join("nope.txt");
        let e = load_text(&[missing], 0.1).unwrap_err().to_string();
        assert!(e.contains("nope.txt"), "{e}");
        let short = write(tmp.path(), "short.txt", "abcabcabcabc".as_bytes());
        let (corpus, _) = load_text(&[short], 0.5).unwrap();
        let e = corpus.check_seq_len(6).unwrap_err().to_string();
        assert!(
            e.contains("--seq-len 6") && e.contains("short.txt") && e.contains("6 token(s)"),
            "{e}"
        );
        corpus.check_seq_len(5).unwrap();
        // A text too short to split says so, not that a character is in validation only.
        let one = write(tmp.path(), "one.txt", b"a");
        let e = load_text(&[one], 0.1).unwrap_err().to_string();
        assert!(e.contains("1 character(s): too short"), "{e}");
        // Splits without a token are not blamed on --seq-len.
        let empty = TextCorpus {
            train: Tokens { ids: Vec::new() },
            ..corpus
        };
        let e = empty.check_seq_len(5).unwrap_err().to_string();
        assert!(
            e.contains("holds no token") && !e.contains("--seq-len"),
            "{e}"
        );
    }

    #[test]
    fn token_bins_in_both_layouts_and_ids_past_the_vocabulary() {
        let tmp = tempfile::tempdir().unwrap();
        let ids: Vec<u16> = (0..1000).map(|i| (i * 7 % 300) as u16).collect();
        let raw: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let nano = write(tmp.path(), "train.bin", &raw);
        let mut llmc: Vec<u8> = Vec::new();
        let mut header = [0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = 1;
        header[2] = ids.len() as i32;
        llmc.extend(header.iter().flat_map(|h| h.to_le_bytes()));
        llmc.extend(&raw);
        let llmc = write(tmp.path(), "llmc.bin", &llmc);
        let a = read_token_bin(&nano, 300).unwrap();
        let b = read_token_bin(&llmc, 300).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.ids()[..3], [0, 7, 14]);
        let corpus = load_token_bins(&nano, None, 0.1, GPT2_VOCAB).unwrap();
        assert_eq!((corpus.train.len(), corpus.validation.len()), (900, 100));
        let e = read_token_bin(&nano, 200).unwrap_err().to_string();
        // The first id ≥ 200: token 29 (29 · 7 = 203).
        assert!(
            e.contains("train.bin") && e.contains("token 29 is id 203") && e.contains("byte 58"),
            "{e}"
        );
        let e = read_token_bin(&write(tmp.path(), "odd.bin", &[1, 2, 3]), 300)
            .unwrap_err()
            .to_string();
        assert!(e.contains("odd number of bytes"), "{e}");
        let mut cut = std::fs::read(&llmc).unwrap();
        cut.truncate(LLMC_HEADER_BYTES + 10);
        let e = read_token_bin(&write(tmp.path(), "cut.bin", &cut), 300)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the header says 1000 tokens"), "{e}");
    }

    #[test]
    fn a_checkpoints_vocabulary_must_be_the_datas() {
        let a = Vocabulary::Chars(vec!['a', 'b', 'c']);
        let b = Vocabulary::Chars(vec!['a', 'c', 'd']);
        a.check_matches(&a).unwrap();
        let e = a.check_matches(&b).unwrap_err();
        assert!(e.contains("at id 1 ('b' against 'c')"), "{e}");
        let e = a.check_matches(&Vocabulary::Ids { size: 3 }).unwrap_err();
        assert!(
            e.contains("3 characters") && e.contains("3 token ids"),
            "{e}"
        );
    }

    #[test]
    fn the_bundled_shakespeare_is_the_checksummed_corpus() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../data/shakespeare")
            .join(format!("{}.gz", SHAKESPEARE.0));
        let (corpus, hashes) = load_text(&[path], 0.1).unwrap();
        assert_eq!(hashes, [SHAKESPEARE.1]);
        assert_eq!(corpus.vocab.len(), 77);
        assert_eq!(corpus.train.len() + corpus.validation.len(), 4_804_246);
        assert_eq!(corpus.validation.len(), 480_425);
    }

    /// A byte-level BPE tokenizer of 300 ids trained on `text`, saved as `tokenizer.json`.
    fn byte_level_bpe(dir: &Path, text: &str) -> PathBuf {
        let corpus = write(dir, "bpe-corpus.txt", text.as_bytes());
        let path = dir.join("tokenizer.json");
        train_byte_level_bpe(&[corpus], 300, &path).unwrap();
        path
    }

    #[test]
    fn a_tokenizer_json_encodes_each_split_and_names_itself_in_the_vocabulary() {
        let tmp = tempfile::tempdir().unwrap();
        let text = "To be, or not to be, that is the question: whether 'tis nobler in the mind \
                    to suffer the slings and arrows of outrageous fortune. "
            .repeat(30);
        let tokenizer = byte_level_bpe(tmp.path(), &text);
        let file = write(tmp.path(), "hamlet.txt", text.as_bytes());
        let (corpus, _) =
            load_text_with_tokenizer(std::slice::from_ref(&file), 0.1, &tokenizer).unwrap();
        let Vocabulary::Tokenizer { size, sha256 } = &corpus.vocab else {
            panic!("{:?}", corpus.vocab)
        };
        assert_eq!(*size, 300);
        assert_eq!(sha256.len(), 64);
        // Subwords: far fewer tokens than bytes, every id inside the vocabulary, and the two
        // splits decode back to the text.
        let tokens = corpus.train.len() + corpus.validation.len();
        assert!(
            tokens * 2 < text.len(),
            "{tokens} tokens for {} bytes",
            text.len()
        );
        let model = tokenizers::Tokenizer::from_file(&tokenizer).unwrap();
        let decoded = [&corpus.train, &corpus.validation]
            .map(|split| model.decode(split.ids(), false).unwrap())
            .concat();
        assert_eq!(decoded, text);
        // The vocabulary line round-trips and tells tokenizers apart.
        let line = corpus.vocab.to_line();
        assert_eq!(Vocabulary::from_line(&line, "t").unwrap(), corpus.vocab);
        let other = Vocabulary::Tokenizer {
            size: 300,
            sha256: "0".repeat(64),
        };
        assert!(corpus.vocab.check_matches(&other).is_err());
        // A file that is no tokenizer is an error naming it.
        let bogus = write(tmp.path(), "bogus.json", b"{\"model\": 3}");
        let e = load_text_with_tokenizer(&[file], 0.1, &bogus)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bogus.json") && e.contains("tokenizer.json"),
            "{e}"
        );
    }

    /// A pretrained model's embedding with rows past its tokenizer's: the text's ids are drawn
    /// from every row (the model predicts over all of them), the tokenizer's file alone still
    /// spells them; a tokenizer larger than the embedding is refused naming both sizes.
    #[test]
    fn a_pretrained_models_rows_past_its_tokenizer_are_ids_of_its_text() {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../benches/reference/pretrained/llama-tied");
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(tiny.join(file), model.join(file)).unwrap();
        }
        let text = "the cat sat on the mat and the dog sat on the log . ".repeat(40);
        let corpus_file = write(tmp.path(), "corpus.txt", text.as_bytes());
        // A word-level tokenizer of `size` tokens: the corpus's words, then fillers.
        let sized = |size: usize| {
            let words = [
                "[UNK]", "the", "cat", "sat", "on", "mat", "and", "dog", "log", ".",
            ];
            let vocab: serde_json::Map<String, serde_json::Value> = (0..size)
                .map(|i| {
                    let word = words.get(i).map_or(format!("w{i}"), |w| w.to_string());
                    (word, i.into())
                })
                .collect();
            let json = serde_json::json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
                "post_processor": null, "decoder": null,
                "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
            });
            std::fs::write(model.join("tokenizer.json"), json.to_string()).unwrap();
            load_text_with_tokenizer(std::slice::from_ref(&corpus_file), 0.1, &model)
        };
        let (corpus, _) = sized(20).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(corpus.vocab.len(), 160, "the embedding's rows");
        let file = TextTokenizer::open(&model.join("tokenizer.json")).unwrap();
        assert_eq!(file.vocab.len(), 20, "the file alone: its own tokens");
        assert!(corpus.vocab.is_spelled_by(&file.vocab));
        assert!(!file.vocab.is_spelled_by(&corpus.vocab));
        let e = sized(400).unwrap_err().to_string();
        assert!(e.contains("tokenizer has") && e.contains("160 rows"), "{e}");
    }
}
