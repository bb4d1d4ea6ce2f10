//! Reader for the IDX format of MNIST and Fashion-MNIST, raw or gzip-compressed.
//!
//! Format: a 4-byte magic `00 00 <type> <ndims>`, then `ndims` big-endian u32 dimensions, then the
//! values in row-major order. Only unsigned bytes (type `0x08`) occur in these datasets and only
//! they are accepted. The reader checks the magic, bounds the dimensions *before* allocating, and
//! requires the file to end exactly where the dimensions say; every failure names the file and
//! the byte offset.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use flate2::read::GzDecoder;

use crate::error::{Error, Result};

/// Largest number of values accepted in one IDX file (1 GiB of u8), so a corrupt header cannot
/// make us allocate without bound.
pub const MAX_VALUES: usize = 1 << 30;

/// A decoded IDX array of unsigned bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first (e.g. `[60000, 28, 28]`).
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub data: Vec<u8>,
    /// The whole decompressed file (header and values) — what the canonical checksums cover.
    pub sha256: String,
}

/// Reads an IDX file, decompressing it first when it starts with the gzip magic.
pub fn read_idx(path: &Path) -> Result<IdxArray> {
    let file = File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut raw = BufReader::new(file);
    let mut head = [0u8; 2];
    let is_gzip = {
        let n = read_up_to(&mut raw, &mut head).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        n == 2 && head == [0x1f, 0x8b]
    };
    let file = File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let reader: Box<dyn Read> = if is_gzip {
        Box::new(GzDecoder::new(BufReader::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    decode(reader, path)
}

/// Decodes IDX content from any reader (already decompressed); `path` names it in errors.
pub fn decode(reader: impl Read, path: &Path) -> Result<IdxArray> {
    use sha2::{Digest, Sha256};
    let mut r = Counting {
        inner: reader,
        offset: 0,
        hasher: Sha256::new(),
    };
    let fail = |offset: u64, reason: String| Error::Format {
        path: path.to_path_buf(),
        offset,
        reason,
    };

    let mut magic = [0u8; 4];
    r.exact(&mut magic, path, "the 4-byte magic number")?;
    if magic[0] != 0 || magic[1] != 0 {
        return Err(fail(
            0,
            format!(
                "bad magic {:02x}{:02x}{:02x}{:02x}: not an IDX file",
                magic[0], magic[1], magic[2], magic[3]
            ),
        ));
    }
    if magic[2] != 0x08 {
        return Err(fail(
            2,
            format!("value type 0x{:02x} is not unsigned byte (0x08)", magic[2]),
        ));
    }
    let ndims = magic[3] as usize;
    if !(1..=4).contains(&ndims) {
        return Err(fail(3, format!("{ndims} dimensions; expected 1 to 4")));
    }
    let mut dims = Vec::with_capacity(ndims);
    let mut total: usize = 1;
    for i in 0..ndims {
        let at = r.offset;
        let mut d = [0u8; 4];
        r.exact(&mut d, path, "a dimension")?;
        let d = u32::from_be_bytes(d) as usize;
        total = total
            .checked_mul(d)
            .filter(|t| *t <= MAX_VALUES)
            .ok_or_else(|| {
                fail(
                    at,
                    format!("dimension {i} = {d} makes the array larger than {MAX_VALUES} values"),
                )
            })?;
        dims.push(d);
    }
    let header = r.offset;
    let mut data = vec![0u8; total];
    r.exact(
        &mut data,
        path,
        &format!("{total} values (dimensions {dims:?}) starting at byte {header}"),
    )?;
    let mut extra = [0u8; 1];
    let end = r.offset;
    let n = read_up_to(&mut r, &mut extra).map_err(|e| fail(end, format!("read error: {e}")))?;
    if n != 0 {
        return Err(fail(
            end,
            format!("trailing data after the {total} values the header declares"),
        ));
    }
    Ok(IdxArray {
        dims,
        data,
        sha256: hex::encode(r.hasher.finalize()),
    })
}

/// A reader that counts and hashes what passes through it, for offsets in errors and checksums.
struct Counting<R> {
    inner: R,
    offset: u64,
    hasher: sha2::Sha256,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest;
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.offset += n as u64;
        Ok(n)
    }
}

impl<R: Read> Counting<R> {
    fn exact(&mut self, buf: &mut [u8], path: &Path, what: &str) -> Result<()> {
        let start = self.offset;
        let n = read_up_to(self, buf).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            offset: self.offset,
            reason: format!("cannot read {what}: {e}"),
        })?;
        if n < buf.len() {
            return Err(Error::Format {
                path: path.to_path_buf(),
                offset: start + n as u64,
                reason: format!(
                    "file is truncated: it ends at byte {} while reading {what}",
                    start + n as u64
                ),
            });
        }
        Ok(())
    }
}

/// Reads until `buf` is full or the stream ends; returns how much was read.
fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx(dims: &[u32], values: &[u8]) -> Vec<u8> {
        let mut v = vec![0, 0, 8, dims.len() as u8];
        for d in dims {
            v.extend(d.to_be_bytes());
        }
        v.extend(values);
        v
    }

    fn err(bytes: &[u8]) -> String {
        decode(bytes, Path::new("f.idx")).unwrap_err().to_string()
    }

    #[test]
    fn decodes_a_small_array() {
        let a = decode(&idx(&[2, 3], &[1, 2, 3, 4, 5, 6])[..], Path::new("f")).unwrap();
        assert_eq!(a.dims, [2, 3]);
        assert_eq!(a.data, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn truncated_data_names_file_and_offset() {
        let e = err(&idx(&[2, 3], &[1, 2, 3, 4]));
        assert!(e.starts_with("f.idx: at byte 16: file is truncated"), "{e}");
        assert!(err(&[0, 0, 8]).contains("at byte 3: file is truncated"));
        assert!(err(&[0, 0, 8, 2, 0, 0]).contains("at byte 6: file is truncated"));
    }

    #[test]
    fn bad_magic_type_and_rank_are_refused() {
        assert!(err(&[1, 2, 8, 1, 0, 0, 0, 0]).contains("bad magic"));
        assert!(err(&[0, 0, 0x0d, 1, 0, 0, 0, 0]).contains("value type 0x0d"));
        assert!(err(&[0, 0, 8, 0]).contains("0 dimensions"));
        assert!(err(&[0, 0, 8, 9]).contains("9 dimensions"));
    }

    #[test]
    fn huge_dimensions_are_refused_before_allocating() {
        let e = err(&idx(&[u32::MAX, u32::MAX], &[]));
        assert!(
            e.contains("at byte 4: dimension 0") && e.contains("larger than"),
            "{e}"
        );
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let e = err(&idx(&[2], &[1, 2, 3]));
        assert!(e.contains("at byte 10: trailing data"), "{e}");
    }

    #[test]
    fn gzip_and_raw_files_read_the_same() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let bytes = idx(&[3], &[7, 8, 9]);
        std::fs::write(dir.path().join("raw"), &bytes).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&bytes).unwrap();
        std::fs::write(dir.path().join("gz"), gz.finish().unwrap()).unwrap();
        let a = read_idx(&dir.path().join("raw")).unwrap();
        let b = read_idx(&dir.path().join("gz")).unwrap();
        assert_eq!(a, b);
        // A gzip stream cut short is a clear error, not a panic.
        let full = std::fs::read(dir.path().join("gz")).unwrap();
        std::fs::write(dir.path().join("cut"), &full[..full.len() / 2]).unwrap();
        let e = read_idx(&dir.path().join("cut")).unwrap_err().to_string();
        assert!(e.contains("cut") && e.contains("at byte"), "{e}");
    }
}
