//! `ringtmp-wire`: the bytes nodes exchange — typed messages, the frame codec and the
//! authentication proofs of the handshake. Sans-IO: no sockets, no async, no clocks; the transport
//! moves the bytes. Everything that decodes input from a peer is bounded before it allocates and
//! returns a typed error instead of panicking.
//!
//! # Frame layout
//! ```text
//! offset size  field
//!      0    4  magic "RTMP"
//!      4    2  protocol version (u16 LE)
//!      6    1  kind: 1 = control, 2 = tensor
//!      7    1  flags (must be 0)
//!      8    4  header length H (u32 LE)
//!     12    8  payload length P (u64 LE)
//!     20    H  header: postcard-encoded Control, or TensorHeader
//!   20+H    P  payload: raw little-endian tensor values (tensor frames only)
//! ```
//! Tensors never pass through a generic serializer: the header describes dtype and shape, and the
//! payload length must equal `elements × dtype size` exactly.
//!
//! # Layout
//! - [`frame`]: encoding and bounded decoding, [`Limits`].
//! - [`message`]: [`Message`], [`Control`], [`TensorHeader`], [`Dtype`].
//! - [`auth`]: HMAC-SHA256 challenge–response proofs.

pub mod auth;
mod error;
pub mod frame;
pub mod message;

pub use error::DecodeError;
pub use frame::{
    Head, Limits, MAGIC, PREFIX_LEN, PROTOCOL_VERSION, declared_len, decode, decode_head, encode,
    encode_tensor_prefix, encoded_len, frame_len, head_len,
};
pub use message::{Control, Dtype, Message, NodeAddr, TensorHeader, TensorTag};
