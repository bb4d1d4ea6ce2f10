//! NumPy's `.npy` and `.npz` files (NEP 1): a bounded header reader, memory-mapping of an
//! `.npy` file's data, and an `.npz` archive's members (stored or deflated) read into memory.
//!
//! The reader is our own rather than a crate's because the loader needs what a generic reader
//! hides: the byte offset of the data (to map the file and read only the rows a batch touches)
//! and errors that name the file and the byte where the header went wrong. Only C-order arrays
//! of little-endian (or byte) numbers are read; anything else is refused with the `numpy` call
//! that converts it.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The largest header read (NumPy writes a few hundred bytes; it refuses more than 10 KB itself).
const MAX_HEADER: usize = 1 << 20;

/// The element types ringtmp reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `u1`.
    U8,
    /// `f2`.
    F16,
    /// `f4`.
    F32,
    /// `f8` (converted to `f32` when read).
    F64,
    /// Signed or unsigned integers of `bytes` bytes (labels).
    Int {
        /// Bytes per value.
        bytes: usize,
        /// Whether negative values exist in the type.
        signed: bool,
    },
}

impl Kind {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Kind::U8 => 1,
            Kind::F16 => 2,
            Kind::F32 => 4,
            Kind::F64 => 8,
            Kind::Int { bytes, .. } => bytes,
        }
    }

    /// Whether the values are floating point.
    pub fn is_float(self) -> bool {
        matches!(self, Kind::F16 | Kind::F32 | Kind::F64)
    }
}

/// An array's header: what its data is and where it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The `descr` as written (`<f4`, `|u1`, …).
    pub descr: String,
    /// Element type.
    pub kind: Kind,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Byte offset of the first value.
    pub data_offset: usize,
}

impl Header {
    /// Number of values.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of data the header promises.
    pub fn data_bytes(&self) -> usize {
        self.numel() * self.kind.size()
    }
}

/// Parses the header at the start of `bytes` (an `.npy` file or `.npz` member named `path`) and
/// checks that the data it promises is all there.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let (header, needed) = parse_header_only(path, bytes)?;
    match needed {
        Some(n) if n <= bytes.len() => Ok(header),
        _ => Err(Error::Format {
            path: path.to_path_buf(),
            offset: header.data_offset as u64,
            reason: format!(
                "shape {:?} of {} needs more bytes than the file's {} after its header",
                header.shape,
                header.descr,
                bytes.len().saturating_sub(header.data_offset)
            ),
        }),
    }
}

/// The bytes an array of `header` takes, header included (`None`: more than an address
/// space holds).
fn declared_len(header: &Header) -> Option<usize> {
    header
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(header.kind.size()))
        .and_then(|n| n.checked_add(header.data_offset))
}

/// Parses the header at the start of `bytes` alone (the data need not follow yet); returns it
/// and the bytes header and data take together.
fn parse_header_only(path: &Path, bytes: &[u8]) -> Result<(Header, Option<usize>)> {
    let bad = |offset: usize, reason: String| Error::Format {
        path: path.to_path_buf(),
        offset: offset as u64,
        reason,
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad(0, "not a .npy array (no \\x93NUMPY magic)".into()));
    }
    let major = bytes[6];
    let (len, start) = match major {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(bad(8, "truncated header length".into()));
            }
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            (n as usize, 12)
        }
        v => return Err(bad(6, format!("format version {v} (ringtmp reads 1 to 3)"))),
    };
    if len > MAX_HEADER || start + len > bytes.len() {
        return Err(bad(
            start,
            format!("header of {len} bytes does not fit the file"),
        ));
    }
    let text = std::str::from_utf8(&bytes[start..start + len])
        .map_err(|_| bad(start, "header is not text".into()))?;
    let field = |key: &str| -> Result<&str> {
        let at = text
            .find(&format!("'{key}'"))
            .ok_or_else(|| bad(start, format!("header has no {key:?}: {text:?}")))?;
        let rest = text[at + key.len() + 2..].trim_start();
        rest.strip_prefix(':')
            .map(str::trim_start)
            .ok_or_else(|| bad(start + at, format!("no ':' after {key:?}")))
    };
    let descr_field = field("descr")?;
    let descr = descr_field
        .strip_prefix('\'')
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| {
            bad(
                start,
                "descr is not a simple type (a structured array?)".into(),
            )
        })?
        .to_string();
    if field("fortran_order")?.starts_with("True") {
        return Err(bad(
            start,
            "Fortran-order array: save it with np.ascontiguousarray(a)".into(),
        ));
    }
    let shape_text = field("shape")?;
    let inner = shape_text
        .strip_prefix('(')
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| bad(start, format!("shape is not a tuple: {shape_text:?}")))?;
    let mut shape = Vec::new();
    for part in inner.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let d: usize = part
            .trim_end_matches('L')
            .parse()
            .map_err(|_| bad(start, format!("shape entry {part:?} is not a size")))?;
        shape.push(d);
    }
    let kind = kind_of(&descr).ok_or_else(|| {
        bad(
            start,
            format!(
                "dtype {descr:?}: ringtmp reads little-endian uint8, float16, float32, float64 \
                 and integer labels (convert with a.astype('<f4'))"
            ),
        )
    })?;
    let header = Header {
        descr,
        kind,
        shape,
        data_offset: start + len,
    };
    let needed = declared_len(&header);
    Ok((header, needed))
}

fn kind_of(descr: &str) -> Option<Kind> {
    let (order, ty) = descr.split_at(1);
    let little = matches!(order, "<" | "|" | "=") && cfg!(target_endian = "little");
    let one_byte = matches!(ty, "u1" | "i1" | "b1");
    if !(little || (one_byte && order == ">")) {
        return None;
    }
    Some(match ty {
        "u1" | "b1" => Kind::U8,
        "f2" => Kind::F16,
        "f4" => Kind::F32,
        "f8" => Kind::F64,
        "i1" | "i2" | "i4" | "i8" => Kind::Int {
            bytes: ty[1..].parse().ok()?,
            signed: true,
        },
        "u2" | "u4" | "u8" => Kind::Int {
            bytes: ty[1..].parse().ok()?,
            signed: false,
        },
        _ => return None,
    })
}

/// An `.npy` file memory-mapped, with its header.
pub fn map(path: &Path) -> Result<(Header, memmap2::Mmap)> {
    let file = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    // SAFETY: the map is read-only and private to this process; a file truncated by another
    // process while mapped would fault, which every memory-mapped reader (NumPy's `mmap_mode`
    // included) accepts.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let header = parse_header(path, &map)?;
    Ok((header, map))
}

/// An `.npz` archive's members by their headers alone: what each holds is known (and can be
/// checked against the others and the memory there is) before any is decompressed.
pub struct Npz {
    path: std::path::PathBuf,
    archive: zip::ZipArchive<std::fs::File>,
    /// Each member's name (without `.npy`), index in the archive, header and declared bytes.
    pub members: Vec<(String, usize, Header, usize)>,
}

impl Npz {
    /// Opens `path` and reads every member's header (a few hundred bytes of each, however
    /// large the member decompresses).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("not an .npz (zip) archive: {e}"),
        })?;
        let mut members = Vec::new();
        for i in 0..archive.len() {
            let mut entry = archive.by_index(i).map_err(|e| Error::Format {
                path: path.to_path_buf(),
                offset: 0,
                reason: format!("member {i}: {e}"),
            })?;
            let name = entry.name().trim_end_matches(".npy").to_string();
            let member = member_path(path, &name);
            let prefix = read_header_bytes(&mut entry, &member)?;
            let (header, declared) = parse_header_only(&member, &prefix)?;
            let declared = declared.ok_or_else(|| Error::Format {
                path: member.clone(),
                offset: 0,
                reason: format!("shape {:?} is larger than memory can address", header.shape),
            })?;
            members.push((name, i, header, declared));
        }
        Ok(Self {
            path: path.to_path_buf(),
            archive,
            members,
        })
    }

    /// The header of member `name`, if the archive has it.
    pub fn header(&self, name: &str) -> Option<&Header> {
        self.members
            .iter()
            .find(|(n, ..)| n == name)
            .map(|(_, _, h, _)| h)
    }

    /// Decompresses member `name` (its header's bytes and no more: a member that inflates
    /// past what its header declares is refused there).
    pub fn read(&mut self, name: &str) -> Result<Vec<u8>> {
        let Some(&(_, index, _, declared)) = self.members.iter().find(|(n, ..)| n == name) else {
            return Err(Error::Format {
                path: self.path.clone(),
                offset: 0,
                reason: format!("no member {name}"),
            });
        };
        let member = member_path(&self.path, name);
        let io = |e: std::io::Error| Error::Io {
            path: member.clone(),
            source: e,
        };
        let entry = self.archive.by_index(index).map_err(|e| Error::Format {
            path: member.clone(),
            offset: 0,
            reason: e.to_string(),
        })?;
        let mut bytes = Vec::with_capacity(declared);
        entry
            .take(declared as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        if bytes.len() > declared {
            return Err(Error::Format {
                path: member,
                offset: declared as u64,
                reason: format!(
                    "decompresses past the {declared} bytes its header declares: not an array \
                     numpy wrote"
                ),
            });
        }
        Ok(bytes)
    }
}

/// The header bytes at the start of a member: the magic, the version, the length and the
/// header it gives (at most [`MAX_HEADER`]).
fn read_header_bytes(entry: &mut impl Read, member: &Path) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| Error::Io {
        path: member.to_path_buf(),
        source: e,
    };
    let mut prefix = Vec::with_capacity(12);
    entry.take(12).read_to_end(&mut prefix).map_err(io)?;
    let len = match (prefix.get(6), prefix.len()) {
        (Some(1), 12) => usize::from(u16::from_le_bytes([prefix[8], prefix[9]])).saturating_sub(2),
        (Some(2 | 3), 12) => {
            u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize
        }
        // Too short or not an array: the parser says which.
        _ => return Ok(prefix),
    };
    entry
        .take(len.min(MAX_HEADER) as u64)
        .read_to_end(&mut prefix)
        .map_err(io)?;
    Ok(prefix)
}

/// The members of an `.npz` archive, each `(name without .npy, bytes)`, in archive order.
pub fn read_npz(path: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut npz = Npz::open(path)?;
    let names: Vec<String> = npz.members.iter().map(|(n, ..)| n.clone()).collect();
    names
        .into_iter()
        .map(|name| {
            let bytes = npz.read(&name)?;
            Ok((name, bytes))
        })
        .collect()
}

/// The path that names member `name` of archive `path` in errors (`data.npz:x_train`).
pub fn member_path(path: &Path, name: &str) -> PathBuf {
    PathBuf::from(format!("{}:{name}", path.display()))
}

/// Every value of an integer or float array as `f64` (labels and targets; small).
pub fn values_f64(header: &Header, bytes: &[u8]) -> Vec<f64> {
    let data = &bytes[header.data_offset..header.data_offset + header.data_bytes()];
    let size = header.kind.size();
    data.chunks_exact(size)
        .map(|b| match header.kind {
            Kind::U8 => f64::from(b[0]),
            Kind::F16 => f64::from(half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            Kind::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Kind::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")),
            Kind::Int { signed, .. } => {
                let mut wide = [0u8; 8];
                wide[..size].copy_from_slice(b);
                if signed && b[size - 1] & 0x80 != 0 {
                    wide[size..].fill(0xff);
                }
                if signed {
                    i64::from_le_bytes(wide) as f64
                } else {
                    u64::from_le_bytes(wide) as f64
                }
            }
        })
        .collect()
}

/// Writes `values` as a C-order `.npy` array of `shape` (`<f4`): what `predict` writes and the
/// tests' fixtures use.
pub fn write_f32(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    write(
        path,
        "<f4",
        shape,
        &values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    )
}

/// Writes raw little-endian `data` as an `.npy` array of `descr` and `shape` (format 1.0, the
/// header padded to 64 bytes as NumPy pads it).
pub fn write(path: &Path, descr: &str, shape: &[usize], data: &[u8]) -> Result<()> {
    std::fs::write(path, encode(descr, shape, data)).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The bytes of an `.npy` array (see [`write()`]).
pub fn encode(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_array_reads_back_with_its_shape_and_offset() {
        let bytes = encode("<f4", &[2, 3], &[0u8; 24]);
        let h = parse_header(Path::new("a.npy"), &bytes).unwrap();
        assert_eq!((h.kind, h.shape.clone()), (Kind::F32, vec![2, 3]));
        assert_eq!(h.data_offset % 64, 0);
        let one = encode("|u1", &[5], &[1, 2, 3, 4, 5]);
        let h = parse_header(Path::new("b.npy"), &one).unwrap();
        assert_eq!(h.shape, vec![5]);
        assert_eq!(values_f64(&h, &one), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn negative_integers_widen_with_their_sign() {
        let data: Vec<u8> = [-3i16, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        let bytes = encode("<i2", &[2], &data);
        let h = parse_header(Path::new("l.npy"), &bytes).unwrap();
        assert_eq!(values_f64(&h, &bytes), vec![-3.0, 7.0]);
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let p = Path::new("x.npy");
        let err = |b: &[u8]| parse_header(p, b).unwrap_err().to_string();
        assert!(err(b"PK\x03\x04 not numpy").contains("magic"));
        assert!(err(&encode(">f4", &[1], &[0; 4])).contains("dtype \">f4\""));
        assert!(err(&encode("<c8", &[1], &[0; 8])).contains("astype"));
        // Fewer bytes than the shape promises.
        assert!(err(&encode("<f4", &[10], &[0; 8])).contains("needs more bytes"));
        let mut fortran = encode("<f4", &[1], &[0; 4]);
        let at = fortran.windows(5).position(|w| w == b"False").unwrap();
        fortran[at..at + 5].copy_from_slice(b"True ");
        assert!(err(&fortran).contains("Fortran"));
        // A header length past the end.
        let mut cut = encode("<f4", &[1], &[0; 4]);
        cut.truncate(20);
        assert!(err(&cut).contains("does not fit"));
    }
}
