//! `ringtmp inspect PATH`: what a pretrained model's file or directory holds — its
//! architecture, its parameters (and where they lie in the chain a ring cuts), its tensors'
//! types, the memory its weights take at f32 and bf16 and training them with AdamW takes, and
//! its tokenizer and chat template — read from the metadata and tensor table only; with
//! `--nodes N`, how a ring of N nodes would hold it (each node's layers, parameters and memory
//! to generate and to fine-tune), against `--node-memory-limit`.

use std::path::PathBuf;

use anyhow::Result;
use ringtmp_pretrained::config::{Family, ModelConfig, RopeScaling};
use ringtmp_pretrained::gguf::Gguf;
use ringtmp_pretrained::hf::HfModel;
use ringtmp_pretrained::vocabulary::Vocabulary;

use crate::error::UsageError;

/// `ringtmp inspect` options.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// A GGUF file, or a Hugging Face model directory (config.json and safetensors).
    pub path: PathBuf,
    /// The ring plan for N nodes: each node's layers (balanced by parameters), parameters, and
    /// memory to generate (f32 weights) and to fine-tune fully (weights, gradients and AdamW's
    /// two moments: 16 bytes a parameter).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub nodes: Option<u32>,
    /// With --nodes: each node's memory (`768M`, `1G`); the plan says which nodes fit, and the
    /// fewest nodes at which every one does.
    #[arg(long, value_name = "LIMIT", requires = "nodes", value_parser = bytes)]
    pub node_memory_limit: Option<u64>,
}

/// A reader's error is the user's input (exit 2).
/// A size as the cluster options read one (`768M`, `1.5G`).
fn bytes(text: &str) -> std::result::Result<u64, String> {
    use ringtmp_strategy::per_node::NodeValue;
    ringtmp_strategy::per_node::Bytes::parse(text).map(|b| b.0)
}

fn usage(e: impl std::fmt::Display) -> anyhow::Error {
    UsageError(e.to_string()).into()
}

/// `ringtmp inspect`.
pub fn run(args: &InspectArgs) -> Result<()> {
    let path = &args.path;
    if path.is_dir() {
        let model = HfModel::open(path).map_err(usage)?;
        let config =
            ModelConfig::from_hf(&path.join("config.json"), &model.config).map_err(usage)?;
        println!(
            "{}: a Hugging Face model directory, {} shard(s)",
            path.display(),
            model.shards.len()
        );
        describe(&config);
        let mut types = std::collections::BTreeMap::new();
        let mut file_bytes = 0u64;
        for t in model.tensors.values() {
            *types.entry(format!("{:?}", t.dtype)).or_insert(0usize) += 1;
            file_bytes +=
                (t.shape.iter().product::<usize>() as u64 * t.dtype.bitsize() as u64).div_ceil(8);
        }
        tensors(&types, model.tensors.len(), file_bytes);
        let held = model
            .tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>() as u64);
        check_held(&config, held.sum());
        vocabulary(model.vocabulary().ok());
    } else if path.is_file() {
        let file = Gguf::open(path).map_err(usage)?;
        let config = ModelConfig::from_gguf(&file).map_err(usage)?;
        println!("{}: GGUF version {}", path.display(), file.version);
        describe(&config);
        let mut types = std::collections::BTreeMap::new();
        for t in &file.tensors {
            *types.entry(t.kind.name()).or_insert(0usize) += 1;
        }
        let bytes = file.tensors.iter().map(|t| t.bytes).sum();
        tensors(&types, file.tensors.len(), bytes);
        check_held(&config, file.tensors.iter().map(|t| t.elements()).sum());
        vocabulary(file.vocabulary().ok());
    } else {
        return Err(usage(format!(
            "{}: no such file or directory (a GGUF file or a Hugging Face model directory)",
            path.display()
        )));
    }
    if let Some(nodes) = args.nodes {
        ring_plan(args, nodes)?;
    }
    Ok(())
}

/// Bytes a node holds per parameter to generate (f32 weights) and to fine-tune (the weights,
/// their gradient and AdamW's two moments).
const GENERATE_BYTES: u64 = 4;
const TRAIN_BYTES: u64 = 16;

/// The plan of a ring of `nodes` nodes holding the model (its layers balanced by parameters,
/// a tied head's copy of the embedding counted where it lies).
fn ring_plan(args: &InspectArgs, nodes: u32) -> Result<()> {
    let model = ringtmp_pretrained::model::Pretrained::open(&args.path).map_err(usage)?;
    let layers = model.layers(model.config.context.min(256)).map_err(usage)?;
    let params = |r: &(usize, usize)| -> u64 {
        layers[r.0..r.1]
            .iter()
            .map(|l| l.param_count() as u64)
            .sum()
    };
    let partition =
        ringtmp_strategy::generate::partition(&layers, nodes as usize).map_err(usage)?;
    let limit = args.node_memory_limit;
    println!(
        "  ring of {nodes} node(s) (layers balanced by parameters{}):",
        limit.map_or(String::new(), |l| format!("; each node {}", mib(l)))
    );
    for (rank, range) in partition.iter().enumerate() {
        let p = params(range);
        let fits = |bytes: u64| match limit {
            Some(l) if bytes > l => " (over)",
            _ => "",
        };
        println!(
            "    node {rank}: layers {}..{}, {p} parameters; generate {}{}, fine-tune {}{}",
            range.0,
            range.1,
            mib(p * GENERATE_BYTES),
            fits(p * GENERATE_BYTES),
            mib(p * TRAIN_BYTES),
            fits(p * TRAIN_BYTES)
        );
    }
    if let Some(limit) = limit {
        let fewest = |bytes: u64| {
            (1..=layers.len()).find(|&n| {
                ringtmp_strategy::generate::partition(&layers, n)
                    .is_ok_and(|p| p.iter().all(|r| params(r) * bytes <= limit))
            })
        };
        let say = |n: Option<usize>| {
            n.map_or_else(
                || "no ring: one layer alone is more".to_string(),
                |n| format!("{n} node(s)"),
            )
        };
        println!(
            "    fewest nodes of {} that hold it: {} to generate, {} to fine-tune (weights, \
             gradients and AdamW; activations besides)",
            mib(limit),
            say(fewest(GENERATE_BYTES)),
            say(fewest(TRAIN_BYTES))
        );
    }
    Ok(())
}

fn family_name(family: Family) -> &'static str {
    match family {
        Family::Llama => "Llama",
        Family::Qwen2 => "Qwen 2",
        Family::Qwen3 => "Qwen 3",
        Family::Gpt2 => "GPT-2",
    }
}

fn mib(bytes: u64) -> String {
    let mib = bytes as f64 / f64::from(1u32 << 20);
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// The architecture, the parameters and the memory they take.
fn describe(c: &ModelConfig) {
    println!(
        "  architecture: {} — {} blocks, width {}, {} heads ({} key/value heads, head size {}), \
         MLP {}, vocabulary {}, context {}",
        family_name(c.family),
        c.layers,
        c.width,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.intermediate,
        c.vocab,
        c.context
    );
    let rope = match &c.rope_scaling {
        None => String::new(),
        Some(RopeScaling::Linear { factor }) => format!(", linear scaling ×{factor}"),
        Some(RopeScaling::Llama3 { factor, .. }) => format!(", Llama 3 scaling ×{factor}"),
        Some(RopeScaling::Factors { factors }) => format!(
            ", frequencies scaled by a table (up to ×{:.0})",
            factors.iter().copied().fold(1.0, f64::max)
        ),
    };
    if c.family != Family::Gpt2 {
        println!(
            "  RoPE base {}{rope}; RMSNorm epsilon {:e}; head {}",
            c.rope_theta,
            // As the file stores it (f32 in GGUF), without the widening's digits.
            c.norm_eps as f32,
            if c.tie_embeddings {
                "tied to the embedding"
            } else {
                "its own"
            }
        );
    }
    let params = c.parameters();
    let blocks = c.block_parameters() * c.layers as u64;
    println!(
        "  parameters: {params} ({} in the embedding, {} in each of {} blocks, {} in the head)",
        c.vocab * c.width,
        c.block_parameters(),
        c.layers,
        params - blocks - (c.vocab * c.width) as u64
    );
    // Training keeps f32 weights, their gradients and AdamW's two moments: 16 bytes each.
    println!(
        "  memory: weights {} at f32, {} at bf16; full training with AdamW {}",
        mib(params * 4),
        mib(params * 2),
        mib(params * 16)
    );
}

/// Says so when the files hold another number of parameters than the architecture describes
/// (tensors missing, or of another model).
fn check_held(c: &ModelConfig, held: u64) {
    if held != c.parameters() {
        println!(
            "  note: the tensors hold {held} parameters, where this architecture has {}",
            c.parameters()
        );
    }
}

/// The tensors' types and the bytes they take in the file.
fn tensors(types: &std::collections::BTreeMap<String, usize>, count: usize, bytes: u64) {
    let list: Vec<String> = types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "  tensors: {count} ({}), {} as stored",
        list.join(", "),
        mib(bytes)
    );
}

/// The tokenizer and chat template.
fn vocabulary(v: Option<Vocabulary>) {
    let Some(v) = v else {
        println!("  tokenizer: none that ringtmp reads");
        return;
    };
    let tokens = v.tokenizer.get_vocab_size(true);
    let token = |id: Option<u32>| {
        id.and_then(|i| v.tokenizer.id_to_token(i))
            .map_or_else(|| "none".to_string(), |t| format!("{t:?}"))
    };
    let stop: Vec<String> = v.stop.iter().map(|s| token(Some(*s))).collect();
    println!(
        "  tokenizer: {tokens} tokens, BOS {}, stops at {}; {}",
        token(v.bos),
        if stop.is_empty() {
            "nothing".to_string()
        } else {
            stop.join(", ")
        },
        if v.chat_template.is_some() {
            "a chat template"
        } else {
            "no chat template"
        }
    );
}
