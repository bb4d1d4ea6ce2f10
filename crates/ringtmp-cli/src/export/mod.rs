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
mod torch_file;

pub use eval::{EvalArgs, eval};
pub use opened::weights_dir;
pub use predict::{PredictArgs, predict};
pub use pytorch::{ExportArgs, export};
