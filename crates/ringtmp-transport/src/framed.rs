//! Reading and writing whole frames on a byte stream. Reading is bounded by [`Limits`] before any
//! allocation: the 20-byte prefix is read first and validated, then exactly the declared rest.

use ringtmp_wire::{
    Head, Limits, Message, PREFIX_LEN, decode_head, encode_tensor_prefix, head_len,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::pool::BufferPool;

/// Why reading a frame failed.
#[derive(Debug)]
pub enum ReadError {
    /// The stream ended cleanly before a new frame began.
    Closed,
    /// The stream failed or ended inside a frame.
    Io(std::io::Error),
    /// The bytes are not a valid frame.
    Decode(ringtmp_wire::DecodeError),
}

/// Reads one frame; returns the message and the number of bytes it occupied on the wire. The
/// prefix and header are read and validated first; a tensor payload is then read straight into
/// its own buffer (no intermediate frame buffer, no copy).
pub async fn read_frame<R: AsyncRead + Unpin>(
    stream: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
) -> Result<(Message, usize), ReadError> {
    read_frame_from(stream, buf, limits, None).await
}

/// [`read_frame`] for a link's reader: a large tensor payload goes into a buffer from `buffers`
/// where one fits.
pub async fn read_frame_pooled<R: AsyncRead + Unpin>(
    stream: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    buffers: &BufferPool,
) -> Result<(Message, usize), ReadError> {
    read_frame_from(stream, buf, limits, Some(buffers)).await
}

async fn read_frame_from<R: AsyncRead + Unpin>(
    stream: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    buffers: Option<&BufferPool>,
) -> Result<(Message, usize), ReadError> {
    buf.clear();
    buf.resize(PREFIX_LEN, 0);
    // Read the first byte separately: EOF here is a clean close, EOF later is a broken frame.
    match stream.read(&mut buf[..1]).await {
        Ok(0) => return Err(ReadError::Closed),
        Ok(_) => {}
        Err(e) => return Err(ReadError::Io(e)),
    }
    stream
        .read_exact(&mut buf[1..PREFIX_LEN])
        .await
        .map_err(ReadError::Io)?;
    let head = head_len(buf, limits)
        .map_err(ReadError::Decode)?
        .expect("prefix complete");
    buf.resize(head, 0);
    stream
        .read_exact(&mut buf[PREFIX_LEN..])
        .await
        .map_err(ReadError::Io)?;
    match decode_head(buf, limits)
        .map_err(ReadError::Decode)?
        .expect("head complete")
    {
        Head::Control(control) => Ok((Message::Control(control), head)),
        Head::Tensor(header, payload_len) => {
            // Read into uninitialised capacity (no memset of a buffer about to be overwritten),
            // of a recycled buffer where one fits.
            let mut payload = match buffers {
                Some(pool) => pool.take(payload_len),
                None => Vec::with_capacity(payload_len),
            };
            while payload.len() < payload_len {
                let left = (payload_len - payload.len()) as u64;
                let n = (&mut *stream)
                    .take(left)
                    .read_buf(&mut payload)
                    .await
                    .map_err(ReadError::Io)?;
                if n == 0 {
                    return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
            }
            Ok((Message::Tensor(header, payload), head + payload_len))
        }
    }
}

/// Writes one frame (tensor payloads straight from their buffer, without copying them into a
/// frame buffer); returns the bytes written.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    stream: &mut W,
    message: &Message,
    scratch: &mut Vec<u8>,
) -> std::io::Result<usize> {
    scratch.clear();
    match message {
        Message::Tensor(header, payload) => {
            encode_tensor_prefix(header, payload.len() as u64, scratch);
            stream.write_all(scratch).await?;
            stream.write_all(payload).await?;
            Ok(scratch.len() + payload.len())
        }
        Message::Control(_) => {
            ringtmp_wire::encode(message, scratch);
            stream.write_all(scratch).await?;
            Ok(scratch.len())
        }
    }
}

/// A stream a link's writer sends frames on.
pub trait FrameSink: AsyncWrite + Unpin + Send {
    /// Writes a tensor payload the caller is done with. A private link seals it where it lies
    /// (its bytes are ciphertext afterwards) instead of copying it; a plain stream writes it as
    /// it is.
    fn write_spent(
        &mut self,
        payload: &mut [u8],
    ) -> impl Future<Output = std::io::Result<()>> + Send;
}

impl FrameSink for tokio::net::tcp::OwnedWriteHalf {
    async fn write_spent(&mut self, payload: &mut [u8]) -> std::io::Result<()> {
        self.write_all(payload).await
    }
}

/// [`write_frame`] for a message the caller is done with: a tensor's payload goes out through
/// [`FrameSink::write_spent`] (sealed in place on a private link). Returns the bytes written.
pub async fn write_spent_frame<W: FrameSink>(
    stream: &mut W,
    message: &mut Message,
    scratch: &mut Vec<u8>,
) -> std::io::Result<usize> {
    match message {
        Message::Tensor(header, payload) => {
            scratch.clear();
            encode_tensor_prefix(header, payload.len() as u64, scratch);
            stream.write_all(scratch).await?;
            stream.write_spent(payload).await?;
            Ok(scratch.len() + payload.len())
        }
        Message::Control(_) => write_frame(stream, message, scratch).await,
    }
}
