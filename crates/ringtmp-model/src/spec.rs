//! Model descriptions: the presets of DESIGN.md §3 and TOML model files, and the shape inference
//! that turns a description into concrete [`Layer`]s.
//!
//! A model file lists layers in order; shapes are inferred from the dataset's input shape, and
//! the last layer must produce one logit per class:
//!
//! ```toml
//! name = "small-cnn"
//! [[layer]]
//! type = "conv2d"
//! out_channels = 8
//! kernel = 3
//! [[layer]]
//! type = "relu"
//! [[layer]]
//! type = "flatten"
//! [[layer]]
//! type = "linear"
//! out = 10
//! ```
//!
//! Layer types: `linear` (`out`), `conv2d` (`out_channels`, `kernel`, `stride`, `padding`),
//! `max_pool2d` (`kernel`, `stride`), `relu`, `gelu` (tanh form), `layer_norm` and `rms_norm`
//! (over the last dimension), `causal_self_attention` (`heads`; over a `[positions, width]`
//! sequence), `block` (`heads`, `mlp_ratio`: a pre-norm transformer block over a sequence),
//! `embedding` (`vocab`, `width`; token ids to a sequence), `flatten`, `dropout` (`p`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layers::{
    Block, CausalSelfAttention, Conv2d, Dropout, Embedding, Layer, LayerKind, Linear, LlamaBlock,
    MaxPool2d, NORM_EPS, Norm, NormKind,
};
use crate::shape::Shape;

/// One layer as written in a model description (shapes not yet known).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerSpec {
    /// Fully connected layer with `out` outputs.
    Linear {
        /// Output features.
        out: usize,
        /// Whether it adds a bias (default yes; the Llama family's heads add none).
        #[serde(default = "yes", skip_serializing_if = "Clone::clone")]
        bias: bool,
    },
    /// Convolution.
    Conv2d {
        /// Number of filters.
        out_channels: usize,
        /// Kernel side.
        kernel: usize,
        /// Stride (default 1).
        #[serde(default = "one")]
        stride: usize,
        /// Zero padding (default 0).
        #[serde(default)]
        padding: usize,
    },
    /// Max-pooling.
    MaxPool2d {
        /// Window side.
        kernel: usize,
        /// Stride (default: the window side).
        #[serde(default)]
        stride: Option<usize>,
    },
    /// Rectified linear unit.
    Relu,
    /// Image to flat vector.
    Flatten,
    /// Inverted dropout with probability `p`.
    Dropout {
        /// Probability of dropping a value.
        p: f32,
    },
    /// LayerNorm over the last dimension (`γ`, `β`).
    LayerNorm {
        /// ε added to the variance (default PyTorch's, 1e-5).
        #[serde(default = "norm_eps", skip_serializing_if = "is_norm_eps")]
        eps: f32,
    },
    /// RMSNorm over the last dimension (`γ`).
    RmsNorm {
        /// ε added to the mean square (default 1e-5).
        #[serde(default = "norm_eps", skip_serializing_if = "is_norm_eps")]
        eps: f32,
    },
    /// GELU (tanh form).
    Gelu,
    /// Causal multi-head self-attention over a sequence `[seq, width]`.
    CausalSelfAttention {
        /// Heads (dividing the width).
        heads: usize,
    },
    /// A pre-norm transformer block over a sequence `[seq, width]`: attention and an MLP of
    /// `mlp_ratio · width` hidden values, each with its residual.
    Block {
        /// Attention heads (dividing the width).
        heads: usize,
        /// The MLP's hidden width over the block's (default 4).
        #[serde(default = "four")]
        mlp_ratio: usize,
    },
    /// The Llama family's decoder block over a sequence `[seq, width]`: RMSNorm, RoPE,
    /// grouped-query attention, a SwiGLU MLP, each with its residual.
    LlamaBlock {
        /// Query heads.
        heads: usize,
        /// Key/value heads (dividing `heads`).
        kv_heads: usize,
        /// Values per head (even).
        head_dim: usize,
        /// The MLP's hidden width.
        hidden: usize,
        /// RoPE's base.
        rope_theta: f64,
        /// RoPE's frequency scaling.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rope_scaling: Option<crate::layers::rope::RopeScaling>,
        /// The RMSNorms' ε.
        #[serde(default = "norm_eps", skip_serializing_if = "is_norm_eps")]
        eps: f32,
        /// Biases on q, k and v (Qwen 2).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        qkv_bias: bool,
        /// An RMSNorm of each head's q and k (Qwen 3).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        qk_norm: bool,
    },
    /// Token and learned position embeddings: a sequence of `[seq]` token ids to
    /// `[seq, width]`.
    Embedding {
        /// Token ids (the vocabulary's size).
        vocab: usize,
        /// Values per position.
        width: usize,
        /// Whether it adds learned position embeddings (default yes; the Llama family's
        /// attention rotates by position instead).
        #[serde(default = "yes", skip_serializing_if = "Clone::clone")]
        positions: bool,
    },
}

fn norm_eps() -> f32 {
    NORM_EPS
}

#[expect(clippy::trivially_copy_pass_by_ref, reason = "serde's signature")]
fn is_norm_eps(eps: &f32) -> bool {
    eps.to_bits() == NORM_EPS.to_bits()
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

fn four() -> usize {
    4
}

/// An ordered list of layers with a name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Display name (the preset name or the file's `name`).
    #[serde(default)]
    pub name: String,
    /// The layers, input to output.
    #[serde(rename = "layer")]
    pub layers: Vec<LayerSpec>,
    /// A language model's head uses the token embedding's table as its weight (GPT-2's and
    /// nanoGPT's weight tying): one matrix, updated once from the sum of both gradients. The
    /// head keeps its own bias.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
    /// SGD's momentum under the parameter server's stale consistency models (ASP, SSP, DSSP)
    /// when the user gives none, where this model was measured to want another than the
    /// stability rule's (`stale_momentum` of the parameter server's plan): the best of
    /// `benches/defaults_sweep.sh` for the model (docs/decisions/defaults.md). `None`: the rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_momentum: Option<f32>,
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 8] = [
    "mlp",
    "mlp-deep",
    "cnn",
    "tabular",
    "gpt-nano",
    "gpt-cpu",
    "gpt-small",
    "gpt-100m",
];

/// The GPT presets' shapes: `(name, blocks, heads, width, context)`. `gpt-cpu` is nanoGPT's CPU
/// recipe for Shakespeare, `gpt-small` its 10.7 M-parameter Shakespeare model, `gpt-nano` a
/// model for tests, `gpt-100m` a model of about 100 M parameters (GPT-2 small's width and heads,
/// 14 blocks; 1.6 GB with AdamW's state): more than one small node holds.
const GPTS: [(&str, usize, usize, usize, usize); 4] = [
    ("gpt-nano", 2, 2, 64, 32),
    ("gpt-cpu", 4, 4, 128, 64),
    ("gpt-small", 6, 6, 384, 256),
    ("gpt-100m", 14, 12, 768, 256),
];

impl ModelSpec {
    /// A preset by name: `mlp` (784-1024-1024-1024-10), `mlp-deep` (8 hidden layers of 1024) or
    /// `cnn` (conv5×5·32 → pool → conv5×5·64 → pool → 512 → classes), per DESIGN.md §3.
    ///
    /// The GPT presets (`gpt-nano`, `gpt-cpu`, `gpt-small`) take `classes` as the vocabulary:
    /// token and position embeddings, pre-norm blocks (MLP ratio 4), a final LayerNorm and an
    /// LM head of `classes` logits per position (untied from the token embedding).
    pub fn preset(name: &str, classes: usize) -> Result<Self> {
        use LayerSpec::*;
        if let Some(&(_, blocks, heads, width, _)) = GPTS.iter().find(|g| g.0 == name) {
            let mut layers = vec![Embedding {
                vocab: classes,
                width,
                positions: true,
            }];
            layers.extend((0..blocks).map(|_| Block {
                heads,
                mlp_ratio: 4,
            }));
            layers.extend([
                LayerNorm { eps: NORM_EPS },
                Linear {
                    out: classes,
                    bias: true,
                },
            ]);
            return Ok(Self {
                name: name.to_string(),
                layers,
                tie_embeddings: false,
                stale_momentum: None,
            });
        }
        let mlp = |hidden: usize| {
            let mut layers = vec![Flatten];
            for _ in 0..hidden {
                layers.extend([
                    Linear {
                        out: 1024,
                        bias: true,
                    },
                    Relu,
                ]);
            }
            layers.push(Linear {
                out: classes,
                bias: true,
            });
            layers
        };
        let layers = match name {
            "tabular" => {
                return Err(Error::Config {
                    source_name: "preset \"tabular\"".into(),
                    reason: "the tabular preset is sized from the data's columns (preset_for)"
                        .into(),
                });
            }
            "mlp" => mlp(3),
            "mlp-deep" => mlp(8),
            "cnn" => vec![
                Conv2d {
                    out_channels: 32,
                    kernel: 5,
                    stride: 1,
                    padding: 0,
                },
                Relu,
                MaxPool2d {
                    kernel: 2,
                    stride: None,
                },
                Conv2d {
                    out_channels: 64,
                    kernel: 5,
                    stride: 1,
                    padding: 0,
                },
                Relu,
                MaxPool2d {
                    kernel: 2,
                    stride: None,
                },
                Flatten,
                Linear {
                    out: 512,
                    bias: true,
                },
                Relu,
                Linear {
                    out: classes,
                    bias: true,
                },
            ],
            other => {
                return Err(Error::Config {
                    source_name: format!("preset {other:?}"),
                    reason: format!("unknown preset; known presets are {}", PRESETS.join(", ")),
                });
            }
        };
        Ok(Self {
            name: name.to_string(),
            layers,
            tie_embeddings: false,
            // The mlp's stale updates train best at SGD's usual momentum (1 epoch, 4 workers,
            // ssp:2 and asp with warm-up: 96.0% at 0.9 against 94.6% at 0.6 and 93.6% at 0.3),
            // where the cnn's diverge (docs/decisions/defaults.md).
            stale_momentum: (name == "mlp").then_some(0.9),
        })
    }

    /// The `tabular` preset for a table of `features` input columns and `outputs` classes or
    /// targets: two hidden ReLU layers of `2 × features` rounded up to a power of two, between
    /// 64 and 512 wide (a plain MLP, the strong baseline of Gorishniy et al., "Revisiting Deep
    /// Learning Models for Tabular Data", 2021, at its small end).
    pub fn tabular(features: usize, outputs: usize) -> Self {
        use LayerSpec::*;
        let width = (2 * features).next_power_of_two().clamp(64, 512);
        Self {
            name: "tabular".into(),
            layers: vec![
                Flatten,
                Linear {
                    out: width,
                    bias: true,
                },
                Relu,
                Linear {
                    out: width,
                    bias: true,
                },
                Relu,
                Linear {
                    out: outputs,
                    bias: true,
                },
            ],
            tie_embeddings: false,
            stale_momentum: None,
        }
    }

    /// A preset by name for data of `features` input values: [`Self::preset`], and `tabular`
    /// sized from them.
    pub fn preset_for(name: &str, classes: usize, features: usize) -> Result<Self> {
        if name == "tabular" {
            return Ok(Self::tabular(features, classes));
        }
        Self::preset(name, classes)
    }

    /// The context (positions per window) a GPT preset is made for; `None` for other presets.
    pub fn preset_context(name: &str) -> Option<usize> {
        GPTS.iter().find(|g| g.0 == name).map(|g| g.4)
    }

    /// The GPT preset of `blocks` blocks of `heads` heads at `width` (MLP ratio 4), if any.
    pub fn gpt_preset_shaped(blocks: usize, heads: usize, width: usize) -> Option<&'static str> {
        GPTS.iter()
            .find(|g| (g.1, g.2, g.3) == (blocks, heads, width))
            .map(|g| g.0)
    }

    /// Whether the model reads token ids (it starts with an embedding).
    pub fn reads_tokens(&self) -> bool {
        matches!(self.layers.first(), Some(LayerSpec::Embedding { .. }))
    }

    /// Parses a TOML model description; `source_name` names it in errors.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self> {
        let mut spec: Self = toml::from_str(text).map_err(|e| Error::Config {
            source_name: source_name.to_string(),
            reason: e.to_string().trim_end().to_string(),
        })?;
        if spec.name.is_empty() {
            spec.name = source_name.to_string();
        }
        Ok(spec)
    }

    /// Reads and parses a TOML model file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Infers every layer's shapes from the per-sample `input` shape and checks that the model
    /// ends in `classes` logits.
    pub fn build(&self, input: &Shape, classes: usize) -> Result<Vec<Layer>> {
        self.build_for(input, &Shape::flat(classes))
    }

    /// Infers every layer's shapes from the per-sample `input` shape and checks that the model
    /// ends in `output`: `[classes]` for a classifier, `[positions, vocabulary]` for a language
    /// model (a logit per token at every position).
    pub fn build_for(&self, input: &Shape, output: &Shape) -> Result<Vec<Layer>> {
        if self.layers.is_empty() {
            return Err(self.config_error("the model has no layers".into()));
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut shape = input.clone();
        for (index, spec) in self.layers.iter().enumerate() {
            let kind = build_kind(index, spec, &shape)?;
            let output = output_shape(&kind, &shape);
            layers.push(Layer {
                index,
                kind,
                input: shape,
                output: output.clone(),
                init_gain: 1.0,
                tied_to: None,
            });
            shape = output;
        }
        // A language model's token ids come from the data's vocabulary: the embedding must have
        // a row for each (a smaller table would be read past its end).
        if let [_, vocab] = output.0[..] {
            for layer in &layers {
                if let LayerKind::Embedding(e) = &layer.kind
                    && e.vocab != vocab
                {
                    return Err(self.config_error(format!(
                        "layer {} (embedding) has a vocabulary of {} but the data's has {vocab} \
                         token ids; set `vocab = {vocab}`",
                        layer.index, e.vocab
                    )));
                }
            }
        }
        if &shape != output {
            let reason = match output.0[..] {
                [classes] => format!(
                    "the last layer produces {shape} per sample but the dataset has {classes} \
                     classes; end the model with a linear layer of {classes} outputs"
                ),
                _ => format!(
                    "the last layer produces {shape} per sample but the data asks for {output} \
                     (a logit per token of the vocabulary at every position); end the model with \
                     a linear layer of {} outputs over the sequence",
                    output.0.last().copied().unwrap_or(0)
                ),
            };
            return Err(self.config_error(reason));
        }
        // He initialisation (gain 2) for weights whose output goes through a ReLU, looking past
        // layers that do not mix values (pooling, flatten, dropout); LeCun (gain 1) otherwise.
        for i in 0..layers.len() {
            let feeds_relu = layers[i + 1..]
                .iter()
                .find(|l| {
                    !matches!(
                        l.kind,
                        LayerKind::MaxPool2d(_) | LayerKind::Flatten | LayerKind::Dropout(_)
                    )
                })
                .is_some_and(|l| l.kind == LayerKind::Relu);
            layers[i].init_gain = if feeds_relu { 2.0 } else { 1.0 };
        }
        // A language model's linear layers (its LM head, say) start as GPT-2's: normal with a
        // standard deviation of 0.02, as its blocks and embeddings do, so that the first logits
        // are near zero and the first loss near ln(vocabulary).
        if matches!(
            layers.first().map(|l| &l.kind),
            Some(LayerKind::Embedding(_))
        ) {
            for layer in &mut layers {
                if let LayerKind::Linear(l) = &layer.kind {
                    layer.init_gain = 0.02f32.powi(2) * l.in_features as f32;
                }
            }
        }
        if self.tie_embeddings {
            self.tie(&mut layers)?;
        }
        Ok(layers)
    }

    /// Marks the last layer (the head) as using the first layer's token table: the first must
    /// be an embedding and the last a linear layer of `vocab` outputs over `width` inputs.
    fn tie(&self, layers: &mut [Layer]) -> Result<()> {
        let refuse = |reason: String| {
            Err(self.config_error(format!(
                "tie_embeddings: {reason}; the head's weight [out, in] must be the token \
                 table [vocab, width]"
            )))
        };
        let Some(LayerKind::Embedding(e)) = layers.first().map(|l| &l.kind) else {
            return refuse("the model does not start with an embedding".into());
        };
        let (vocab, width) = (e.vocab, e.width);
        let Some(head) = layers.last_mut() else {
            return refuse("the model has no layers".into());
        };
        match &head.kind {
            LayerKind::Linear(l) if l.out_features == vocab && l.in_features == width => {
                head.tied_to = Some(0);
                Ok(())
            }
            LayerKind::Linear(l) => refuse(format!(
                "the last layer is linear {} → {} but the embedding is {vocab} × {width}",
                l.in_features, l.out_features
            )),
            _ => refuse(format!(
                "the last layer is {}, not linear",
                head.kind_name()
            )),
        }
    }

    fn config_error(&self, reason: String) -> Error {
        Error::Config {
            source_name: self.name.clone(),
            reason,
        }
    }
}

/// A Llama-family block from its description, over `input` (`[positions, width]`).
fn llama_block(spec: &LayerSpec, input: &Shape, index: usize) -> Result<LlamaBlock> {
    let LayerSpec::LlamaBlock {
        heads,
        kv_heads,
        head_dim,
        hidden,
        rope_theta,
        ref rope_scaling,
        eps,
        qkv_bias,
        qk_norm,
    } = *spec
    else {
        unreachable!("called on a llama_block")
    };
    let refuse = |reason: String| Error::Shape {
        index,
        kind: "llama_block",
        input: input.clone(),
        reason,
    };
    let [seq, width] = input.0[..] else {
        return Err(refuse("needs a sequence input [positions, width]".into()));
    };
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(refuse(format!(
            "{kv_heads} key/value heads must divide the {heads} query heads"
        )));
    }
    if head_dim == 0 || head_dim % 2 != 0 || width == 0 || hidden == 0 {
        return Err(refuse(format!(
            "the head size ({head_dim}) must be even and the width ({width}) and hidden              width ({hidden}) at least 1"
        )));
    }
    if !(rope_theta > 0.0 && rope_theta.is_finite() && eps > 0.0 && eps.is_finite()) {
        return Err(refuse(format!(
            "rope_theta ({rope_theta}) and eps ({eps}) must be positive numbers"
        )));
    }
    Ok(LlamaBlock {
        seq,
        width,
        heads,
        kv_heads,
        head_dim,
        hidden,
        rope_theta,
        rope_scaling: rope_scaling.clone(),
        eps,
        qkv_bias,
        qk_norm,
    })
}

/// Builds layer `index` of a model from its description and per-sample input shape (with the
/// LeCun initialisation gain; [`ModelSpec::build`] sets He where the layer feeds a ReLU).
pub fn build_layer(index: usize, spec: &LayerSpec, input: &Shape) -> Result<Layer> {
    let kind = build_kind(index, spec, input)?;
    let output = output_shape(&kind, input);
    Ok(Layer {
        index,
        kind,
        input: input.clone(),
        output,
        init_gain: 1.0,
        tied_to: None,
    })
}

#[expect(
    clippy::too_many_lines,
    reason = "one arm per layer kind, each checking its own shape"
)]
fn build_kind(index: usize, spec: &LayerSpec, input: &Shape) -> Result<LayerKind> {
    let shape_err = |kind: &'static str, reason: String| Error::Shape {
        index,
        kind,
        input: input.clone(),
        reason,
    };
    Ok(match *spec {
        LayerSpec::Linear { out, bias } => {
            // A flat input, or a sequence `[positions, features]`: every position alike.
            let in_features = match input.0[..] {
                [f] | [_, f] => f,
                _ => {
                    return Err(shape_err(
                        "linear",
                        "needs a flat input or a sequence [positions, features]; add a flatten \
                         layer before it"
                            .into(),
                    ));
                }
            };
            if out == 0 {
                return Err(shape_err("linear", "`out` must be at least 1".into()));
            }
            LayerKind::Linear(Linear {
                in_features,
                out_features: out,
                bias,
            })
        }
        LayerSpec::Conv2d {
            out_channels,
            kernel,
            stride,
            padding,
        } => {
            let Some((h, w, c)) = input.as_image() else {
                return Err(shape_err(
                    "conv2d",
                    "needs an image input [height, width, channels]".into(),
                ));
            };
            if out_channels == 0 || kernel == 0 || stride == 0 {
                return Err(shape_err(
                    "conv2d",
                    "out_channels, kernel and stride must be at least 1".into(),
                ));
            }
            if padding >= kernel {
                return Err(shape_err(
                    "conv2d",
                    format!("padding {padding} must be below the kernel size {kernel}"),
                ));
            }
            if h + 2 * padding < kernel || w + 2 * padding < kernel {
                return Err(shape_err(
                    "conv2d",
                    format!("a {kernel}×{kernel} kernel does not fit the input"),
                ));
            }
            LayerKind::Conv2d(Conv2d {
                in_height: h,
                in_width: w,
                in_channels: c,
                out_channels,
                kernel,
                stride,
                padding,
                out_height: (h + 2 * padding - kernel) / stride + 1,
                out_width: (w + 2 * padding - kernel) / stride + 1,
            })
        }
        LayerSpec::MaxPool2d { kernel, stride } => {
            let Some((h, w, c)) = input.as_image() else {
                return Err(shape_err(
                    "max_pool2d",
                    "needs an image input [height, width, channels]".into(),
                ));
            };
            let stride = stride.unwrap_or(kernel);
            if kernel == 0 || stride == 0 {
                return Err(shape_err(
                    "max_pool2d",
                    "kernel and stride must be at least 1".into(),
                ));
            }
            if h < kernel || w < kernel {
                return Err(shape_err(
                    "max_pool2d",
                    format!("a {kernel}×{kernel} window does not fit the input"),
                ));
            }
            LayerKind::MaxPool2d(MaxPool2d {
                in_height: h,
                in_width: w,
                channels: c,
                kernel,
                stride,
                out_height: (h - kernel) / stride + 1,
                out_width: (w - kernel) / stride + 1,
            })
        }
        LayerSpec::Relu => LayerKind::Relu,
        LayerSpec::Gelu => LayerKind::Gelu,
        LayerSpec::CausalSelfAttention { heads } => {
            let [seq, width] = input.0[..] else {
                return Err(shape_err(
                    "causal_self_attention",
                    "needs a sequence input [positions, width]".into(),
                ));
            };
            if heads == 0 || width == 0 || width % heads != 0 {
                return Err(shape_err(
                    "causal_self_attention",
                    format!("{heads} heads must divide the width {width}"),
                ));
            }
            LayerKind::CausalSelfAttention(CausalSelfAttention { seq, width, heads })
        }
        LayerSpec::Block { heads, mlp_ratio } => {
            let [seq, width] = input.0[..] else {
                return Err(shape_err(
                    "block",
                    "needs a sequence input [positions, width]".into(),
                ));
            };
            if heads == 0 || width == 0 || width % heads != 0 || mlp_ratio == 0 {
                return Err(shape_err(
                    "block",
                    format!(
                        "{heads} heads must divide the width {width}, and mlp_ratio be at least 1"
                    ),
                ));
            }
            LayerKind::Block(Block {
                seq,
                width,
                heads,
                mlp_ratio,
            })
        }
        LayerSpec::LlamaBlock { .. } => LayerKind::LlamaBlock(llama_block(spec, input, index)?),
        LayerSpec::Embedding {
            vocab,
            width,
            positions,
        } => {
            let Some(seq) = input.as_flat() else {
                return Err(shape_err(
                    "embedding",
                    "needs a sequence of token ids [positions]".into(),
                ));
            };
            if vocab == 0 || width == 0 || seq == 0 {
                return Err(shape_err(
                    "embedding",
                    "vocab, width and the positions must be at least 1".into(),
                ));
            }
            LayerKind::Embedding(Embedding {
                vocab,
                seq,
                width,
                positions,
            })
        }
        LayerSpec::LayerNorm { eps } | LayerSpec::RmsNorm { eps } => {
            let kind = if matches!(spec, LayerSpec::LayerNorm { .. }) {
                NormKind::Layer
            } else {
                NormKind::Rms
            };
            let Some(&features) = input.0.last().filter(|f| **f > 0) else {
                return Err(shape_err(
                    if kind == NormKind::Layer {
                        "layer_norm"
                    } else {
                        "rms_norm"
                    },
                    "needs an input with a last dimension to normalise".into(),
                ));
            };
            if !(eps > 0.0 && eps.is_finite()) {
                return Err(shape_err(
                    "norm",
                    format!("eps must be a positive number, not {eps}"),
                ));
            }
            LayerKind::Norm(Norm {
                kind,
                features,
                eps,
            })
        }
        LayerSpec::Flatten => LayerKind::Flatten,
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(&p) {
                return Err(shape_err("dropout", format!("p = {p} must be in [0, 1)")));
            }
            LayerKind::Dropout(Dropout { p })
        }
    })
}

fn output_shape(kind: &LayerKind, input: &Shape) -> Shape {
    match kind {
        LayerKind::Linear(l) => match input.0[..] {
            [positions, _] => Shape(vec![positions, l.out_features]),
            _ => Shape::flat(l.out_features),
        },
        LayerKind::Conv2d(c) => Shape::image(c.out_height, c.out_width, c.out_channels),
        LayerKind::MaxPool2d(p) => Shape::image(p.out_height, p.out_width, p.channels),
        LayerKind::Flatten => Shape::flat(input.numel()),
        LayerKind::Relu
        | LayerKind::Dropout(_)
        | LayerKind::Norm(_)
        | LayerKind::Gelu
        | LayerKind::CausalSelfAttention(_)
        | LayerKind::Block(_)
        | LayerKind::LlamaBlock(_) => input.clone(),
        LayerKind::Embedding(e) => Shape(vec![e.seq, e.width]),
        LayerKind::LinearHead(p) => Shape::flat(p.in_features + p.split),
        LayerKind::LinearTail(p) => Shape::flat(p.out_features),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_count(layers: &[Layer]) -> usize {
        layers.iter().map(Layer::param_count).sum()
    }

    #[test]
    fn presets_have_the_documented_architecture() {
        let mnist = Shape::image(28, 28, 1);
        let mlp = ModelSpec::preset("mlp", 10)
            .unwrap()
            .build(&mnist, 10)
            .unwrap();
        assert_eq!(
            param_count(&mlp),
            784 * 1024 + 1024 + 2 * (1024 * 1024 + 1024) + 1024 * 10 + 10
        );
        let deep = ModelSpec::preset("mlp-deep", 10)
            .unwrap()
            .build(&mnist, 10)
            .unwrap();
        assert_eq!(deep.iter().filter(|l| l.kind_name() == "linear").count(), 9);
        let cnn = ModelSpec::preset("cnn", 10)
            .unwrap()
            .build(&mnist, 10)
            .unwrap();
        let shapes: Vec<String> = cnn.iter().map(|l| l.output.to_string()).collect();
        assert_eq!(
            shapes,
            [
                "[24, 24, 32]",
                "[24, 24, 32]",
                "[12, 12, 32]",
                "[8, 8, 64]",
                "[8, 8, 64]",
                "[4, 4, 64]",
                "[1024]",
                "[512]",
                "[512]",
                "[10]"
            ]
        );
        // He for layers feeding ReLU, LeCun for the logits.
        assert_eq!(cnn[0].init_gain, 2.0);
        assert_eq!(cnn[9].init_gain, 1.0);
    }

    #[test]
    fn unknown_preset_is_a_config_error() {
        let err = ModelSpec::preset("resnet", 10).unwrap_err();
        assert!(err.to_string().contains("unknown preset"), "{err}");
    }

    #[test]
    fn toml_unknown_layer_and_unknown_key_are_errors() {
        let err = ModelSpec::from_toml("[[layer]]\ntype = \"lstm\"\n", "m.toml").unwrap_err();
        assert!(
            err.to_string().contains("m.toml") && err.to_string().contains("lstm"),
            "{err}"
        );
        let err = ModelSpec::from_toml(
            "[[layer]]\ntype = \"linear\"\nout = 3\nactivation = false\n",
            "m.toml",
        )
        .unwrap_err();
        assert!(err.to_string().contains("activation"), "{err}");
        let err =
            ModelSpec::from_toml("colour = 1\n[[layer]]\ntype = \"relu\"\n", "m.toml").unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
    }

    #[test]
    fn conv_on_flat_input_is_a_shape_error_naming_the_layer() {
        let spec = ModelSpec::from_toml(
            "[[layer]]\ntype = \"flatten\"\n[[layer]]\ntype = \"conv2d\"\nout_channels = 4\nkernel = 3\n",
            "m.toml",
        )
        .unwrap();
        let err = spec.build(&Shape::image(8, 8, 1), 10).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("layer 1 (conv2d)") && text.contains("[64]"),
            "{text}"
        );
    }

    #[test]
    fn wrong_class_count_is_reported() {
        let spec = ModelSpec::from_toml(
            "[[layer]]\ntype = \"flatten\"\n[[layer]]\ntype = \"linear\"\nout = 3\n",
            "m",
        )
        .unwrap();
        let err = spec.build(&Shape::image(8, 8, 1), 10).unwrap_err();
        assert!(err.to_string().contains("10 classes"), "{err}");
    }

    #[test]
    fn oversized_kernel_is_a_shape_error() {
        let err = ModelSpec::preset("cnn", 10)
            .unwrap()
            .build(&Shape::image(8, 8, 1), 10)
            .unwrap_err();
        assert!(err.to_string().contains("layer 3 (conv2d)"), "{err}");
    }

    #[test]
    fn gpt_presets_are_nanogpts_shapes_and_their_vocabulary_is_the_datas() {
        // nanoGPT's counts with an untied head of 77 logits and its bias: gpt-small is the
        // 10.8 M of PyTorch's model in benches/reference/gpt_train_speed.py.
        for (name, seq, params) in [
            ("gpt-nano", 32, None),
            ("gpt-cpu", 64, Some(821_325)),
            ("gpt-small", 256, Some(10_805_069)),
            ("gpt-100m", 256, Some(99_546_701)),
        ] {
            assert_eq!(ModelSpec::preset_context(name), Some(seq));
            let spec = ModelSpec::preset(name, 77).unwrap();
            assert!(spec.reads_tokens());
            let layers = spec
                .build_for(&Shape::flat(seq), &Shape(vec![seq, 77]))
                .unwrap();
            let count = param_count(&layers);
            match params {
                Some(p) => assert_eq!(count, p, "{name}"),
                None => assert!(count < 1_000_000, "{name}: {count}"),
            }
            // GPT-2's 0.02 for the head too.
            let head = layers.last().unwrap();
            let LayerKind::Linear(l) = &head.kind else {
                panic!("{name}")
            };
            assert!((head.init_gain / l.in_features as f32 - 0.0004).abs() < 1e-9);
        }
        // An embedding smaller than the data's vocabulary is refused (its table would be read
        // past its end), naming the number to set.
        let spec = ModelSpec::from_toml(
            "[[layer]]\ntype = \"embedding\"\nvocab = 50\nwidth = 8\n\
             [[layer]]\ntype = \"linear\"\nout = 77\n",
            "m.toml",
        )
        .unwrap();
        let err = spec
            .build_for(&Shape::flat(16), &Shape(vec![16, 77]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("vocabulary of 50") && err.contains("vocab = 77"),
            "{err}"
        );
    }
}
