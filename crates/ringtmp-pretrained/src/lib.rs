//! `ringtmp-pretrained`: reading the files pretrained models are published in, so a model
//! trained elsewhere can be run, fine-tuned and written back.
//!
//! - [`config`]: a pretrained model's architecture, from either file, in one typed description.
//! - [`gguf`]: GGUF files (versions 2 and 3): the metadata, the tensor table, and every tensor
//!   dequantised to f32 as the `gguf` package and ggml's reference code do it, bit for bit.
//! - [`held`]: a model's weights held for inference as the file gives them (bf16, 8- and
//!   4-bit blocks) or converted on load (`--weights-dtype`).
//! - [`hf`]: Hugging Face model directories: `config.json` and the weights in one
//!   safetensors file or shards named by `model.safetensors.index.json`, f32, f16 or bf16.
//! - [`model`]: a pretrained model as a chain of layers, and its weights read into the stages
//!   that hold them.
//! - [`template`]: chat templates (Jinja) rendered as `transformers` renders them.
//! - [`vocabulary`]: a model's tokenizer, its framing tokens and its template, from either.
//!
//! Invariant: nothing read from a file is trusted — every length and offset is checked against
//! the file before anything is allocated or read, and a bad file is a typed error
//! ([`gguf::GgufError`], [`hf::HfError`]) naming the file and what was wrong, never a panic.

pub mod config;
pub mod gguf;
pub mod held;
pub mod hf;
pub mod model;
pub mod template;
pub mod vocabulary;
