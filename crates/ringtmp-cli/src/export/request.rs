//! What `ringtmp export` is asked: the checkpoint, the framework, the output, and the output's
//! check (nothing of an earlier export replaced unless asked, nothing written where it cannot
//! be), shared by every framework's writer.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::error::UsageError;

/// `ringtmp export` options.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// A checkpoint directory, or a run directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The framework to write for: pytorch (model.safetensors, model.py, recipe.json),
    /// nanogpt (nanoGPT's ckpt.pt and, for characters, meta.pkl), or hf (a Hugging Face model
    /// directory of a Llama-family model, with the run's tokenizer and chat template), or gguf
    /// (OUT is then a .gguf file; see --dtype).
    #[arg(long, value_name = "FRAMEWORK", default_value = "pytorch")]
    pub to: String,
    /// Directory to write the files into (new or without an earlier export's, unless
    /// --overwrite).
    #[arg(value_name = "OUT")]
    pub out: PathBuf,
    /// Replace the files of an earlier export in OUT.
    #[arg(long)]
    pub overwrite: bool,
    /// The tokenizer.json a language model was trained with: copied beside the weights for
    /// model.py's encode and decode (checked to be the run's).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// With --to gguf: the matrices' type, f32, f16 or q8_0 (norms stay f32) [default: f16].
    #[arg(long, value_name = "TYPE")]
    pub dtype: Option<String>,
}

/// Refuses an output that is a file, or a directory holding files an export would replace
/// (unless `overwrite`), or that cannot be written: bad input, before anything is computed.
pub fn check_export_dir(out: &Path, files: &[&str], overwrite: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(UsageError(format!("{}: is a file, not a directory", out.display())).into());
    }
    if !overwrite {
        let taken: Vec<&str> = files
            .iter()
            .copied()
            .filter(|f| out.join(f).exists())
            .collect();
        if !taken.is_empty() {
            return Err(UsageError(format!(
                "{} already holds {}: pass --overwrite to replace them, or export elsewhere",
                out.display(),
                taken.join(", ")
            ))
            .into());
        }
    }
    std::fs::create_dir_all(out)
        .map_err(|e| UsageError(format!("cannot create {}: {e}", out.display())))?;
    let probe = out.join(".ringtmp-export-probe");
    std::fs::write(&probe, b"")
        .map_err(|e| UsageError(format!("cannot write into {}: {e}", out.display())))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}
