//! Decoding errors. The transport adds the peer (rank and address) when it reports one.

/// Why bytes from a peer are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame does not start with `RTMP`.
    #[error("bad magic {got:02x?}: not a ringtmp frame")]
    BadMagic {
        /// The four bytes found.
        got: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {got} is not the supported version {supported}")]
    UnsupportedVersion {
        /// Version in the frame.
        got: u16,
        /// Version this build speaks.
        supported: u16,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Reserved flag bits are set.
    #[error("reserved flags 0x{0:02x} are set")]
    Flags(u8),
    /// The header is longer than allowed.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge {
        /// Declared header length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The payload is longer than allowed.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// Declared payload length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A control frame carries a payload.
    #[error("control frame carries a {0}-byte payload")]
    UnexpectedPayload(u64),
    /// The header bytes are not a valid encoding.
    #[error("malformed header: {0}")]
    Header(String),
    /// The header decoded but left bytes unused.
    #[error("header has {0} trailing bytes")]
    TrailingHeader(usize),
    /// A tensor with more dimensions than allowed.
    #[error("tensor has {dims} dimensions, limit {max}")]
    TooManyDims {
        /// Dimensions declared.
        dims: usize,
        /// The limit.
        max: usize,
    },
    /// A tensor with more elements than allowed (or an overflowing shape).
    #[error("tensor shape {shape:?} exceeds the limit of {max} elements")]
    TooManyElements {
        /// Declared shape.
        shape: Vec<u32>,
        /// The limit.
        max: u64,
    },
    /// The payload length does not match the tensor's shape and dtype.
    #[error("tensor payload is {got} bytes but shape and dtype need {expected}")]
    PayloadMismatch {
        /// Bytes the header implies.
        expected: u64,
        /// Bytes declared.
        got: u64,
    },
}
