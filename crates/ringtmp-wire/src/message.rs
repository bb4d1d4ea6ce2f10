//! The messages nodes exchange. Control messages are small typed values (postcard); tensors are a
//! typed header plus raw little-endian bytes.
//!
//! Invariant kept by construction: no variant can carry a label or a raw input example. Tensors are
//! tagged with what they are ([`TensorTag`]); strategies decide which tags a node may send, and
//! the ring's master never builds a tensor from data-set rows.

use serde::{Deserialize, Serialize};

/// Element type of a tensor payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE binary32.
    F32,
    /// Signed 8-bit integers with one scale per tensor (its largest magnitude ÷ 127, an f32
    /// before the values): a quarter of f32's bytes, for values that tolerate it (DiLoCo's
    /// pseudo-gradients).
    I8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Self::I8 => 1,
            Self::F16 | Self::Bf16 => 2,
            Self::F32 => 4,
        }
    }

    /// Bytes before the elements (the scale of [`Dtype::I8`]).
    pub fn overhead(self) -> u64 {
        match self {
            Self::I8 => 4,
            Self::F16 | Self::Bf16 | Self::F32 => 0,
        }
    }

    /// Bytes of a payload of `elements` values (`None` on overflow).
    pub fn payload_len(self, elements: u64) -> Option<u64> {
        elements
            .checked_mul(self.size())
            .and_then(|n| n.checked_add(if elements == 0 { 0 } else { self.overhead() }))
    }

    /// Values a payload of `bytes` holds (whole elements only).
    pub fn elements_in(self, bytes: usize) -> usize {
        let overhead = self.overhead() as usize;
        if bytes <= overhead {
            return 0;
        }
        (bytes - overhead) / self.size() as usize
    }
}

/// The scale [`Dtype::I8`] stores `values` with: their largest magnitude ÷ 127 (0 when all
/// are 0 or the largest is not finite, which sends zeros rather than NaN).
fn int8_scale(values: &[f32]) -> f32 {
    let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if max.is_finite() && max > 0.0 {
        max / 127.0
    } else {
        0.0
    }
}

/// What a tensor is, so receivers can route it and tests can audit what a node sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TensorTag {
    /// Activations flowing forward between pipeline stages.
    Activation,
    /// Gradients flowing backward between pipeline stages.
    Gradient,
    /// Activations of an evaluation pass (no backward follows; nothing is stashed).
    Inference,
    /// Model parameters (a replica or a shard).
    Params,
    /// Parameter gradients (data-parallel strategies).
    ParamGrads,
    /// Diagnostics and self-tests.
    Probe,
}

/// The header of a tensor frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorHeader {
    /// Run the tensor belongs to (a stray frame from another run is refused).
    pub run_id: u64,
    /// Optimizer step.
    pub step: u64,
    /// Micro-batch id within the step (0 when not applicable).
    pub micro_batch: u64,
    /// What the tensor is.
    pub tag: TensorTag,
    /// Element type of the payload.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<u32>,
}

impl TensorHeader {
    /// Number of elements the shape describes (`None` on overflow).
    pub fn elements(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d)))
    }
}

/// A node's identity and listening address, as exchanged at rendezvous.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddr {
    /// Rank of the node.
    pub rank: u32,
    /// `host:port` it listens on for peers.
    pub addr: String,
}

/// Control messages: what the runtime, the rendezvous and several strategies share; a
/// strategy's own messages travel as [`Control::Strategy`]. Their postcard encoding depends on
/// the variants' order, which is part of the protocol version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// A node is giving up; every receiver stops too and reports the reason.
    Abort {
        /// Rank that aborted first.
        origin: u32,
        /// Why.
        reason: String,
    },
    /// A checkpoint in progress: travels once around the ring after step `step`; each node writes
    /// its stage file and appends its file entry (JSON), and rank 0 writes the manifest last.
    Checkpoint {
        /// Optimizer steps completed.
        step: u64,
        /// One JSON file entry per node so far, in ring order.
        files: Vec<String>,
    },
    /// Orderly end of a run.
    Goodbye,
    /// Liveness: sent periodically on every link.
    Heartbeat {
        /// Sequence number (per link).
        seq: u64,
    },
    /// First message of the handshake, from each side.
    Hello {
        /// Run id the sender belongs to.
        run_id: u64,
        /// Sender's rank.
        rank: u32,
        /// Random challenge for the other side to prove knowledge of the secret over.
        nonce: [u8; 32],
        /// Whether the sender encrypts the link after the greeting (both sides must agree).
        encrypted: bool,
        /// Whether the sender would seal the link's records with AES-256-GCM (it has AES
        /// instructions): a private link uses AES-256-GCM when both ends would, else
        /// ChaCha20-Poly1305.
        aes: bool,
    },
    /// Round-trip probe.
    Ping {
        /// Sequence number.
        seq: u64,
    },
    /// Answer to a selftest ping (echoes its sequence number).
    Pong {
        /// The ping's sequence number.
        seq: u64,
    },
    /// Second message of the handshake: HMAC over both nonces (see [`crate::auth`]).
    Proof {
        /// The MAC.
        mac: [u8; 32],
    },
    /// Rendezvous: a node tells rank 0 where it listens.
    Register {
        /// The node.
        node: NodeAddr,
        /// The `--world-size` the node was started with (rank 0 refuses one that differs).
        world_size: u32,
    },
    /// All-reduce: rank 0 re-forms the ring after a worker died. Every worker in `members`
    /// drops its step in progress, takes rank 0's parameters and optimizer state (the `Params`
    /// tensor that follows on the same link) and goes on from `step` on the new ring.
    Regroup {
        /// Counts re-formations; chunks of an older generation are stale.
        generation: u64,
        /// The ranks that go on, in ring order.
        members: Vec<u32>,
        /// The step every member runs next (rank 0's steps completed).
        step: u64,
        /// The optimizer's step count (Adam's bias correction).
        optimizer_steps: u64,
    },
    /// End of a run: travels once around the ring, each node appending its measurements (JSON).
    Report {
        /// One JSON document per node, in ring order.
        nodes: Vec<String>,
    },
    /// Rendezvous: rank 0's address table and the run settings every node must share.
    Table {
        /// Run id rank 0 chose for this run; every link's handshake and tensor carries it.
        run_id: u64,
        /// Every node, indexed by rank.
        nodes: Vec<NodeAddr>,
        /// Settings as a TOML document (the same keys as `ringtmp train`), so nodes cannot
        /// disagree.
        settings: String,
    },
    /// Rendezvous: rank 0 asks every registered node to time the model's layers on its own
    /// hardware before it plans (JSON: the model and the micro-batch to time).
    ProfileRequest {
        /// What to profile (JSON).
        request: String,
    },
    /// Rendezvous: a node's answer to a `ProfileRequest` (JSON: its layer times and free
    /// memory, or why it could not profile).
    Profile {
        /// The answering rank.
        rank: u32,
        /// The report (JSON).
        report: String,
    },
    /// A strategy's own message: the strategy encodes and decodes it (its own enum, in its own
    /// folder), so adding a strategy adds nothing here. `strategy` names whose it is, so that a
    /// node refuses another strategy's message by name; the payload is bounded by the frame.
    Strategy {
        /// The strategy's `--strategy` name.
        strategy: String,
        /// The message's kind (its variant's name), for descriptions and fault triggers.
        kind: String,
        /// Its encoding of the message.
        payload: Vec<u8>,
    },
    /// Rendezvous: rank 0 will not take this node into the run (its rank is taken, or it was
    /// started with another world size); the run goes on without it.
    Refused {
        /// Why, for the refused node to print.
        reason: String,
    },
    /// Rendezvous: a node has the address table (rank 0 starts the run once every node has).
    TableReceived {
        /// The node.
        rank: u32,
    },
    /// Rendezvous: every node has the table; links may be made.
    Start,
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// A control message.
    Control(Control),
    /// A tensor: its header and its raw little-endian payload.
    Tensor(TensorHeader, Vec<u8>),
}

impl Message {
    /// A short description for error messages: a tensor's tag, step, micro-batch and shape (not
    /// its payload), a control message's variant and fields, cut to a line.
    pub fn describe(&self) -> String {
        match self {
            Self::Tensor(h, _) => {
                let shape: Vec<String> = h.shape.iter().map(u32::to_string).collect();
                format!(
                    "{:?} tensor (step {}, micro-batch {}, shape [{}])",
                    h.tag,
                    h.step,
                    h.micro_batch,
                    shape.join(", ")
                )
            }
            Self::Control(Control::Strategy {
                strategy,
                kind,
                payload,
            }) => format!("{kind} ({strategy}'s message, {} bytes)", payload.len()),
            Self::Control(c) => {
                let mut text = format!("{c:?}");
                if text.len() > 120 {
                    let cut = (0..=117)
                        .rev()
                        .find(|&i| text.is_char_boundary(i))
                        .unwrap_or(0);
                    text.truncate(cut);
                    text.push_str("...");
                }
                text
            }
        }
    }
}

/// Appends the little-endian bytes of `values` as `dtype` to `out` (e.g. a recycled buffer),
/// converting from f32; f16 and bf16 round to nearest even.
///
/// In phantom mode (the simulator's sizes-only runs) a large tensor appends nothing
/// ([`ringtmp_meter::elides`]): it travels as its header, and the simulated network charges the
/// size the header declares.
pub fn tensor_bytes_into(values: &[f32], dtype: Dtype, out: &mut Vec<u8>) {
    if ringtmp_meter::elides(values.len()) {
        return;
    }
    out.reserve(values.len() * dtype.size() as usize + dtype.overhead() as usize);
    match dtype {
        Dtype::I8 => {
            if values.is_empty() {
                return;
            }
            let scale = int8_scale(values);
            out.extend_from_slice(&scale.to_le_bytes());
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            out.extend(
                values
                    .iter()
                    .map(|v| ((v * inverse).round().clamp(-127.0, 127.0) as i8) as u8),
            );
        }
        // One memcpy where the machine is little-endian (the wire order); a byte-wise collect
        // of a 12 MB shard cost a parameter-server worker more than its kernel copies.
        #[cfg(target_endian = "little")]
        Dtype::F32 => out.extend_from_slice(bytemuck::cast_slice(values)),
        #[cfg(not(target_endian = "little"))]
        Dtype::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        Dtype::F16 => out.extend(
            values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes()),
        ),
        Dtype::Bf16 => out.extend(
            values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
        ),
    }
}

/// Little-endian bytes of `values` as `dtype` (as [`tensor_bytes_into`], in a new buffer).
pub fn tensor_bytes(values: &[f32], dtype: Dtype) -> Vec<u8> {
    let mut out = Vec::new();
    tensor_bytes_into(values, dtype, &mut out);
    out
}

/// Values of a payload as f32 (the payload length was checked against the shape when decoded).
pub fn tensor_values(bytes: &[u8], dtype: Dtype, out: &mut Vec<f32>) {
    // Whole elements only (a trailing partial element, impossible after decoding, is ignored).
    let count = dtype.elements_in(bytes.len());
    out.clear();
    out.resize(count, 0.0);
    let used = if count == 0 {
        0
    } else {
        count * dtype.size() as usize + dtype.overhead() as usize
    };
    tensor_values_into(&bytes[..used], dtype, out);
}

/// The values of a payload as f32: borrowed without a copy where the payload is little-endian
/// f32 in a 4-byte-aligned buffer (what the transport's reads produce on little-endian
/// machines), decoded into `scratch` otherwise.
pub fn tensor_view<'a>(bytes: &'a [u8], dtype: Dtype, scratch: &'a mut Vec<f32>) -> &'a [f32] {
    #[cfg(target_endian = "little")]
    if dtype == Dtype::F32
        && let Ok(values) = bytemuck::try_cast_slice(bytes)
    {
        return values;
    }
    tensor_values(bytes, dtype, scratch);
    scratch
}

/// A little-endian f32 payload as its values, in place, where the machine is little-endian
/// and the buffer 4-byte aligned (what the transport's reads produce); `None` otherwise, for
/// the caller to decode. For a receiver that combines into a payload and sends it on.
pub fn f32_payload_mut(bytes: &mut [u8]) -> Option<&mut [f32]> {
    #[cfg(target_endian = "little")]
    {
        bytemuck::try_cast_slice_mut(bytes).ok()
    }
    #[cfg(not(target_endian = "little"))]
    {
        let _ = bytes;
        None
    }
}

/// Writes the values of a payload into `out`, which holds exactly as many elements as the
/// payload (checked by the caller against what it expects), without an intermediate buffer.
///
/// # Panics
/// If `out` does not hold the payload's elements ([`Dtype::elements_in`]): a caller bug, not
/// peer input.
/// In phantom mode an empty payload (one that never carried values) leaves `out` as it is.
pub fn tensor_values_into(bytes: &[u8], dtype: Dtype, out: &mut [f32]) {
    if bytes.is_empty() && ringtmp_meter::phantom() {
        return;
    }
    assert_eq!(
        dtype.payload_len(out.len() as u64),
        Some(bytes.len() as u64),
        "tensor_values_into: destination does not match the payload"
    );
    match dtype {
        Dtype::I8 => {
            if let Some((scale, values)) = bytes.split_first_chunk::<4>() {
                let scale = f32::from_le_bytes(*scale);
                out.iter_mut()
                    .zip(values)
                    .for_each(|(o, q)| *o = f32::from(*q as i8) * scale);
            }
        }
        #[cfg(target_endian = "little")]
        Dtype::F32 => bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(bytes),
        #[cfg(not(target_endian = "little"))]
        Dtype::F32 => out
            .iter_mut()
            .zip(bytes.chunks_exact(4))
            .for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F16 => out
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::Bf16 => out
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(o, b)| *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}
