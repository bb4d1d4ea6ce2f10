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

use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::layers::LayerKind;
use crate::optim::{Optimizer, OptimizerConfig};
use crate::spec::ModelSpec;
use crate::stage::Stage;

/// Version of the manifest format written; bumped on incompatible changes. Format 2 manifests
/// always carry their checksum (`integrity`).
pub const MANIFEST_FORMAT: u32 = 2;

/// The manifest format of files written before manifests carried a checksum: read on their
/// stage files' hashes alone. A later manifest without its checksum was edited.
pub const MANIFEST_FORMAT_WITHOUT_CHECKSUM: u32 = 1;

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
    /// The base learning rate the run used for its global batch (scaled as its strategy
    /// scaled it): a resume that keeps the global batch keeps this rate unless told another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
    /// One file per stage, in stage order.
    pub files: Vec<FileEntry>,
    /// Decentralised strategies: each worker's own model (`replica-<rank>.safetensors`,
    /// parameters only), beside the workers' average in `files`. Resuming reads `files` only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<FileEntry>,
    /// A language model's vocabulary (`chars:…` or `ids:N`, as the run stores it): a checkpoint
    /// resumes only on text with the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<String>,
    /// A language model's context: positions per window (the model's input shape). Absent in
    /// checkpoints that predate it; [`context_of`] then reads it from the position embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// What the outputs were trained to be (class logits unless said).
    #[serde(default, skip_serializing_if = "is_cross_entropy")]
    pub objective: crate::loss::Objective,
    /// How a raw example becomes the model's input: `ringtmp_data::InputRecipe` as JSON (the
    /// columns, layout, normalisation and class names `predict` and `export` need). Kept as JSON
    /// here so the model crate does not depend on the data crate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<serde_json::Value>,
}

fn is_cross_entropy(o: &crate::loss::Objective) -> bool {
    *o == crate::loss::Objective::CrossEntropy
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
    write_named(dir, name, stage, stage.params(), &optimizer.state())
}

/// Writes `params`, a whole model's parameters laid out as `model`'s, to `dir/name` atomically
/// under the same tensor names as [`write_stage`], without optimizer state (a decentralised
/// worker's replica, stored beside the checkpoint's model).
pub fn write_params(dir: &Path, name: &str, model: &Stage, params: &[f32]) -> Result<FileEntry> {
    assert_eq!(
        params.len(),
        model.params().len(),
        "a replica of this model"
    );
    write_named(dir, name, model, params, &[])
}

fn write_named(
    dir: &Path,
    name: &str,
    stage: &Stage,
    params: &[f32],
    state: &[(&'static str, &[f32])],
) -> Result<FileEntry> {
    let mut views: Vec<(String, F32View<'_>)> = Vec::new();
    for (tensor, shape, range) in named_tensors(stage) {
        views.push((tensor.clone(), F32View::new(&shape, &params[range.clone()])));
        for (state_name, values) in state {
            views.push((
                format!("{state_name}.{tensor}"),
                F32View::new(&shape, &values[range.clone()]),
            ));
        }
    }
    write_tensors(dir, name, views)
}

/// Writes a contiguous range `range` of a whole model's flat parameter vector (a parameter
/// server's shard) with the matching optimizer state: `params` and the optimizer hold exactly
/// that range, and `model` (a stage over all layers) supplies the tensor names. A tensor wholly
/// inside the range is stored under its own name as in [`write_stage`]; one the range cuts is
/// stored as the piece inside it, flattened, under `<name>@<offset>` (offset in elements within
/// the tensor). [`read_stage`] and [`read_range`] assemble pieces from every file, so any strategy
/// and any partition or shard count can load the result.
///
/// # Panics
/// If `params` or the optimizer do not match `range` (a programmer error).
pub fn write_range(
    dir: &Path,
    name: &str,
    model: &Stage,
    range: std::ops::Range<usize>,
    params: &[f32],
    optimizer: &Optimizer,
) -> Result<FileEntry> {
    assert_eq!(
        params.len(),
        range.len(),
        "shard and range differ in length"
    );
    let state = optimizer.state();
    let mut views: Vec<(String, F32View<'_>)> = Vec::new();
    for (tensor, shape, full) in named_tensors(model) {
        let (start, end) = (full.start.max(range.start), full.end.min(range.end));
        if start >= end {
            continue;
        }
        let local = start - range.start..end - range.start;
        let (tensor, shape) = if start == full.start && end == full.end {
            (tensor, shape)
        } else {
            (
                format!("{tensor}@{}", start - full.start),
                vec![end - start],
            )
        };
        views.push((tensor.clone(), F32View::new(&shape, &params[local.clone()])));
        for (state_name, values) in &state {
            views.push((
                format!("{state_name}.{tensor}"),
                F32View::new(&shape, &values[local.clone()]),
            ));
        }
    }
    write_tensors(dir, name, views)
}

/// Loads range `range` of a whole model's flat parameters, with the matching optimizer state,
/// into `params` and `optimizer` (a parameter server's shard) from a checkpoint of the same model
/// written by any strategy; `model` (a stage over all layers) supplies the tensor names. Nothing
/// is modified on error.
pub fn read_range(
    dir: &Path,
    manifest: &Manifest,
    model: &Stage,
    range: std::ops::Range<usize>,
    params: &mut [f32],
    optimizer: &mut Optimizer,
) -> Result<()> {
    let tensors: Vec<_> = named_tensors(model)
        .into_iter()
        .filter(|(_, _, full)| full.start < range.end && range.start < full.end)
        .collect();
    let (first, last) = range_layers(model, &range);
    load_tensors(
        dir,
        manifest,
        &tensors,
        range,
        first..last,
        params,
        Some(optimizer),
    )
}

/// An f32 tensor as safetensors writes it: borrowed, so a stage's parameters and optimizer state
/// go to the file without a copy (a node near its memory limit could not hold one).
struct F32View<'a> {
    shape: Vec<usize>,
    values: &'a [f32],
}

impl<'a> F32View<'a> {
    fn new(shape: &[usize], values: &'a [f32]) -> Self {
        Self {
            shape: shape.to_vec(),
            values,
        }
    }
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            std::borrow::Cow::Borrowed(bytemuck::cast_slice(self.values))
        } else {
            std::borrow::Cow::Owned(le_bytes(self.values))
        }
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// Writes named f32 tensors as one safetensors file, atomically (a temporary name, synced, then
/// renamed), streaming them from where they are, and returns its entry (the hash read back from
/// the file).
fn write_tensors(dir: &Path, name: &str, views: Vec<(String, F32View<'_>)>) -> Result<FileEntry> {
    let path = dir.join(name);
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        safetensors::serialize_to_file(views, None, &tmp)
            .map_err(|e| safetensors_error(&path, e))?;
        // Readable as the manifest beside it is (the crate's temporary file is private).
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))
                .map_err(|e| Error::io(&path, e))?;
        }
        if disk_full_injected(dir) {
            let len = fs::metadata(&tmp).map_err(|e| Error::io(&path, e))?.len();
            let file = fs::OpenOptions::new()
                .write(true)
                .open(&tmp)
                .map_err(|e| Error::io(&path, e))?;
            file.set_len(len / 2).map_err(|e| Error::io(&path, e))?;
            return Err(Error::io(&path, std::io::Error::from_raw_os_error(ENOSPC)));
        }
        let (sha256, bytes) = hash_file(&tmp).map_err(|e| Error::io(&path, e))?;
        let synced = (|| {
            File::open(&tmp)?.sync_all()?;
            fs::rename(&tmp, &path)?;
            File::open(dir)?.sync_all()
        })();
        synced.map_err(|e| Error::io(&path, e))?;
        Ok(FileEntry {
            name: name.to_string(),
            sha256,
            bytes,
        })
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// SHA-256 (hex) and length of a file, read in blocks.
fn hash_file(path: &Path) -> std::io::Result<(String, u64)> {
    hash_reader(&mut File::open(path)?)
}

/// SHA-256 (hex) and length of what `file` reads from where it stands, in blocks of 1 MiB.
fn hash_reader(file: &mut File) -> std::io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = std::io::Read::read(file, &mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        total += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), total))
}

/// Layers `[first, last)` of `model` whose parameters overlap `range`: a shard's entry in a
/// manifest's `partition`, so readers open only the files that can hold their tensors.
pub fn range_layers(model: &Stage, range: &std::ops::Range<usize>) -> (usize, usize) {
    let touched: Vec<usize> = model
        .param_ranges()
        .enumerate()
        .filter(|(_, (_, r))| r.start < range.end && range.start < r.end)
        .map(|(i, _)| model.first_layer() + i)
        .collect();
    match (touched.first(), touched.last()) {
        (Some(&a), Some(&b)) => (a, b + 1),
        _ => (0, 0),
    }
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
    read_into(dir, manifest, stage, Some(optimizer))
}

/// Loads `stage`'s parameters from the checkpoint in `dir` (whatever its partition), without
/// its optimizer state: what inference needs.
pub fn read_params(dir: &Path, manifest: &Manifest, stage: &mut Stage) -> Result<()> {
    read_into(dir, manifest, stage, None)
}

/// [`read_stage`], the optimizer's state too when one is given.
fn read_into(
    dir: &Path,
    manifest: &Manifest,
    stage: &mut Stage,
    optimizer: Option<&mut Optimizer>,
) -> Result<()> {
    // In the model's layer indices (a cut layer's head and tail share one).
    let first = stage.first_layer();
    let last = stage.layers().last().map_or(first, |l| l.index + 1);
    let tensors = named_tensors(stage);
    let len = stage.params().len();
    let table = tied_table(dir, manifest, stage)?;
    load_tensors(
        dir,
        manifest,
        &tensors,
        0..len,
        first..last,
        stage.params_mut(),
        optimizer,
    )?;
    stage.sync_tie();
    if let Some(table) = table {
        stage.set_tied_mirror(&table);
    }
    stage.zero_grad();
    Ok(())
}

/// The token table a tied head held by `stage` without its embedding mirrors, read from the
/// checkpoint's embedding tensor (a checkpoint's own copy of the mirror is never trusted: a
/// parameter server's shards keep it only loosely).
fn tied_table(dir: &Path, manifest: &Manifest, stage: &Stage) -> Result<Option<Vec<f32>>> {
    if stage.tied_ends() != (false, true) {
        return Ok(None);
    }
    let Some((source, vocab, width)) = stage.layers().iter().find_map(|l| {
        let source = l.tied_to?;
        let LayerKind::Linear(linear) = &l.kind else {
            return None;
        };
        Some((source, linear.out_features, linear.in_features))
    }) else {
        return Ok(None);
    };
    let len = vocab * width;
    let tensors = [(
        format!("layers.{source}.wte.weight"),
        vec![vocab, width],
        0..len,
    )];
    let mut table = vec![0.0; len];
    load_tensors(
        dir,
        manifest,
        &tensors,
        0..len,
        source..source + 1,
        &mut table,
        None,
    )?;
    Ok(Some(table))
}

/// A language model's context (positions per window) in the checkpoint in `dir`: the
/// manifest's, or the first dimension of the position embedding's table.
pub fn context_of(dir: &Path, manifest: &Manifest) -> Result<Option<usize>> {
    if manifest.context.is_some() {
        return Ok(manifest.context);
    }
    let Some(entry) = manifest.files.first() else {
        return Ok(None);
    };
    let path = dir.join(&entry.name);
    let bytes = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|e| safetensors_error(&path, e))?;
    Ok(header
        .tensors()
        .iter()
        .find(|(name, _)| name.ends_with(".wpe.weight"))
        .and_then(|(_, info)| info.shape.first().copied()))
}

/// Fills `params` (and `optimizer`'s state) with the slice `want` of the flat vector that
/// `tensors` (`name, shape, range`) lay out, from the checkpoint files whose layer range overlaps
/// `layers`. A tensor is found whole under its name or assembled from `<name>@<offset>` pieces.
/// Leaves the optimizer unchanged on error.
#[expect(
    clippy::too_many_lines,
    reason = "a tensor's every source (whole, in pieces, mirrored, with optimizer state) resolved in one pass over the files"
)]
fn load_tensors(
    dir: &Path,
    manifest: &Manifest,
    tensors: &[(String, Vec<usize>, std::ops::Range<usize>)],
    want: std::ops::Range<usize>,
    layers: std::ops::Range<usize>,
    params: &mut [f32],
    optimizer: Option<&mut Optimizer>,
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
    let (first, last) = (layers.start, layers.end);
    let mut files = Vec::new();
    for (entry, &(start, end)) in manifest.files.iter().zip(&manifest.partition) {
        if start < last && first < end {
            let path = dir.join(&entry.name);
            // Hashed by reading, then mapped (the same open file): a stage of a model larger
            // than this node's memory takes its own tensors from a file that holds them all,
            // and only their pages are ever mapped in (the hash's reads stay in the page cache,
            // the kernel's to drop again).
            let mut file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let (got, _) = hash_reader(&mut file).map_err(|e| Error::io(&path, e))?;
            // SAFETY: checkpoint files are written once, to a temporary name, and renamed into
            // place (`write_tensors`); no one writes a file while it is mapped here.
            let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
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
    let values_of =
        |path: &Path, name: &str, view: &safetensors::tensor::TensorView<'_>, shape: &[usize]| {
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
            Ok(view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect::<Vec<f32>>())
        };
    // A tensor whole under its name, or its values cut from the whole tensor or assembled from
    // `<name>@<offset>` pieces (shards, or the parts of a cut linear layer). A name that is
    // itself a piece (`<base>@<offset>`, a cut layer's part) wants values `offset..offset + len`
    // of its base, found the same ways.
    let find = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let len: usize = shape.iter().product();
        let (base, from) = match name.rsplit_once('@').map(|(b, o)| (b, o.parse::<usize>())) {
            Some((base, Ok(offset))) => (base, offset),
            _ => (name, 0),
        };
        if base == name {
            for (path, file) in &parsed {
                if let Ok(view) = file.tensor(name) {
                    return values_of(path, name, &view, shape);
                }
            }
        }
        let wanted = from..from + len;
        if base != name {
            for (path, file) in &parsed {
                if let Ok(view) = file.tensor(base) {
                    let whole: usize = view.shape().iter().product();
                    if view.dtype() != Dtype::F32 || whole < wanted.end {
                        return Err(Error::CheckpointMismatch {
                            path: path.to_path_buf(),
                            reason: format!(
                                "tensor {base} is {:?} {:?}, too small for values {}..{}",
                                view.dtype(),
                                view.shape(),
                                wanted.start,
                                wanted.end
                            ),
                        });
                    }
                    let values = values_of(path, base, &view, view.shape())?;
                    return Ok(values[wanted].to_vec());
                }
            }
        }
        let mut out = vec![0.0f32; len];
        let mut covered = 0usize;
        let prefix = format!("{base}@");
        for (path, file) in &parsed {
            for piece in file.names() {
                let Some(offset) = piece.strip_prefix(&prefix) else {
                    continue;
                };
                let bad = |why: String| Error::CheckpointMismatch {
                    path: path.to_path_buf(),
                    reason: format!("piece {piece}: {why}"),
                };
                let offset: usize = offset
                    .parse()
                    .map_err(|_| bad("the offset is not a number".into()))?;
                let view = file.tensor(piece).map_err(|e| safetensors_error(path, e))?;
                let piece_len = view.shape().iter().product::<usize>();
                if view.shape().len() != 1 {
                    return Err(bad(format!("shape {:?} is not flat", view.shape())));
                }
                // The part of the piece inside the wanted values.
                let (start, end) = (
                    offset.max(wanted.start),
                    (offset + piece_len).min(wanted.end),
                );
                if start >= end {
                    continue;
                }
                let values = values_of(path, piece, &view, &[piece_len])?;
                out[start - wanted.start..end - wanted.start]
                    .copy_from_slice(&values[start - offset..end - offset]);
                covered += end - start;
            }
        }
        if covered == len {
            return Ok(out);
        }
        Err(Error::CheckpointMismatch {
            path: dir.to_path_buf(),
            reason: if covered == 0 {
                format!("tensor {name} is missing")
            } else {
                format!("tensor {name}: its pieces cover {covered} of {len} values")
            },
        })
    };
    let state_names: Vec<&'static str> = optimizer
        .as_ref()
        .map(|o| o.state().iter().map(|(n, _)| *n).collect())
        .unwrap_or_default();
    if let Some(o) = optimizer.as_ref()
        && let Some((name, values)) = o.state().into_iter().find(|(_, v)| v.len() != want.len())
    {
        return Err(Error::CheckpointMismatch {
            path: dir.to_path_buf(),
            reason: format!(
                "optimizer state {name} has {} values, expected {}",
                values.len(),
                want.len()
            ),
        });
    }
    // The overlap of each tensor with the wanted slice: where it sits inside the tensor and
    // inside the slice.
    let overlaps: Vec<_> = tensors
        .iter()
        .filter_map(|(tensor, shape, full)| {
            let (start, end) = (full.start.max(want.start), full.end.min(want.end));
            (start < end).then(|| {
                let inside = start - full.start..end - full.start;
                (tensor, shape, inside, start - want.start..end - want.start)
            })
        })
        .collect();
    // Every tensor is found first, one at a time, so that nothing is modified on error and no
    // copy of the whole slice is ever made (a node near its memory limit resumes too).
    for (tensor, shape, _, _) in &overlaps {
        find(tensor, shape)?;
        for state_name in &state_names {
            find(&format!("{state_name}.{tensor}"), shape)?;
        }
    }
    let mut state = optimizer.map(Optimizer::state_mut);
    for (tensor, shape, inside, at) in overlaps {
        params[at.clone()].copy_from_slice(&find(tensor, shape)?[inside.clone()]);
        if let Some(state) = state.as_mut() {
            for (state_name, values) in state.iter_mut() {
                values[at.clone()].copy_from_slice(
                    &find(&format!("{state_name}.{tensor}"), shape)?[inside.clone()],
                );
            }
        }
    }
    if let Some(state) = state {
        state.done(manifest.step);
    }
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

/// The manifest's own checksum: SHA-256 of its compact JSON (the struct's field order), stored
/// beside its fields as `integrity`, so an edited manifest (a step changed by hand) is refused
/// rather than trusted. It guards against edits and damage, not against someone who recomputes
/// it: the links' secret, not the files, authenticates a run.
fn manifest_digest(manifest: &Manifest, path: &Path) -> Result<String> {
    let compact = serde_json::to_vec(manifest).map_err(|e| Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason: format!("cannot encode manifest: {e}"),
    })?;
    Ok(sha256_hex(&compact))
}

/// Writes the manifest (after the stage files) with its checksum, and points `latest` at this
/// checkpoint.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let path = dir.join("manifest.json");
    let encode = |e: serde_json::Error| Error::CheckpointMismatch {
        path: path.clone(),
        reason: format!("cannot encode manifest: {e}"),
    };
    let mut value = serde_json::to_value(manifest).map_err(encode)?;
    if let Some(fields) = value.as_object_mut() {
        fields.insert("integrity".into(), manifest_digest(manifest, &path)?.into());
    }
    let text = serde_json::to_vec_pretty(&value).map_err(encode)?;
    write_atomic(&path, &text)?;
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        write_atomic(&parent.join("latest"), name.to_string_lossy().as_bytes())?;
    }
    Ok(())
}

/// Finds the checkpoint a `--resume` path means: a checkpoint directory (with `manifest.json`),
/// a `checkpoints/` directory (its `latest`), or a run's output directory. When `latest` points
/// at a checkpoint without its manifest, the error names the newest intact one instead of
/// guessing: resuming from an older step is the user's decision.
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
            let intact = match newest_intact(&root) {
                Some(good) => format!(
                    "; the newest intact checkpoint is {} (resume with --resume {})",
                    good.display(),
                    good.display()
                ),
                None => "; no intact checkpoint is left there".into(),
            };
            return Err(Error::CheckpointMismatch {
                path: latest,
                reason: format!(
                    "points at {} which has no manifest.json{intact}",
                    dir.display()
                ),
            });
        }
    }
    Err(Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason: "no checkpoint here (expected manifest.json, checkpoints/latest or latest)".into(),
    })
}

/// Marks the checkpoint in `dir` as its run's best (the evaluation with the lowest validation
/// loss): `best` beside `latest` names it. Retention keeps it.
pub fn mark_best(dir: &Path) -> Result<()> {
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        write_atomic(&parent.join("best"), name.to_string_lossy().as_bytes())?;
    }
    Ok(())
}

/// The checkpoint a run's best evaluation left under `root` (a `checkpoints/` directory), if
/// it marked one and it is still there.
fn best_under(root: &Path) -> Option<PathBuf> {
    let name = fs::read_to_string(root.join("best")).ok()?;
    let dir = root.join(name.trim());
    dir.join("manifest.json").is_file().then_some(dir)
}

/// Finds the checkpoint whose weights a path means for using them (`predict`, `export`, `eval`,
/// `generate`): a checkpoint directory as given; of a run (or its `checkpoints/`), the best
/// evaluation's when the run kept one, else the latest (as [`resolve`]). Resuming goes on from
/// the latest instead.
pub fn resolve_weights(path: &Path) -> Result<PathBuf> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join("checkpoints"), path.to_path_buf()] {
        if let Some(best) = best_under(&root) {
            return Ok(best);
        }
    }
    resolve(path)
}

/// The checkpoint directories (`step-…`) under `root`, oldest first.
fn step_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    // The names are zero-padded step numbers, so their order is the steps' order.
    dirs.sort();
    dirs
}

/// Whether `dir` has a manifest whose files are all there with their recorded sizes (the hashes
/// are checked when the checkpoint is loaded).
fn is_intact(dir: &Path) -> bool {
    read_manifest(dir).is_ok_and(|m| {
        m.files
            .iter()
            .chain(&m.replicas)
            .all(|f| fs::metadata(dir.join(&f.name)).is_ok_and(|meta| meta.len() == f.bytes))
    })
}

/// The newest checkpoint under `root` (a `checkpoints/` directory) that is intact.
pub fn newest_intact(root: &Path) -> Option<PathBuf> {
    step_dirs(root).into_iter().rev().find(|d| is_intact(d))
}

/// Checks that the checkpoint in `dir` is whole: its manifest parses and every file it lists
/// (stages and replicas) is there with its recorded size and hash. The error names the file.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let manifest = read_manifest(dir)?;
    for entry in manifest.files.iter().chain(&manifest.replicas) {
        let path = dir.join(&entry.name);
        let (got, len) = File::open(&path)
            .and_then(|mut f| hash_reader(&mut f))
            .map_err(|e| Error::io(&path, e))?;
        if len != entry.bytes {
            return Err(Error::CheckpointMismatch {
                path,
                reason: format!(
                    "{len} bytes where the manifest records {} (truncated or replaced)",
                    entry.bytes
                ),
            });
        }
        if got != entry.sha256 {
            return Err(Error::CheckpointHash {
                path,
                expected: entry.sha256.clone(),
                got,
            });
        }
    }
    Ok(manifest)
}

/// The newest checkpoint under `root` (a `checkpoints/` directory) that [`verify`]s, with the
/// reasons each newer one was passed over (`--resume auto`, automatic restarts).
pub fn newest_verified(root: &Path) -> (Option<(PathBuf, Manifest)>, Vec<String>) {
    let mut skipped = Vec::new();
    for dir in step_dirs(root).into_iter().rev() {
        match verify(&dir) {
            Ok(manifest) => return (Some((dir, manifest)), skipped),
            Err(e) => skipped.push(format!("{}: {e}", dir.display())),
        }
    }
    (None, skipped)
}

/// Removes the checkpoint directories under `root` that have no manifest: checkpoints whose
/// writing failed or was cut short (the manifest is written last). Call it only when nothing is
/// writing there any more. Returns what it removed.
pub fn remove_incomplete(root: &Path) -> Vec<PathBuf> {
    step_dirs(root)
        .into_iter()
        .filter(|d| !d.join("manifest.json").exists() && fs::remove_dir_all(d).is_ok())
        .collect()
}

/// Keeps the `keep` newest complete checkpoints under `root` and removes older complete ones
/// (`--keep-checkpoints`), and the one marked `best` besides; incomplete ones are
/// [`remove_incomplete`]'s business. Returns what it
/// removed.
pub fn retain_newest(root: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let complete: Vec<PathBuf> = step_dirs(root)
        .into_iter()
        .filter(|d| d.join("manifest.json").is_file())
        .collect();
    let best = best_under(root);
    let complete: Vec<PathBuf> = complete
        .into_iter()
        .filter(|d| Some(d) != best.as_ref())
        .collect();
    let surplus = complete.len().saturating_sub(keep.max(1));
    let mut removed = Vec::new();
    for dir in complete.into_iter().take(surplus) {
        fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Reads and parses `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join("manifest.json");
    let text = fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let invalid = |e: serde_json::Error| Error::CheckpointMismatch {
        path: path.clone(),
        reason: format!("invalid manifest: {e}"),
    };
    let manifest: Manifest = serde_json::from_slice(&text).map_err(invalid)?;
    let recorded =
        serde_json::from_slice::<serde_json::Value>(&text).map_err(invalid)?["integrity"]
            .as_str()
            .map(str::to_string);
    // Manifests without a checksum are read on their stage files' hashes alone only where
    // they predate it by their format.
    if recorded.is_none() && manifest.format != MANIFEST_FORMAT_WITHOUT_CHECKSUM {
        return Err(Error::CheckpointMismatch {
            path,
            reason: format!(
                "the manifest (format {}) has lost the checksum every manifest since format {} \
                 carries: it was edited, so its step, data cursor or files cannot be trusted",
                manifest.format,
                MANIFEST_FORMAT_WITHOUT_CHECKSUM + 1
            ),
        });
    }
    if let Some(recorded) = recorded {
        let got = manifest_digest(&manifest, &path)?;
        if got != recorded {
            return Err(Error::CheckpointMismatch {
                path,
                reason: format!(
                    "the manifest was changed after it was written (its checksum is {got}, it \
                     records {recorded}): its step, data cursor or files cannot be trusted"
                ),
            });
        }
    }
    // Its directory is named for its step.
    if let Some(name) = dir.file_name().and_then(|n| n.to_str())
        && let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
        && step != manifest.step
    {
        return Err(Error::CheckpointMismatch {
            path,
            reason: format!(
                "the manifest says step {} but its directory is {name}",
                manifest.step
            ),
        });
    }
    if !(MANIFEST_FORMAT_WITHOUT_CHECKSUM..=MANIFEST_FORMAT).contains(&manifest.format) {
        return Err(Error::CheckpointMismatch {
            path,
            reason: format!(
                "manifest format {} is not one of the supported {MANIFEST_FORMAT_WITHOUT_CHECKSUM} \
                 to {MANIFEST_FORMAT}",
                manifest.format
            ),
        });
    }
    Ok(manifest)
}

/// `ENOSPC` on Linux: "No space left on device".
const ENOSPC: i32 = 28;

/// Fault injection for tests: with `RINGTMP_FAULT_ENOSPC` set to a checkpoint directory's name
/// (`step-000000020`), every file written into a directory of that name stops half-way with
/// ENOSPC, as on a full disk. Read once per process.
fn disk_full_injected(dir: &Path) -> bool {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| std::env::var("RINGTMP_FAULT_ENOSPC").ok())
        .as_deref()
        .is_some_and(|name| dir.file_name().is_some_and(|d| d == name))
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
        if disk_full_injected(dir) {
            f.write_all(&bytes[..bytes.len() / 2])?;
            return Err(std::io::Error::from_raw_os_error(ENOSPC));
        }
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
