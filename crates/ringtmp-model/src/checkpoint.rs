//! Checkpoints: one safetensors file per stage (parameters and optimizer state) plus a JSON
//! manifest that records where training stood and the SHA-256 of every file.
//!
//! Layout of a checkpoint directory:
//! ```text
//! <out>/checkpoints/step-000000120/stage-0.safetensors
//! <out>/checkpoints/step-000000120/manifest.json     (written last)
//! <out>/checkpoints/latest                           (name of the newest complete checkpoint)
//! ```
//! Every file is written atomically (temporary file, fsync, rename, fsync of the directory), and
//! the manifest only after all stage files, so a crash at any moment leaves the previous
//! checkpoint intact and never a manifest pointing at missing or partial files. Loading verifies
//! each file's hash before using a byte of it.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::spec::ModelSpec;
use crate::stage::Stage;

/// Version of the manifest format; bumped on incompatible changes.
pub const MANIFEST_FORMAT: u32 = 1;

/// A file of a checkpoint with its hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Lower-case hex SHA-256 of the file's bytes.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// Where training stood when the checkpoint was taken.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`] at the time of writing.
    pub format: u32,
    /// Strategy that wrote it (`local`, `ring`, …).
    pub strategy: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Data cursor: epoch in progress.
    pub epoch: u64,
    /// Data cursor: mini-batches of that epoch already consumed.
    pub batch_in_epoch: u64,
    /// Dataset name (a resumed run must read the same data).
    pub dataset: String,
    /// Mini-batch size (with the seed it fixes the data order).
    pub batch_size: usize,
    /// Run seed. All randomness (initialisation, shuffling, dropout) is a pure function of the
    /// seed and counters (layer index, epoch, step, row), so `(seed, step)` is the complete RNG
    /// state.
    pub seed: u64,
    /// The model description.
    pub model: ModelSpec,
    /// Layer ranges `[start, end)` of each stage, in stage order.
    pub partition: Vec<(usize, usize)>,
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// One file per stage, in stage order.
    pub files: Vec<FileEntry>,
}

/// Name of the checkpoint directory for `step`.
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("step-{step:09}")
}

/// Writes a stage's parameters and optimizer state to `dir/name` atomically and returns its entry.
///
/// Tensors are stored per layer under their own names (`layers.3.weight`) and the optimizer state
/// under `optim.<state>.<tensor>` (`optim.velocity.layers.3.weight`), so a checkpoint can be loaded
/// into any other partition of the same model: every tensor is found by name.
pub fn write_stage(
    dir: &Path,
    name: &str,
    stage: &Stage,
    optimizer: &Optimizer,
) -> Result<FileEntry> {
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let state = optimizer.state();
    for (tensor, shape, range) in named_tensors(stage) {
        owned.push((
            tensor.clone(),
            shape.clone(),
            le_bytes(&stage.params()[range.clone()]),
        ));
        for (state_name, values) in &state {
            owned.push((
                format!("{state_name}.{tensor}"),
                shape.clone(),
                le_bytes(&values[range.clone()]),
            ));
        }
    }
    let views = owned
        .iter()
        .map(|(n, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data).map(|v| (n.as_str(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| safetensors_error(&dir.join(name), e))?;
    let bytes =
        safetensors::serialize(views, None).map_err(|e| safetensors_error(&dir.join(name), e))?;
    write_atomic(&dir.join(name), &bytes)?;
    Ok(FileEntry {
        name: name.to_string(),
        sha256: sha256_hex(&bytes),
        bytes: bytes.len() as u64,
    })
}

/// Loads the parameters and optimizer state of `stage` from a checkpoint written with any
/// partition of the same model: reads (after checking its hash) every file whose layer range
/// overlaps the stage and takes each tensor by name. Nothing is modified on error.
pub fn read_stage(
    dir: &Path,
    manifest: &Manifest,
    stage: &mut Stage,
    optimizer: &mut Optimizer,
) -> Result<()> {
    if manifest.files.len() != manifest.partition.len() {
        return Err(Error::CheckpointMismatch {
            path: dir.join("manifest.json"),
            reason: format!(
                "{} files for {} stages",
                manifest.files.len(),
                manifest.partition.len()
            ),
        });
    }
    let first = stage.first_layer();
    let last = first + stage.layers().len();
    let mut files = Vec::new();
    for (entry, &(start, end)) in manifest.files.iter().zip(&manifest.partition) {
        if start < last && first < end {
            let path = dir.join(&entry.name);
            let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
            let got = sha256_hex(&bytes);
            if got != entry.sha256 {
                return Err(Error::CheckpointHash {
                    path,
                    expected: entry.sha256.clone(),
                    got,
                });
            }
            files.push((path, bytes));
        }
    }
    let parsed = files
        .iter()
        .map(|(path, bytes)| {
            SafeTensors::deserialize(bytes)
                .map(|t| (path, t))
                .map_err(|e| safetensors_error(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let find = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        for (path, file) in &parsed {
            if let Ok(view) = file.tensor(name) {
                if view.dtype() != Dtype::F32 || view.shape() != shape {
                    return Err(Error::CheckpointMismatch {
                        path: path.to_path_buf(),
                        reason: format!(
                            "tensor {name} is {:?} {:?}, expected F32 {shape:?}",
                            view.dtype(),
                            view.shape()
                        ),
                    });
                }
                return Ok(view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect());
            }
        }
        Err(Error::CheckpointMismatch {
            path: dir.to_path_buf(),
            reason: format!("tensor {name} is missing"),
        })
    };
    let mut params = vec![0.0; stage.params().len()];
    let state_names: Vec<&'static str> = optimizer.state().iter().map(|(n, _)| *n).collect();
    let mut state: Vec<(&str, Vec<f32>)> = state_names
        .iter()
        .map(|n| (*n, vec![0.0; params.len()]))
        .collect();
    for (tensor, shape, range) in named_tensors(stage) {
        params[range.clone()].copy_from_slice(&find(&tensor, &shape)?);
        for (state_name, values) in state.iter_mut() {
            values[range.clone()]
                .copy_from_slice(&find(&format!("{state_name}.{tensor}"), &shape)?);
        }
    }
    optimizer
        .load_state(&state, manifest.step)
        .map_err(|e| Error::CheckpointMismatch {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
    stage.params_mut().copy_from_slice(&params);
    stage.zero_grad();
    Ok(())
}

/// `(name, shape, range in the flat buffers)` of every parameter tensor of a stage.
fn named_tensors(stage: &Stage) -> Vec<(String, Vec<usize>, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (layer, range) in stage.param_ranges() {
        let mut at = range.start;
        for (tensor, shape) in layer.param_tensors() {
            let len: usize = shape.iter().product();
            out.push((tensor, shape, at..at + len));
            at += len;
        }
    }
    out
}

/// Writes the manifest (after the stage files) and points `latest` at this checkpoint.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let text = serde_json::to_vec_pretty(manifest).map_err(|e| Error::CheckpointMismatch {
        path: dir.to_path_buf(),
        reason: format!("cannot encode manifest: {e}"),
    })?;
    write_atomic(&dir.join("manifest.json"), &text)?;
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        write_atomic(&parent.join("latest"), name.to_string_lossy().as_bytes())?;
    }
    Ok(())
}

/// Finds the checkpoint a `--resume` path means: a checkpoint directory (with `manifest.json`),
/// a `checkpoints/` directory (its `latest`), or a run's output directory.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        let latest = root.join("latest");
        if latest.is_file() {
            let name = fs::read_to_string(&latest).map_err(|e| Error::io(&latest, e))?;
            let dir = root.join(name.trim());
            if dir.join("manifest.json").is_file() {
                return Ok(dir);
            }
            return Err(Error::CheckpointMismatch {
                path: latest,
                reason: format!("points at {} which has no manifest.json", dir.display()),
            });
        }
    }
    Err(Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason: "no checkpoint here (expected manifest.json, checkpoints/latest or latest)".into(),
    })
}

/// Reads and parses `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join("manifest.json");
    let text = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| Error::CheckpointMismatch {
            path: path.clone(),
            reason: format!("invalid manifest: {e}"),
        })?;
    if manifest.format != MANIFEST_FORMAT {
        return Err(Error::CheckpointMismatch {
            path,
            reason: format!(
                "manifest format {} is not the supported {MANIFEST_FORMAT}",
                manifest.format
            ),
        });
    }
    Ok(manifest)
}

/// Writes `bytes` to `path` so that readers see either the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(|e| Error::io(path, e))
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn safetensors_error(path: &Path, e: safetensors::SafeTensorError) -> Error {
    Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason: format!("safetensors: {e}"),
    }
}
