//! A model's vocabulary, whichever file it came from: the tokenizer (the `tokenizers` crate's
//! type, the one the rest of ringtmp reads text with), the tokens a sequence is framed with,
//! and the chat template.

use tokenizers::Tokenizer;

/// A model's tokenizer and the tokens its text is framed with.
pub struct Vocabulary {
    /// The tokenizer (ids are the model's).
    pub tokenizer: Tokenizer,
    /// Beginning of sequence, if the model has one.
    pub bos: Option<u32>,
    /// The tokens generation stops at (end of sequence, end of turn).
    pub stop: Vec<u32>,
    /// Whether the caller starts a sequence with BOS: the file asks for it and the tokenizer
    /// does not add it itself (a `tokenizer.json`'s post-processor does).
    pub add_bos: bool,
    /// The chat template (Jinja, as Hugging Face writes them), if the model has one.
    pub chat_template: Option<String>,
}
