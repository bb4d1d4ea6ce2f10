//! The vocabulary of a GGUF file as the reader gives it: metadata values, the tensor table's
//! entries, and what can be wrong with a file.

use std::path::PathBuf;

use super::quants::TensorType;

/// What went wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The bytes are not a GGUF file this reader understands.
    #[error("{}: at byte {offset}: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Where in it.
        offset: u64,
        /// What was wrong.
        what: String,
    },
    /// A tensor of a type the reader does not dequantise.
    #[error("{}: tensor {tensor:?} is of type {kind}, which ringtmp does not read", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its type, as GGUF names it.
        kind: String,
    },
    /// No tensor of that name.
    #[error("{}: no tensor {name:?}", path.display())]
    NoTensor {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        name: String,
    },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array` of values of one type.
    Array(Vec<Value>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as text, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its dimensions, innermost first (GGUF's order: `[columns, rows]` for a matrix).
    pub dims: Vec<u64>,
    /// Its element type.
    pub kind: TensorType,
    /// Where its data starts in the file.
    pub offset: u64,
    /// Its data's length in bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// Elements in all.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}
