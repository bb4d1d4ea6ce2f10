//! ringtmp's tensors under other frameworks' names and layouts, both ways: what `ringtmp export
//! --to pytorch` writes and what `--init-from` reads.
//!
//! ringtmp names a tensor `layers.<index>.<name>` and keeps PyTorch's layouts where they are
//! free (a linear weight is `[out, in]`; norms, embeddings and the transformer blocks use
//! nanoGPT's names and shapes). Two things differ, because ringtmp's images are channels last:
//! a convolution's weight is `[out, kh, kw, in]` here and `[out, in, kh, kw]` (OIHW) in PyTorch,
//! and a linear layer that reads a flattened image (of more than one channel) sees its values
//! in `(y, x, channel)` order here and `(channel, y, x)` order in PyTorch, so its weight's
//! columns are permuted.
//!
//! Name maps ([`NameMap`]): `pytorch` is an `nn.Sequential` of one module per ringtmp layer
//! (`3.weight` is `layers.3.weight`); `nanogpt` is nanoGPT's `GPT` (`transformer.wte.weight`,
//! `transformer.h.0.attn.c_attn.weight`, `transformer.ln_f.weight`, `lm_head.weight`), whose
//! LM head has no bias (ringtmp's starts at zero) and whose attention masks (`.attn.bias`
//! buffers) are not parameters; `ringtmp` is ringtmp's own names.
//!
//! Invariant: importing what [`to_pytorch`] exported gives back the same parameters, bit for
//! bit (a permutation moves values, it never computes them).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::layers::{Layer, LayerKind};

/// One tensor under a framework's name, in its layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// Whose names a file of weights uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameMap {
    /// ringtmp's own (`layers.3.weight`).
    Ringtmp,
    /// An `nn.Sequential` with one module per layer (`3.weight`), PyTorch's layouts.
    Pytorch,
    /// nanoGPT's `GPT` module, PyTorch's layouts.
    NanoGpt,
}

impl std::fmt::Display for NameMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NameMap::Ringtmp => "ringtmp",
            NameMap::Pytorch => "pytorch",
            NameMap::NanoGpt => "nanogpt",
        })
    }
}

impl std::str::FromStr for NameMap {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "ringtmp" => Ok(NameMap::Ringtmp),
            "pytorch" | "sequential" => Ok(NameMap::Pytorch),
            "nanogpt" => Ok(NameMap::NanoGpt),
            other => Err(format!(
                "weight map {other:?}: expected pytorch (nn.Sequential names), nanogpt or ringtmp"
            )),
        }
    }
}

/// How one ringtmp tensor is stored in the other framework.
#[derive(Clone, Debug, PartialEq)]
enum Layout {
    /// The same values in the same order.
    Same,
    /// A convolution weight: ringtmp `[o, kh, kw, i]`, PyTorch `[o, i, kh, kw]`.
    Conv { o: usize, k: usize, i: usize },
    /// A linear weight `[out, h·w·c]` reading a flattened `(h, w, c)` image: columns in
    /// `(y, x, ch)` order here, `(ch, y, x)` there.
    FlatImage {
        out: usize,
        h: usize,
        w: usize,
        c: usize,
    },
}

impl Layout {
    /// PyTorch's shape of a tensor of ringtmp shape `shape`.
    fn pytorch_shape(&self, shape: &[usize]) -> Vec<usize> {
        match *self {
            Layout::Conv { o, k, i } => vec![o, i, k, k],
            _ => shape.to_vec(),
        }
    }

    /// ringtmp's values → PyTorch's.
    fn export(&self, v: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; v.len()];
        self.for_each_pair(|ours, theirs| out[theirs] = v[ours]);
        out
    }

    /// PyTorch's values → ringtmp's.
    fn import(&self, v: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; v.len()];
        self.for_each_pair(|ours, theirs| out[ours] = v[theirs]);
        out
    }

    /// Calls `f(index here, index there)` for every value.
    fn for_each_pair(&self, mut f: impl FnMut(usize, usize)) {
        match *self {
            Layout::Same => unreachable!("a plain copy has no pairs"),
            Layout::Conv { o, k, i } => {
                for oo in 0..o {
                    for y in 0..k {
                        for x in 0..k {
                            for ii in 0..i {
                                f(
                                    ((oo * k + y) * k + x) * i + ii,
                                    ((oo * i + ii) * k + y) * k + x,
                                );
                            }
                        }
                    }
                }
            }
            Layout::FlatImage { out, h, w, c } => {
                let cols = h * w * c;
                for r in 0..out {
                    for p in 0..h * w {
                        for ch in 0..c {
                            f(r * cols + p * c + ch, r * cols + ch * h * w + p);
                        }
                    }
                }
            }
        }
    }

    fn apply(&self, v: &[f32], export: bool) -> Vec<f32> {
        match self {
            Layout::Same => v.to_vec(),
            _ if export => self.export(v),
            _ => self.import(v),
        }
    }
}

/// Every parameter tensor of `layers` (a whole model, in order): its ringtmp name and shape, its
/// range in the parameters, and how PyTorch stores it.
fn tensors(layers: &[Layer]) -> Vec<(String, Vec<usize>, std::ops::Range<usize>, Layout)> {
    let mut out = Vec::new();
    let mut at = 0;
    // The image a flatten made, while its values are in ringtmp's order (until a linear layer).
    let mut flattened: Option<(usize, usize, usize)> = None;
    for layer in layers {
        match &layer.kind {
            LayerKind::Flatten => {
                flattened = layer
                    .input
                    .as_image()
                    .filter(|&(h, w, c)| c > 1 && h * w > 1);
            }
            LayerKind::Relu | LayerKind::Gelu | LayerKind::Dropout(_) => {}
            LayerKind::Linear(_) => {}
            _ => flattened = None,
        }
        for (name, shape) in layer.param_tensors() {
            let len: usize = shape.iter().product();
            let layout = match (&layer.kind, name.ends_with(".weight")) {
                (LayerKind::Conv2d(c), true) => Layout::Conv {
                    o: c.out_channels,
                    k: c.kernel,
                    i: c.in_channels,
                },
                (LayerKind::Linear(l), true) => match flattened {
                    Some((h, w, c)) => Layout::FlatImage {
                        out: l.out_features,
                        h,
                        w,
                        c,
                    },
                    None => Layout::Same,
                },
                _ => Layout::Same,
            };
            out.push((name, shape, at..at + len, layout));
            at += len;
        }
        if matches!(layer.kind, LayerKind::Linear(_)) {
            flattened = None;
        }
    }
    out
}

/// The PyTorch name of ringtmp tensor `name` of layer `index` under `map`, for a model of
/// `layers`; `None` when the map has no such tensor (nanoGPT's head bias).
fn foreign_name(map: NameMap, layers: &[Layer], name: &str) -> Result<Option<String>> {
    let rest = name.strip_prefix("layers.").unwrap_or(name);
    let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let index: usize = index.parse().unwrap_or(usize::MAX);
    Ok(match map {
        NameMap::Ringtmp => Some(name.to_string()),
        NameMap::Pytorch => Some(rest.to_string()),
        NameMap::NanoGpt => {
            let gpt = NanoGptShape::of(layers)?;
            if index == 0 {
                Some(format!("transformer.{tail}"))
            } else if index <= gpt.blocks {
                Some(format!("transformer.h.{}.{tail}", index - 1))
            } else if index == gpt.blocks + 1 {
                Some(format!("transformer.ln_f.{tail}"))
            } else if tail == "weight" {
                Some("lm_head.weight".into())
            } else {
                None
            }
        }
    })
}

/// A model nanoGPT's names fit: an embedding, `blocks` transformer blocks, a LayerNorm and a
/// linear head.
struct NanoGptShape {
    blocks: usize,
}

impl NanoGptShape {
    fn of(layers: &[Layer]) -> Result<Self> {
        let blocks = layers
            .iter()
            .skip(1)
            .take_while(|l| matches!(l.kind, LayerKind::Block(_)))
            .count();
        let fits = matches!(
            layers.first().map(|l| &l.kind),
            Some(LayerKind::Embedding(_))
        ) && layers.len() == blocks + 3
            && matches!(layers[blocks + 1].kind, LayerKind::Norm(_))
            && matches!(layers[blocks + 2].kind, LayerKind::Linear(_));
        if !fits {
            return Err(Error::Config {
                source_name: "weight map nanogpt".into(),
                reason: "nanoGPT's names fit an embedding, transformer blocks, a LayerNorm and a \
                         linear head; this model is another shape (use --weight-map pytorch)"
                    .into(),
            });
        }
        Ok(Self { blocks })
    }
}

/// The whole model's parameters (`layers`, every layer, in order) as PyTorch's `nn.Sequential`
/// of one module per layer stores them.
pub fn to_pytorch(layers: &[Layer], params: &[f32]) -> Vec<Tensor> {
    tensors(layers)
        .into_iter()
        .map(|(name, shape, range, layout)| Tensor {
            name: name.strip_prefix("layers.").unwrap_or(&name).to_string(),
            shape: layout.pytorch_shape(&shape),
            values: layout.apply(&params[range], true),
        })
        .collect()
}

/// The whole model's parameters under nanoGPT's names and layouts (its `GPT` module's state
/// dict, the head's weight as `lm_head.weight`), and the head's bias, which nanoGPT's head does
/// not have: the caller decides where it goes. Refused for a model nanoGPT's names do not fit.
pub fn to_nanogpt(layers: &[Layer], params: &[f32]) -> Result<(Vec<Tensor>, Vec<f32>)> {
    let mut out = Vec::new();
    let mut head_bias = Vec::new();
    for (name, shape, range, layout) in tensors(layers) {
        let values = layout.apply(&params[range], true);
        match foreign_name(NameMap::NanoGpt, layers, &name)? {
            Some(theirs) => out.push(Tensor {
                name: theirs,
                shape: layout.pytorch_shape(&shape),
                values,
            }),
            None => head_bias = values,
        }
    }
    Ok((out, head_bias))
}

/// What an import found: every problem, so the user sees them all at once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportReport {
    /// The model's tensors the file does not have (under the map's names).
    pub missing: Vec<String>,
    /// The file's tensors the model has no place for.
    pub unmatched: Vec<String>,
    /// `name: file shape vs model shape`.
    pub wrong_shape: Vec<String>,
    /// Tensors the map does not carry, started at zero (nanoGPT's absent head bias).
    pub zeroed: Vec<String>,
    /// Tensors matched and loaded.
    pub loaded: usize,
}

impl ImportReport {
    /// Whether every model tensor was found with its shape and the file has nothing left over.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unmatched.is_empty() && self.wrong_shape.is_empty()
    }

    /// The problems, one line each.
    pub fn describe(&self) -> String {
        let mut lines = Vec::new();
        let list = |what: &str, names: &[String]| {
            let shown: Vec<&str> = names.iter().take(12).map(String::as_str).collect();
            let more = names.len().saturating_sub(12);
            format!(
                "{what} ({}): {}{}",
                names.len(),
                shown.join(", "),
                if more > 0 {
                    format!(", and {more} more")
                } else {
                    String::new()
                }
            )
        };
        if !self.missing.is_empty() {
            lines.push(list("missing from the file", &self.missing));
        }
        if !self.unmatched.is_empty() {
            lines.push(list("in the file but not the model", &self.unmatched));
        }
        if !self.wrong_shape.is_empty() {
            lines.push(list("of another shape", &self.wrong_shape));
        }
        lines.join("; ")
    }
}

/// Fills `params` (the whole model of `layers`) from `file`'s tensors named by `map`, in the
/// map's layouts. Buffers that are not parameters (nanoGPT's attention masks) are skipped.
/// Returns what matched; the caller refuses an incomplete import before training.
pub fn from_foreign(
    layers: &[Layer],
    file: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    map: NameMap,
    params: &mut [f32],
) -> Result<ImportReport> {
    let mut report = ImportReport::default();
    let mut used = std::collections::BTreeSet::new();
    for (name, shape, range, layout) in tensors(layers) {
        let Some(theirs) = foreign_name(map, layers, &name)? else {
            params[range].fill(0.0);
            report.zeroed.push(name);
            continue;
        };
        let expected = if map == NameMap::Ringtmp {
            shape.clone()
        } else {
            layout.pytorch_shape(&shape)
        };
        match file.get(&theirs) {
            None => report.missing.push(theirs),
            Some((got, _)) if *got != expected => {
                used.insert(theirs.clone());
                report.wrong_shape.push(format!(
                    "{theirs}: {got:?} in the file, {expected:?} in the model"
                ));
            }
            Some((_, values)) => {
                used.insert(theirs.clone());
                let values = if map == NameMap::Ringtmp {
                    values.clone()
                } else {
                    layout.apply(values, false)
                };
                params[range].copy_from_slice(&values);
                report.loaded += 1;
            }
        }
    }
    let buffer = |n: &str| map == NameMap::NanoGpt && n.ends_with(".attn.bias");
    // nanoGPT ties its head to the token embedding; a file may hold the table once.
    report.unmatched = file
        .keys()
        .filter(|n| !used.contains(*n) && !buffer(n))
        .cloned()
        .collect();
    Ok(report)
}

/// A file's tensors by name: `(shape, values as f32)`.
pub type TensorFile = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Writes `tensors` to a safetensors file at `path` (f32, with `metadata`, e.g.
/// `{"format": "pt"}` as PyTorch's writers mark theirs).
pub fn write_safetensors(
    path: &std::path::Path,
    tensors: &[Tensor],
    metadata: &[(&str, &str)],
) -> Result<()> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let data = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (t.name.clone(), t.shape.clone(), data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::CheckpointMismatch {
            path: path.to_path_buf(),
            reason: format!("cannot lay out a tensor: {e}"),
        })?;
    let encoded = safetensors::serialize(views, None).map_err(|e| Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason: format!("cannot encode: {e}"),
    })?;
    let encoded = with_sorted_metadata(&encoded, metadata);
    crate::checkpoint::write_atomic(path, &encoded)
}

/// `encoded` (a safetensors file without metadata) with `metadata` as its `__metadata__`, the
/// keys in order: the crate writes its metadata from a `HashMap`, whose order changes from run
/// to run, and the same export should be the same bytes. Laid out as the crate lays it out
/// (metadata first, the header padded with spaces to 8 bytes).
fn with_sorted_metadata(encoded: &[u8], metadata: &[(&str, &str)]) -> Vec<u8> {
    if metadata.is_empty() {
        return encoded.to_vec();
    }
    let n = u64::from_le_bytes(encoded[..8].try_into().expect("8 bytes")) as usize;
    let header = std::str::from_utf8(&encoded[8..8 + n])
        .expect("the crate writes a UTF-8 header")
        .trim_end();
    let sorted: BTreeMap<&str, &str> = metadata.iter().copied().collect();
    let metadata = serde_json::to_string(&sorted).expect("strings encode");
    let rest = &header[1..];
    let mut header = if rest == "}" {
        format!("{{\"__metadata__\":{metadata}}}")
    } else {
        format!("{{\"__metadata__\":{metadata},{rest}")
    }
    .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(encoded.len() + header.len());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&encoded[8 + n..]);
    out
}

/// Every tensor of a safetensors file, as f32 (f16 and bf16 widened exactly; f64 narrowed).
/// Integer tensors and other dtypes are refused, naming the tensor.
pub fn read_safetensors(path: &std::path::Path) -> Result<TensorFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let bad = |reason: String| Error::CheckpointMismatch {
        path: path.to_path_buf(),
        reason,
    };
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in file.tensors() {
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F64 => data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            other => {
                return Err(bad(format!(
                    "tensor {name} is {other:?}; weights are read from f32, f16, bf16 or f64"
                )));
            }
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;
    use crate::spec::ModelSpec;

    fn cnn_rgb() -> Vec<Layer> {
        let spec = ModelSpec::from_toml(
            r#"
            name = "rgb"
            [[layer]]
            type = "conv2d"
            out_channels = 4
            kernel = 3
            [[layer]]
            type = "relu"
            [[layer]]
            type = "flatten"
            [[layer]]
            type = "linear"
            out = 5
            "#,
            "test",
        )
        .unwrap();
        spec.build(&Shape::image(5, 5, 3), 5).unwrap()
    }

    fn numbered(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32).collect()
    }

    #[test]
    fn a_convolution_is_exported_oihw_and_a_flattened_image_column_permuted() {
        let layers = cnn_rgb();
        let n: usize = layers.iter().map(Layer::param_count).sum();
        let params = numbered(n);
        let t = to_pytorch(&layers, &params);
        assert_eq!(t[0].name, "0.weight");
        assert_eq!(t[0].shape, vec![4, 3, 3, 3]);
        // ringtmp [o=0, y=0, x=1, i=2] is value (0·3 + 1)·3 + 2 = 5; PyTorch holds it at
        // [o=0, i=2, y=0, x=1]: (2·3 + 0)·3 + 1 = 19.
        assert_eq!(t[0].values[19], 5.0);
        assert_eq!(t[2].name, "3.weight");
        // The linear layer reads a 3×3×4 image: ringtmp column (p=1, ch=2) = 1·4 + 2 = 6 is
        // PyTorch's column ch·9 + p = 19.
        let w = &t[2].values;
        let offset = 4 * 27 + 4;
        assert_eq!(w[19], params[offset + 6]);
    }

    #[test]
    fn importing_an_export_gives_back_the_parameters_bit_for_bit() {
        let layers = cnn_rgb();
        let n: usize = layers.iter().map(Layer::param_count).sum();
        let params: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let file: BTreeMap<_, _> = to_pytorch(&layers, &params)
            .into_iter()
            .map(|t| (t.name, (t.shape, t.values)))
            .collect();
        let mut back = vec![0.0; n];
        let report = from_foreign(&layers, &file, NameMap::Pytorch, &mut back).unwrap();
        assert!(report.is_complete(), "{}", report.describe());
        assert_eq!(report.loaded, 4);
        assert_eq!(back, params);
    }

    #[test]
    fn an_incomplete_file_lists_every_problem() {
        let layers = cnn_rgb();
        let n: usize = layers.iter().map(Layer::param_count).sum();
        let mut file: BTreeMap<_, _> = to_pytorch(&layers, &numbered(n))
            .into_iter()
            .map(|t| (t.name, (t.shape, t.values)))
            .collect();
        file.remove("0.bias");
        file.insert("extra.weight".into(), (vec![1], vec![0.0]));
        file.get_mut("3.bias").unwrap().0 = vec![6];
        let report = from_foreign(&layers, &file, NameMap::Pytorch, &mut vec![0.0; n]).unwrap();
        assert!(!report.is_complete());
        assert_eq!(report.missing, vec!["0.bias"]);
        assert_eq!(report.unmatched, vec!["extra.weight"]);
        assert!(report.wrong_shape[0].starts_with("3.bias: [6]"));
        let text = report.describe();
        assert!(text.contains("missing from the file (1): 0.bias"), "{text}");
    }

    #[test]
    fn nanogpt_names_map_blocks_the_final_norm_and_a_biasless_head() {
        let spec = ModelSpec::preset("gpt-nano", 11).unwrap();
        let layers = spec
            .build_for(&Shape::flat(8), &Shape(vec![8, 11]))
            .unwrap();
        let n: usize = layers.iter().map(Layer::param_count).sum();
        let ours = numbered(n);
        // nanoGPT's file: the same tensors under its names, no head bias, attention masks.
        let mut file = BTreeMap::new();
        for (name, shape, range, _) in tensors(&layers) {
            if let Some(theirs) = foreign_name(NameMap::NanoGpt, &layers, &name).unwrap() {
                file.insert(theirs, (shape, ours[range].to_vec()));
            }
        }
        assert!(file.contains_key("transformer.wte.weight"));
        assert!(file.contains_key("transformer.h.0.attn.c_attn.weight"));
        assert!(file.contains_key("transformer.ln_f.bias"));
        assert!(file.contains_key("lm_head.weight"));
        file.insert("transformer.h.0.attn.bias".into(), (vec![1], vec![1.0]));
        let mut back = vec![7.0; n];
        let report = from_foreign(&layers, &file, NameMap::NanoGpt, &mut back).unwrap();
        assert!(report.is_complete(), "{}", report.describe());
        assert_eq!(report.zeroed.len(), 1, "the head's bias");
        let head_bias = n - 11;
        assert!(back[head_bias..].iter().all(|&v| v == 0.0));
        assert_eq!(&back[..head_bias], &ours[..head_bias]);
    }

    #[test]
    fn metadata_is_written_in_one_order_and_read_back_by_the_crate() {
        let tmp = tempfile::tempdir().unwrap();
        let tensors = vec![
            Tensor {
                name: "b".into(),
                shape: vec![3],
                values: vec![1.0, 2.0, 3.0],
            },
            Tensor {
                name: "a".into(),
                shape: vec![1, 2],
                values: vec![4.0, 5.0],
            },
        ];
        let meta = [("n_head", "4"), ("format", "pt"), ("block_size", "64")];
        let (one, two) = (tmp.path().join("1"), tmp.path().join("2"));
        write_safetensors(&one, &tensors, &meta).unwrap();
        write_safetensors(&two, &tensors, &meta).unwrap();
        let bytes = std::fs::read(&one).unwrap();
        assert_eq!(bytes, std::fs::read(&two).unwrap());
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let read = header.metadata().clone().unwrap();
        assert_eq!(read.len(), 3);
        assert_eq!(read["n_head"], "4");
        let back = read_safetensors(&one).unwrap();
        assert_eq!(back["a"], (vec![1, 2], vec![4.0, 5.0]));
        // One key: the crate's own bytes.
        let single = tmp.path().join("3");
        write_safetensors(&single, &tensors, &[("format", "pt")]).unwrap();
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|t| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views = tensors.iter().zip(&data).map(|(t, d)| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.shape.clone(), d)
                    .unwrap();
            (t.name.clone(), v)
        });
        let crate_bytes = safetensors::serialize(
            views,
            Some([("format".to_string(), "pt".to_string())].into()),
        )
        .unwrap();
        assert_eq!(std::fs::read(&single).unwrap(), crate_bytes);
    }
}
