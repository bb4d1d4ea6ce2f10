//! Frame encoding and bounded decoding (layout in the crate docs).
//!
//! [`decode`] takes whatever bytes have arrived: it returns `Ok(None)` while the frame is
//! incomplete, and it rejects an oversized or malformed frame as soon as its 20-byte prefix (or its
//! header) shows the problem, before waiting for or allocating the rest.

use crate::error::DecodeError;
use crate::message::{Control, Message, TensorHeader};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"RTMP";
/// The protocol version this build speaks; peers must match exactly.
pub const PROTOCOL_VERSION: u16 = 9;
/// Bytes before the header.
pub const PREFIX_LEN: usize = 20;

const KIND_CONTROL: u8 = 1;
const KIND_TENSOR: u8 = 2;

/// Bounds applied to every frame from a peer, checked before allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest header (postcard bytes).
    pub max_header_bytes: u32,
    /// Largest tensor payload.
    pub max_payload_bytes: u64,
    /// Most tensor dimensions.
    pub max_dims: usize,
    /// Most tensor elements.
    pub max_elements: u64,
}

impl Default for Limits {
    /// 64 KiB headers, 256 MiB payloads (a 64 M-parameter f32 shard), 8 dimensions.
    fn default() -> Self {
        Self {
            max_header_bytes: 64 << 10,
            max_payload_bytes: 256 << 20,
            max_dims: 8,
            max_elements: 64 << 20,
        }
    }
}

impl Limits {
    /// What a connection may send before it has proved the run's secret: a greeting's control
    /// messages (a hello is about 50 bytes, a proof 33), never a tensor. A stranger's frame is
    /// refused from its 20-byte prefix, before anything is allocated for it.
    pub fn greeting() -> Self {
        Self {
            max_header_bytes: 256,
            max_payload_bytes: 0,
            max_dims: 0,
            max_elements: 0,
        }
    }
}

/// Bytes `message` occupies on the wire.
pub fn encoded_len(message: &Message) -> usize {
    match message {
        Message::Control(c) => PREFIX_LEN + postcard::to_allocvec(c).map(|v| v.len()).unwrap_or(0),
        Message::Tensor(h, payload) => {
            PREFIX_LEN + postcard::to_allocvec(h).map(|v| v.len()).unwrap_or(0) + payload.len()
        }
    }
}

/// [`encoded_len`] with a tensor's payload counted at the size its header declares (its
/// elements × the element size) rather than the bytes it holds: what a phantom tensor (the
/// simulator's sizes-only mode, which carries no values) would take on a real link. The two
/// agree for every tensor that decoded from a frame.
pub fn declared_len(message: &Message) -> usize {
    match message {
        Message::Control(_) => encoded_len(message),
        Message::Tensor(h, payload) => {
            let declared = h
                .elements()
                .and_then(|n| h.dtype.payload_len(n))
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(usize::MAX);
            (encoded_len(message) - payload.len()).saturating_add(declared)
        }
    }
}

/// Appends the encoding of `message` to `out`.
pub fn encode(message: &Message, out: &mut Vec<u8>) {
    match message {
        Message::Control(control) => encode_control(control, out),
        Message::Tensor(header, payload) => {
            encode_tensor_prefix(header, payload.len() as u64, out);
            out.extend_from_slice(payload);
        }
    }
}

fn encode_control(control: &Control, out: &mut Vec<u8>) {
    // Serialising our own plain enum into a Vec cannot fail.
    let header = postcard::to_allocvec(control).expect("control messages always serialise");
    push_prefix(out, KIND_CONTROL, header.len(), 0);
    out.extend_from_slice(&header);
}

/// Appends the prefix and header of a tensor frame whose `payload_len` payload bytes the caller
/// writes next (so large payloads go to the socket without being copied into a frame buffer).
pub fn encode_tensor_prefix(header: &TensorHeader, payload_len: u64, out: &mut Vec<u8>) {
    let bytes = postcard::to_allocvec(header).expect("tensor headers always serialise");
    push_prefix(out, KIND_TENSOR, bytes.len(), payload_len);
    out.extend_from_slice(&bytes);
}

fn push_prefix(out: &mut Vec<u8>, kind: u8, header_len: usize, payload_len: u64) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.push(kind);
    out.push(0);
    out.extend_from_slice(&(header_len as u32).to_le_bytes());
    out.extend_from_slice(&payload_len.to_le_bytes());
}

/// The validated prefix of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Prefix {
    kind: u8,
    header_len: u32,
    payload_len: u64,
}

fn parse_prefix(buf: &[u8], limits: &Limits) -> Result<Option<Prefix>, DecodeError> {
    if buf.len() < PREFIX_LEN {
        // Reject a wrong magic as early as the bytes allow, so a stranger is dropped at once.
        let n = buf.len().min(4);
        if buf[..n] != MAGIC[..n] {
            let mut got = [0u8; 4];
            got[..n].copy_from_slice(&buf[..n]);
            return Err(DecodeError::BadMagic { got });
        }
        return Ok(None);
    }
    let magic = [buf[0], buf[1], buf[2], buf[3]];
    if magic != MAGIC {
        return Err(DecodeError::BadMagic { got: magic });
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            got: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let kind = buf[6];
    if kind != KIND_CONTROL && kind != KIND_TENSOR {
        return Err(DecodeError::UnknownKind(kind));
    }
    if buf[7] != 0 {
        return Err(DecodeError::Flags(buf[7]));
    }
    let header_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
    if header_len > limits.max_header_bytes {
        return Err(DecodeError::HeaderTooLarge {
            len: header_len,
            max: limits.max_header_bytes,
        });
    }
    let payload_len = u64::from_le_bytes(buf[12..20].try_into().expect("8 bytes"));
    if kind == KIND_CONTROL && payload_len != 0 {
        return Err(DecodeError::UnexpectedPayload(payload_len));
    }
    if payload_len > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: payload_len,
            max: limits.max_payload_bytes,
        });
    }
    Ok(Some(Prefix {
        kind,
        header_len,
        payload_len,
    }))
}

/// Total length of the frame starting at `buf`, once its prefix has arrived (`Ok(None)` before).
/// Errors as [`decode`] does for a bad prefix.
pub fn frame_len(buf: &[u8], limits: &Limits) -> Result<Option<usize>, DecodeError> {
    Ok(parse_prefix(buf, limits)?
        .map(|p| PREFIX_LEN + p.header_len as usize + p.payload_len as usize))
}

/// A frame whose prefix and header are decoded and validated, payload not yet read.
#[derive(Clone, Debug, PartialEq)]
pub enum Head {
    /// A complete control message (it has no payload).
    Control(Control),
    /// A tensor header; exactly `payload_len` payload bytes follow.
    Tensor(TensorHeader, usize),
}

/// Decodes the prefix and header at the start of `buf` (which must hold at least
/// [`head_len`] bytes), validating everything a payload's size depends on, so a reader can then
/// read the payload straight into its final buffer.
pub fn decode_head(buf: &[u8], limits: &Limits) -> Result<Option<Head>, DecodeError> {
    let Some(prefix) = parse_prefix(buf, limits)? else {
        return Ok(None);
    };
    let header_end = PREFIX_LEN + prefix.header_len as usize;
    if buf.len() < header_end {
        return Ok(None);
    }
    let header = &buf[PREFIX_LEN..header_end];
    if prefix.kind == KIND_CONTROL {
        return Ok(Some(Head::Control(from_exact(header)?)));
    }
    let tensor: TensorHeader = from_exact(header)?;
    check_tensor(&tensor, prefix.payload_len, limits)?;
    Ok(Some(Head::Tensor(tensor, prefix.payload_len as usize)))
}

/// Bytes of prefix and header of the frame starting at `buf`, once its prefix has arrived.
pub fn head_len(buf: &[u8], limits: &Limits) -> Result<Option<usize>, DecodeError> {
    Ok(parse_prefix(buf, limits)?.map(|p| PREFIX_LEN + p.header_len as usize))
}

fn check_tensor(
    tensor: &TensorHeader,
    payload_len: u64,
    limits: &Limits,
) -> Result<(), DecodeError> {
    if tensor.shape.len() > limits.max_dims {
        return Err(DecodeError::TooManyDims {
            dims: tensor.shape.len(),
            max: limits.max_dims,
        });
    }
    let elements = tensor
        .elements()
        .filter(|e| *e <= limits.max_elements)
        .ok_or_else(|| DecodeError::TooManyElements {
            shape: tensor.shape.clone(),
            max: limits.max_elements,
        })?;
    let expected = tensor.dtype.payload_len(elements).unwrap_or(u64::MAX);
    if expected != payload_len {
        return Err(DecodeError::PayloadMismatch {
            expected,
            got: payload_len,
        });
    }
    Ok(())
}

/// Decodes one frame from the start of `buf`: `Ok(Some((message, bytes_used)))`, `Ok(None)` if
/// more bytes are needed, or the reason the bytes can never form a valid frame.
pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Message, usize)>, DecodeError> {
    let Some(prefix) = parse_prefix(buf, limits)? else {
        return Ok(None);
    };
    let header_end = PREFIX_LEN + prefix.header_len as usize;
    if buf.len() < header_end {
        return Ok(None);
    }
    let header = &buf[PREFIX_LEN..header_end];
    if prefix.kind == KIND_CONTROL {
        let control: Control = from_exact(header)?;
        return Ok(Some((Message::Control(control), header_end)));
    }
    let tensor: TensorHeader = from_exact(header)?;
    check_tensor(&tensor, prefix.payload_len, limits)?;
    let end = header_end + prefix.payload_len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    Ok(Some((
        Message::Tensor(tensor, buf[header_end..end].to_vec()),
        end,
    )))
}

/// Decodes a header that must use every byte.
fn from_exact<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, DecodeError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|e| DecodeError::Header(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingHeader(rest.len()));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::message::{Dtype, NodeAddr, TensorTag, tensor_bytes, tensor_values};

    fn samples() -> Vec<Message> {
        let header = |dtype, shape: Vec<u32>| TensorHeader {
            run_id: 7,
            step: 3,
            micro_batch: 2,
            tag: TensorTag::Activation,
            dtype,
            shape,
        };
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        vec![
            Message::Control(Control::Heartbeat { seq: 42 }),
            Message::Control(Control::Hello {
                run_id: u64::MAX,
                rank: 3,
                nonce: [9; 32],
                encrypted: true,
                aes: false,
            }),
            Message::Control(Control::Abort {
                origin: 2,
                reason: "out of memory".into(),
            }),
            Message::Control(Control::Table {
                run_id: 3,
                nodes: vec![NodeAddr {
                    rank: 0,
                    addr: "127.0.0.1:4000".into(),
                }],
                settings: "epochs = 2\n".into(),
            }),
            Message::Control(Control::Goodbye),
            Message::Control(Control::Strategy {
                strategy: "ps".into(),
                kind: "Grant".into(),
                payload: vec![1, 2, 17, 12],
            }),
            Message::Tensor(
                header(Dtype::F32, vec![3, 4]),
                tensor_bytes(&values, Dtype::F32),
            ),
            Message::Tensor(
                header(Dtype::F16, vec![12]),
                tensor_bytes(&values, Dtype::F16),
            ),
            Message::Tensor(
                header(Dtype::Bf16, vec![2, 2, 3]),
                tensor_bytes(&values, Dtype::Bf16),
            ),
            Message::Tensor(header(Dtype::F32, vec![0, 5]), vec![]),
            Message::Tensor(
                header(Dtype::I8, vec![6, 2]),
                tensor_bytes(&values, Dtype::I8),
            ),
        ]
    }

    #[test]
    fn round_trip_every_kind() {
        for m in samples() {
            let mut buf = Vec::new();
            encode(&m, &mut buf);
            assert_eq!(
                frame_len(&buf, &Limits::default()).unwrap(),
                Some(buf.len())
            );
            let (back, used) = decode(&buf, &Limits::default()).unwrap().unwrap();
            assert_eq!((back, used), (m, buf.len()));
        }
    }

    #[test]
    fn head_decoding_agrees_with_whole_frame_decoding() {
        for m in samples() {
            let mut buf = Vec::new();
            encode(&m, &mut buf);
            let head = head_len(&buf, &Limits::default()).unwrap().unwrap();
            let decoded = decode_head(&buf[..head], &Limits::default())
                .unwrap()
                .unwrap();
            match (decoded, m) {
                (Head::Control(c), Message::Control(want)) => assert_eq!(c, want),
                (Head::Tensor(h, len), Message::Tensor(want, payload)) => {
                    assert_eq!((h, len), (want, payload.len()));
                    assert_eq!(head + len, buf.len());
                }
                (got, want) => panic!("{got:?} vs {want:?}"),
            }
        }
    }

    #[test]
    fn half_precision_payloads_convert_back() {
        let values = [1.0f32, -2.5, 0.125, 65504.0];
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let mut back = Vec::new();
            tensor_values(&tensor_bytes(&values, dtype), dtype, &mut back);
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= a.abs() * 0.01, "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn int8_payloads_carry_their_scale_and_round_within_half_a_step() {
        let header = |dtype, shape: Vec<u32>| TensorHeader {
            run_id: 1,
            step: 2,
            micro_batch: 3,
            tag: TensorTag::ParamGrads,
            dtype,
            shape,
        };
        let values: Vec<f32> = (0..300)
            .map(|i| ((i * 37) % 101) as f32 * 0.013 - 0.6)
            .collect();
        let bytes = tensor_bytes(&values, Dtype::I8);
        assert_eq!(
            bytes.len(),
            4 + values.len(),
            "one byte a value and the scale"
        );
        let m = Message::Tensor(header(Dtype::I8, vec![values.len() as u32]), bytes);
        let mut buf = Vec::new();
        encode(&m, &mut buf);
        let (Message::Tensor(h, payload), used) =
            decode(&buf, &Limits::default()).unwrap().unwrap()
        else {
            panic!("a tensor")
        };
        assert_eq!(used, buf.len());
        let mut back = Vec::new();
        tensor_values(&payload, h.dtype, &mut back);
        let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= max / 254.0 * 1.001, "{a} vs {b}");
        }
        // All zeros, and a non-finite value, send zeros (not NaN).
        for bad in [vec![0.0f32; 5], vec![1.0, f32::NAN, 2.0]] {
            let mut back = Vec::new();
            tensor_values(&tensor_bytes(&bad, Dtype::I8), Dtype::I8, &mut back);
            assert!(back.iter().all(|v| v.is_finite()), "{back:?}");
        }
        // A payload without its scale's room is refused.
        let short = Message::Tensor(header(Dtype::I8, vec![4]), vec![0; 4]);
        let mut buf = Vec::new();
        encode(&short, &mut buf);
        assert!(matches!(
            decode(&buf, &Limits::default()),
            Err(DecodeError::PayloadMismatch { .. })
        ));
    }

    #[test]
    fn every_prefix_of_a_frame_is_incomplete_not_an_error() {
        for m in samples() {
            let mut buf = Vec::new();
            encode(&m, &mut buf);
            for cut in 0..buf.len() {
                assert_eq!(
                    decode(&buf[..cut], &Limits::default()),
                    Ok(None),
                    "cut at {cut} of {m:?}"
                );
            }
        }
    }

    #[test]
    fn oversized_and_inconsistent_frames_are_refused_from_the_prefix() {
        let limits = Limits::default();
        let mut big = Vec::new();
        push_prefix(&mut big, KIND_TENSOR, 10, 1 << 40);
        assert_eq!(
            decode(&big, &limits),
            Err(DecodeError::PayloadTooLarge {
                len: 1 << 40,
                max: limits.max_payload_bytes
            })
        );
        let mut big_header = Vec::new();
        push_prefix(&mut big_header, KIND_CONTROL, 1 << 20, 0);
        assert!(matches!(
            decode(&big_header, &limits),
            Err(DecodeError::HeaderTooLarge { .. })
        ));
        let mut payload_on_control = Vec::new();
        push_prefix(&mut payload_on_control, KIND_CONTROL, 1, 4);
        assert_eq!(
            decode(&payload_on_control, &limits),
            Err(DecodeError::UnexpectedPayload(4))
        );
        let mut wrong_version = Vec::new();
        encode(&Message::Control(Control::Goodbye), &mut wrong_version);
        wrong_version[4] = PROTOCOL_VERSION as u8 + 1;
        assert_eq!(
            decode(&wrong_version, &limits),
            Err(DecodeError::UnsupportedVersion {
                got: PROTOCOL_VERSION + 1,
                supported: PROTOCOL_VERSION
            })
        );
        assert!(matches!(
            decode(b"GET / HTTP/1.1\r\n", &limits),
            Err(DecodeError::BadMagic { .. })
        ));
        assert!(matches!(
            decode(b"GE", &limits),
            Err(DecodeError::BadMagic { .. })
        ));
    }

    #[test]
    fn tensor_shape_must_match_payload_and_limits() {
        let limits = Limits::default();
        let mut header = TensorHeader {
            run_id: 1,
            step: 0,
            micro_batch: 0,
            tag: TensorTag::Gradient,
            dtype: Dtype::F32,
            shape: vec![2, 3],
        };
        let mut buf = Vec::new();
        encode_tensor_prefix(&header, 20, &mut buf);
        buf.extend([0u8; 20]);
        assert_eq!(
            decode(&buf, &limits),
            Err(DecodeError::PayloadMismatch {
                expected: 24,
                got: 20
            })
        );
        header.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        buf.clear();
        encode_tensor_prefix(&header, 0, &mut buf);
        assert!(matches!(
            decode(&buf, &limits),
            Err(DecodeError::TooManyElements { .. })
        ));
        header.shape = vec![1; 9];
        buf.clear();
        encode_tensor_prefix(&header, 4, &mut buf);
        assert!(matches!(
            decode(&buf, &limits),
            Err(DecodeError::TooManyDims { dims: 9, max: 8 })
        ));
    }

    /// Property test: thousands of random byte strings and of valid frames with random mutations
    /// (bit flips, truncations, insertions, overwritten lengths) never panic the decoder, and
    /// whatever it accepts re-encodes to a frame that decodes to the same message.
    /// Seed from `RINGTMP_SEED` (default 1), printed so a failure replays.
    #[test]
    fn random_and_mutated_frames_never_panic() {
        let seed = std::env::var("RINGTMP_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1u64);
        println!("RINGTMP_SEED={seed}");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let limits = Limits {
            max_payload_bytes: 1 << 16,
            max_elements: 1 << 14,
            ..Limits::default()
        };
        let valid: Vec<Vec<u8>> = samples()
            .iter()
            .map(|m| {
                let mut b = Vec::new();
                encode(m, &mut b);
                b
            })
            .collect();
        let (mut accepted, mut refused, mut incomplete) = (0, 0, 0);
        for case in 0..20_000 {
            let mut buf = if case % 4 == 0 {
                let len = rng.random_range(0..64);
                (0..len).map(|_| rng.random::<u8>()).collect()
            } else {
                valid[rng.random_range(0..valid.len())].clone()
            };
            for _ in 0..rng.random_range(1..4) {
                if buf.is_empty() {
                    break;
                }
                let at = rng.random_range(0..buf.len());
                match rng.next_u32() % 5 {
                    0 => buf[at] ^= 1 << (rng.next_u32() % 8),
                    1 => buf.truncate(at),
                    2 => buf.insert(at, rng.random()),
                    3 => {
                        // Overwrite a length field with an extreme value.
                        let field = if rng.random() { 8..12 } else { 12..20 };
                        if buf.len() >= 20 {
                            for i in field {
                                buf[i] = 0xff;
                            }
                        }
                    }
                    _ => buf[at] = rng.random(),
                }
            }
            match decode(&buf, &limits) {
                Ok(Some((m, used))) => {
                    accepted += 1;
                    assert!(used <= buf.len());
                    let mut again = Vec::new();
                    encode(&m, &mut again);
                    assert_eq!(decode(&again, &limits).unwrap().unwrap().0, m);
                }
                Ok(None) => incomplete += 1,
                Err(_) => refused += 1,
            }
        }
        println!("accepted {accepted}, refused {refused}, incomplete {incomplete}");
        assert!(accepted > 100 && refused > 1000 && incomplete > 100);
    }
}
