//! Weights out of a run and back in: `ringtmp export` (PyTorch, nanoGPT), `ringtmp predict`
//! and `ringtmp eval` on a checkpoint of any strategy, whatever its partition, opened as one
//! whole model and run on a user's inputs read as training read them (the run's input recipe:
//! columns, layout, image size, normalisation, class names).

mod eval;
mod gguf;
mod hf;
mod language;
mod nanogpt;
mod opened;
mod outputs;
mod predict;
mod pytorch;
mod request;
mod torch_file;

pub use eval::{EvalArgs, eval};
pub use opened::weights_dir;
pub use predict::{PredictArgs, predict};
pub use request::ExportArgs;

/// `ringtmp export`: the writer of the framework asked for.
pub fn export(a: &ExportArgs) -> anyhow::Result<()> {
    if a.dtype.is_some() && a.to != "gguf" {
        return Err(crate::error::UsageError(
            "--dtype chooses a GGUF export's type (--to gguf)".into(),
        )
        .into());
    }
    match a.to.as_str() {
        "pytorch" => pytorch::export_pytorch(a),
        "nanogpt" => pytorch::export_nanogpt(a),
        "hf" => hf::export_hf(a),
        "gguf" => gguf::export_gguf(a),
        other => Err(crate::error::UsageError(format!(
            "--to {other:?}: ringtmp exports to pytorch, nanogpt, hf or gguf"
        ))
        .into()),
    }
}
