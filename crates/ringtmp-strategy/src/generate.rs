//! Generation over a ring of nodes (`ringtmp generate --nodes N`): a language model's layers
//! stay split as a checkpoint is loaded — each node reads only the tensors of its own layers —
//! and the tokens travel the ring. Rank 0 holds the first layers (the embedding) and the
//! sampling: it encodes the new positions, sends their activations to rank 1, and so on around
//! the ring; the last node sends the logits of the last position back to rank 0, which draws
//! the next token. Each node keeps the KV cache of its own attentions
//! ([`ringtmp_model::decode::Decoder`]), so no node ever holds the whole model or its cache.
//!
//! The protocol, per feed of `r` new positions: rank 0 → 1 → … → N−1 an inference tensor of
//! `r` rows (`step` = the feed's number, `micro_batch` = `r`), N−1 → 0 the last row's logits
//! (the same tag, one row). `Reset` travels the ring
//! when the context refills; `Stop` when the generation ends. Every wait is bounded by the job's
//! receive timeout, and a message out of order is a protocol error naming its sender.
//!
//! Invariants: the tokens equal a one-process generation's for the same checkpoint, prompt and
//! seed (each stage computes what the whole model's layers would; activations travel as f32);
//! every node's decoder is at the same position after each feed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ringtmp_model::checkpoint;
use ringtmp_model::decode::Decoder;
use ringtmp_model::generate::{Chain, Generated, Sampling, generate};
use ringtmp_model::packed::InferenceStage;
use ringtmp_model::{Layer, LayerKind, Shape, Stage};
use ringtmp_pretrained::held::WeightsDtype;
use ringtmp_transport::Transport;
use ringtmp_wire::message::{tensor_bytes_into, tensor_values};
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};
use serde::{Deserialize, Serialize};

use crate::messages::StrategyMessage;
use ringtmp_contract::error::{Error, Result};

/// What every node of a split generation must agree on (rank 0 hands it out at rendezvous).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateJob {
    /// The checkpoint directory, or the pretrained model's file or directory when
    /// `pretrained` (every node reads its own layers' tensors from it).
    pub checkpoint: PathBuf,
    /// `checkpoint` is a pretrained model (a GGUF file or a Hugging Face directory).
    #[serde(default)]
    pub pretrained: bool,
    /// Each node's layers, `[start, end)`, in ring order.
    pub partition: Vec<(usize, usize)>,
    /// Layers after the ring's that rank 0 runs on the last position the last node sends back
    /// (`[start, end)`: the final norm and a head tied to rank 0's embedding, whose table it
    /// then holds once rather than the last node holding it a second time).
    #[serde(default)]
    pub tail: Option<(usize, usize)>,
    /// The model's context (positions per sequence).
    pub context: usize,
    /// Token ids.
    pub vocab: usize,
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Tokens to draw.
    pub tokens: usize,
    /// How they are drawn.
    pub temperature: f32,
    /// Only the `top_k` most likely (0: all).
    pub top_k: usize,
    /// Only the most likely whose probabilities sum to `top_p` (1: all).
    #[serde(default = "all")]
    pub top_p: f32,
    /// Seeds the draws.
    pub seed: u64,
    /// Tokens that end the generation (a pretrained model's end of sequence or turn).
    #[serde(default)]
    pub stop: Vec<u32>,
    /// Whether rank 0 prints the prompt before the tokens (not a chat's rendered template).
    #[serde(default = "yes")]
    pub print_prompt: bool,
    /// Compute threads per node.
    pub threads: usize,
    /// Longest wait for any one message, in seconds.
    pub recv_timeout_secs: f64,
    /// The `tokenizer.json` of a BPE vocabulary (rank 0 decodes the tokens it draws).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// How each node holds its matrices (`--weights-dtype`).
    #[serde(default)]
    pub weights_dtype: WeightsDtype,
    /// How products over 8- and 4-bit blocks take the vector (`--activations`); unsaid, each
    /// node as its CPU computes fastest without changing the answers.
    #[serde(default)]
    pub activations: Option<ringtmp_model::packed::Activations>,
}

fn all() -> f32 {
    1.0
}

fn yes() -> bool {
    true
}

/// The split generation's own messages (as [`StrategyMessage`]s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenerateMessage {
    /// Forget the sequence: the context refills.
    Reset,
    /// The generation is over.
    Stop,
}

impl StrategyMessage for GenerateMessage {
    const STRATEGY: &'static str = "generate";

    fn kind(&self) -> &'static str {
        match self {
            Self::Reset => "Reset",
            Self::Stop => "Stop",
        }
    }
}

/// Splits `layers` over `nodes` contiguous ranges that balance their parameters (the largest
/// node's share as small as it can be: what bounds the model a ring of equal nodes can hold).
pub fn partition(layers: &[Layer], nodes: usize) -> Result<Vec<(usize, usize)>> {
    let weight: Vec<u64> = layers.iter().map(|l| l.param_count() as u64).collect();
    partition_weighted(&weight, nodes)
}

/// Where rank 0 may run the model's last layers itself ([`GenerateJob::tail`]) when split over
/// `nodes`: the layers after the last attention, when the head reads the table of the
/// embedding rank 0 holds (a tied head). Worth it where both read the same memory (views of
/// a mapped file), so that no node holds the table twice.
pub fn tail_of(layers: &[Layer], nodes: usize) -> Option<(usize, usize)> {
    let n = layers.len();
    let tied = layers.last()?.tied_to.is_some();
    let last_attention = layers.iter().rposition(|l| {
        !matches!(
            l.kind,
            LayerKind::Norm(_) | LayerKind::Linear(_) | LayerKind::Embedding(_)
        )
    })?;
    (nodes > 1 && tied && last_attention + 1 < n && last_attention + 1 >= nodes)
        .then_some((last_attention + 1, n))
}

/// Splits layers whose sizes are `weight` over `nodes` contiguous ranges, the largest share as
/// small as it can be.
pub fn partition_weighted(weight: &[u64], nodes: usize) -> Result<Vec<(usize, usize)>> {
    let n = weight.len();
    if nodes == 0 || nodes > n {
        return Err(Error::Config(format!(
            "--nodes {nodes}: the model has {n} layers, so it splits over 1 to {n} nodes"
        )));
    }
    let mut prefix = vec![0u64; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + weight[i];
    }
    // best[k][i]: the smallest largest share splitting the first i layers over k nodes.
    let mut best = vec![vec![u64::MAX; n + 1]; nodes + 1];
    let mut cut = vec![vec![0usize; n + 1]; nodes + 1];
    best[0][0] = 0;
    for k in 1..=nodes {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == u64::MAX {
                    continue;
                }
                let share = best[k - 1][j].max(prefix[i] - prefix[j]);
                if share < best[k][i] {
                    best[k][i] = share;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(nodes);
    let mut end = n;
    for k in (1..=nodes).rev() {
        let start = cut[k][end];
        ranges.push((start, end));
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

impl GenerateJob {
    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.recv_timeout_secs.max(0.001))
    }

    /// Checks a job from the network before anything uses it.
    pub fn validate(&self, world: u32) -> Result<()> {
        let contiguous = self
            .partition
            .windows(2)
            .all(|w| w[0].1 == w[1].0 && w[0].0 < w[0].1);
        let tail_follows = self.tail.is_none_or(|(start, end)| {
            world > 1 && start < end && self.partition.last().map(|p| p.1) == Some(start)
        });
        if self.partition.len() != world as usize
            || self.partition.first().map(|p| p.0) != Some(0)
            || !contiguous
            || !tail_follows
            || self.prompt.is_empty()
            || self.tokens == 0
            || self.prompt.iter().any(|&t| t as usize >= self.vocab)
        {
            return Err(Error::Config(format!(
                "a generation job for {world} nodes with partition {:?}, {} prompt tokens and {} \
                 to draw does not hold together",
                self.partition,
                self.prompt.len(),
                self.tokens
            )));
        }
        Ok(())
    }

    /// Node `rank`'s stage, its parameters read from the checkpoint or the pretrained model
    /// (its own layers' tensors), its matrices held as `weights_dtype` says.
    pub fn stage(&self, rank: u32) -> Result<InferenceStage> {
        let mut stages =
            self.stages_of(&[self.partition[rank as usize]], &format!("node {rank}"))?;
        Ok(stages.remove(0))
    }

    /// Rank 0's stages: its part of the ring, and the tail ([`GenerateJob::tail`]) when there
    /// is one (the model's files opened once for both).
    pub fn master_stages(&self) -> Result<(InferenceStage, Option<InferenceStage>)> {
        let mut ranges = vec![self.partition[0]];
        ranges.extend(self.tail);
        let mut stages = self.stages_of(&ranges, "node 0")?.into_iter();
        let ring = stages.next().expect("one stage a range");
        Ok((ring, stages.next()))
    }

    /// The stages of the layer ranges `[start, end)` (`who` holds them, for errors).
    fn stages_of(&self, ranges: &[(usize, usize)], who: &str) -> Result<Vec<InferenceStage>> {
        let past = |(start, end): (usize, usize), n: usize| {
            Error::Config(format!(
                "{who}'s layers {start}..{end} are past the model's {n}"
            ))
        };
        if self.pretrained {
            // A node computes and never tokenizes: the file's tokenizer stays unread.
            let model = ringtmp_pretrained::model::Pretrained::open_weights(&self.checkpoint)
                .map_err(|e| Error::Config(e.to_string()))?;
            let layers = model
                .layers(self.context)
                .map_err(|e| Error::Config(e.to_string()))?;
            return ranges
                .iter()
                .map(|&(start, end)| {
                    if end > layers.len() {
                        return Err(past((start, end), layers.len()));
                    }
                    Ok(model
                        .inference_stage(&layers, start..end, self.threads, self.weights_dtype)
                        .map_err(|e| Error::Config(e.to_string()))?
                        .with_activations(self.activations()))
                })
                .collect();
        }
        let layers = model_layers(&self.checkpoint, self.context, self.vocab)?;
        let manifest = checkpoint::read_manifest(&self.checkpoint)?;
        ranges
            .iter()
            .map(|&(start, end)| {
                if end > layers.len() {
                    return Err(past((start, end), layers.len()));
                }
                let mut stage = Stage::new(&layers, start..end, manifest.seed, self.threads);
                checkpoint::read_params(&self.checkpoint, &manifest, &mut stage)?;
                Ok(
                    InferenceStage::from_stage(&stage, self.weights_dtype.format())
                        .with_activations(self.activations()),
                )
            })
            .collect()
    }
}

impl GenerateJob {
    /// How this node's products take the vector: as the job says, else as its CPU computes
    /// fastest without changing the answers.
    fn activations(&self) -> ringtmp_model::packed::Activations {
        self.activations
            .unwrap_or_else(ringtmp_model::packed::Activations::default_for_cpu)
    }
}

/// The layers of the language model in checkpoint `dir`, for a context of `context` positions
/// and `vocab` token ids.
pub fn model_layers(dir: &Path, context: usize, vocab: usize) -> Result<Vec<Layer>> {
    let manifest = checkpoint::read_manifest(dir)?;
    Ok(manifest
        .model
        .build_for(&Shape::flat(context), &Shape(vec![context, vocab]))?)
}

/// Runs rank `rank` of a split generation; rank 0 hands each token to `on_token` as it is
/// drawn and returns the generation's figures and its own cache's size.
pub fn run(
    job: &GenerateJob,
    rank: u32,
    net: &mut dyn Transport,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Option<(Generated, usize)>> {
    let (stage, tail) = if rank == 0 {
        job.master_stages()?
    } else {
        (job.stage(rank)?, None)
    };
    release_freed_memory();
    let world = job.partition.len() as u32;
    let decoder = match Decoder::new(&stage)? {
        d if rank + 1 == world => d.last_position_only(),
        d => d,
    };
    if rank != 0 {
        serve(job, rank, world, &stage, decoder, net)?;
        return Ok(None);
    }
    let tail = match tail {
        Some(stage) => {
            let decoder = Decoder::new(&stage)?;
            Some((stage, decoder))
        }
        None => None,
    };
    let mut chain = RingChain {
        job,
        world,
        stage,
        decoder,
        tail,
        net,
        feeds: 0,
        activations: Vec::new(),
    };
    let sampling = Sampling {
        top_p: job.top_p,
        stop: job.stop.clone(),
        ..Sampling::top_k(job.temperature, job.top_k, job.seed)
    };
    let generated = generate(&mut chain, &job.prompt, job.tokens, &sampling, on_token)?;
    if world > 1 {
        chain.net.send(1, GenerateMessage::Stop.to_message())?;
    }
    let cache = chain.decoder.cache_bytes();
    Ok(Some((generated, cache)))
}

/// Hands the heap's freed pages back to the system: loading a stage parses the model file's
/// metadata (its tokenizer's tens of thousands of strings) and builds scratch that is freed
/// before decoding starts, and glibc's allocator would otherwise keep those pages in the
/// process's resident set beside the weights' pages decoding then touches.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory to the system; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A tensor message of `values` (`rows` rows) for feed `feed`.
fn tensor(net: &dyn Transport, tag: TensorTag, feed: u64, rows: usize, values: &[f32]) -> Message {
    let header = TensorHeader {
        run_id: 0,
        step: feed,
        micro_batch: rows as u64,
        tag,
        dtype: Dtype::F32,
        shape: vec![values.len() as u32],
    };
    let mut payload = net.buffers().take(values.len() * 4);
    tensor_bytes_into(values, Dtype::F32, &mut payload);
    Message::Tensor(header, payload)
}

/// Rank 0's view of the ring as one model.
struct RingChain<'a> {
    job: &'a GenerateJob,
    world: u32,
    stage: InferenceStage,
    decoder: Decoder,
    /// The layers rank 0 runs on what the last node sends back.
    tail: Option<(InferenceStage, Decoder)>,
    net: &'a mut dyn Transport,
    /// Feeds so far (each tensor carries its number).
    feeds: u64,
    activations: Vec<f32>,
}

impl Chain for RingChain<'_> {
    type Error = Error;

    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let x: Vec<f32> = ids.iter().map(|&t| t as f32).collect();
        let out = self.decoder.step(&self.stage, &x, ids.len())?;
        let feed = self.feeds;
        self.feeds += 1;
        if self.world == 1 {
            // A node alone decodes the last position's logits alone.
            return Ok(out.to_vec());
        }
        let message = tensor(&*self.net, TensorTag::Inference, feed, ids.len(), out);
        self.net.send(1, message)?;
        let last = self.world - 1;
        match self.net.recv_from(last, self.job.timeout())? {
            Message::Tensor(h, bytes)
                if h.tag == TensorTag::Inference && h.step == feed && h.micro_batch == 1 =>
            {
                tensor_values(&bytes, h.dtype, &mut self.activations);
                self.net.buffers().give(bytes);
                if let Some((stage, decoder)) = &mut self.tail {
                    let logits = decoder.step(stage, &self.activations, 1)?.to_vec();
                    self.activations = logits;
                }
                if self.activations.len() != self.job.vocab {
                    return Err(Error::protocol(
                        "generate",
                        &*self.net,
                        last,
                        "logits of another vocabulary",
                    ));
                }
                Ok(self.activations.clone())
            }
            _ => Err(Error::protocol(
                "generate",
                &*self.net,
                last,
                "message instead of the logits",
            )),
        }
    }

    fn reset(&mut self) -> Result<()> {
        self.decoder.reset();
        if let Some((_, decoder)) = &mut self.tail {
            decoder.reset();
        }
        if self.world > 1 {
            self.net.send(1, GenerateMessage::Reset.to_message())?;
        }
        Ok(())
    }

    fn position(&self) -> usize {
        self.decoder.position()
    }

    fn capacity(&self) -> usize {
        self.decoder.capacity().min(self.job.context)
    }
}

/// A node after rank 0: decodes what its predecessor sends and passes it on (the last node, the
/// last row's logits back to rank 0), until `Stop`.
fn serve(
    job: &GenerateJob,
    rank: u32,
    world: u32,
    stage: &InferenceStage,
    mut decoder: Decoder,
    net: &mut dyn Transport,
) -> Result<()> {
    let (pred, succ) = (rank - 1, (rank + 1) % world);
    let last = rank == world - 1;
    let mut x = Vec::new();
    loop {
        let message = net.recv_from(pred, job.timeout())?;
        let own = match &message {
            Message::Control(control) => GenerateMessage::from_control(control, net, pred)?,
            Message::Tensor(..) => None,
        };
        match (own, message) {
            (Some(GenerateMessage::Reset), _) => {
                decoder.reset();
                if !last {
                    net.send(succ, GenerateMessage::Reset.to_message())?;
                }
            }
            (Some(GenerateMessage::Stop), _) => {
                if !last {
                    net.send(succ, GenerateMessage::Stop.to_message())?;
                }
                return Ok(());
            }
            (None, Message::Tensor(h, bytes)) if h.tag == TensorTag::Inference => {
                tensor_values(&bytes, h.dtype, &mut x);
                net.buffers().give(bytes);
                let rows = h.micro_batch as usize;
                if rows == 0 || x.len() % rows != 0 {
                    return Err(Error::protocol(
                        "generate",
                        net,
                        pred,
                        "activations that are not whole rows",
                    ));
                }
                let out = decoder.step(stage, &x, rows)?;
                let message = if last {
                    // The last node's decoder gives the last position's logits alone.
                    tensor(net, TensorTag::Inference, h.step, 1, out)
                } else {
                    tensor(net, TensorTag::Inference, h.step, rows, out)
                };
                net.send(succ, message)?;
            }
            _ => return Err(Error::protocol("generate", net, pred, "message")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_balances_parameters_and_refuses_more_nodes_than_layers() {
        let spec = ringtmp_model::ModelSpec::preset("gpt-nano", 20).unwrap();
        let layers = spec
            .build_for(&Shape::flat(8), &Shape(vec![8, 20]))
            .unwrap();
        // Embedding, 2 blocks, norm, head.
        assert_eq!(layers.len(), 5);
        let two = partition(&layers, 2).unwrap();
        assert_eq!(two.first().unwrap().0, 0);
        assert_eq!(two.last().unwrap().1, 5);
        let share = |r: &(usize, usize)| -> usize {
            layers[r.0..r.1].iter().map(|l| l.param_count()).sum()
        };
        let largest = two.iter().map(share).max().unwrap();
        // No contiguous split into two does better.
        for cut in 1..5 {
            let a = share(&(0, cut));
            let b = share(&(cut, 5));
            assert!(largest <= a.max(b), "cut {cut}: {a}, {b} beat {largest}");
        }
        assert_eq!(partition(&layers, 5).unwrap().len(), 5);
        let e = partition(&layers, 6).unwrap_err().to_string();
        assert!(e.contains("5 layers"), "{e}");
    }
}
