//! A private link's byte streams: what is written is sealed into records, what is read is
//! opened from them, and nothing of a record is handed on before its tag is checked.
//!
//! On the wire a record is `[u32 LE ciphertext length][ciphertext ≤ 65,535 bytes, tag last]`, a
//! Noise transport message. Each direction numbers its records 0, 1, 2, … and the receiver opens
//! record k with nonce k, so a forged, replayed, dropped or reordered record fails
//! authentication; the reader then ends the link with an error (`InvalidData`).
//!
//! Both ends work in place and in batches, because on a loopback or LAN link the cipher competes
//! with training for the same cores: the writer seals records one after the other into one
//! buffer and hands the socket up to [`BATCH`] bytes a system call; the reader takes whatever
//! the socket has (up to [`BATCH`]) into one buffer, opens each complete record where it lies
//! and copies the plaintext once, to its caller. `benches/allreduce_vs_ddp.sh` and `ringtmp
//! bench-transport` measure what this is worth.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::cipher::{Session, TAG};

/// Largest record: a Noise message's limit.
pub const MAX_RECORD: usize = 65_535;
/// Most plaintext one record carries.
pub const MAX_PLAIN: usize = MAX_RECORD - TAG;
/// Bytes of a record's length prefix.
const HEADER: usize = 4;
/// Most bytes a reader or writer moves to or from the socket in one call: four whole records.
pub const BATCH: usize = 4 * (HEADER + MAX_RECORD);

fn forged() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "a record failed authentication (forged, replayed, reordered or corrupted in transit)",
    )
}

/// The receiving side of a private link: opens records from `inner` into a plain byte stream.
pub struct SecureReader<R> {
    inner: R,
    session: Session,
    next_nonce: u64,
    /// What came from the socket: opened plaintext not yet handed out (`plain`), then bytes of
    /// records not yet opened (`sealed`, starting at a record's header).
    buf: Box<[u8]>,
    plain: std::ops::Range<usize>,
    sealed: std::ops::Range<usize>,
}

impl<R> SecureReader<R> {
    /// Opens what `inner` carries with `session`.
    pub fn new(inner: R, session: Session) -> Self {
        Self {
            inner,
            session,
            next_nonce: 0,
            buf: vec![0u8; BATCH].into_boxed_slice(),
            plain: 0..0,
            sealed: 0..0,
        }
    }

    /// Opens the record at the start of `sealed` if it is all there: `Ok(true)` when one was.
    fn open_next(&mut self) -> std::io::Result<bool> {
        let at = self.sealed.start;
        if self.sealed.len() < HEADER {
            return Ok(false);
        }
        let header: [u8; HEADER] = self.buf[at..at + HEADER].try_into().expect("4 bytes");
        let len = u32::from_le_bytes(header) as usize;
        if !(TAG..=MAX_RECORD).contains(&len) {
            return Err(forged());
        }
        if self.sealed.len() < HEADER + len {
            return Ok(false);
        }
        let body = at + HEADER..at + HEADER + len - TAG;
        let tag: [u8; TAG] = self.buf[body.end..body.end + TAG]
            .try_into()
            .expect("16 bytes");
        self.session
            .receive
            .open(self.next_nonce, &mut self.buf[body.clone()], &tag)
            .map_err(|_| forged())?;
        self.next_nonce += 1;
        self.plain = body;
        self.sealed.start = at + HEADER + len;
        Ok(true)
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SecureReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.plain.is_empty() {
                let n = out.remaining().min(this.plain.len());
                out.put_slice(&this.buf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                return Poll::Ready(Ok(()));
            }
            if this.open_next()? {
                continue;
            }
            // The record at `sealed` is incomplete: make room behind it for the rest (a whole
            // record fits whenever it starts at the front), then read.
            if this.buf.len() - this.sealed.start < HEADER + MAX_RECORD {
                let moved = this.sealed.len();
                this.buf.copy_within(this.sealed.clone(), 0);
                this.sealed = 0..moved;
            }
            let mut free = ReadBuf::new(&mut this.buf[this.sealed.end..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut free))?;
            let n = free.filled().len();
            if n == 0 {
                return if this.sealed.is_empty() {
                    Poll::Ready(Ok(())) // end of stream between records
                } else {
                    Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()))
                };
            }
            this.sealed.end += n;
        }
    }
}

/// The sending side of a private link: what is written is sealed into records of up to 65,519
/// bytes of plaintext, gathered into batches of up to [`BATCH`] bytes for the socket. Bytes
/// reach the socket when a batch is full or on a flush, so the link's writer flushes after each
/// frame (and an emulated card after each piece it releases).
pub struct SecureWriter<W> {
    inner: W,
    session: Session,
    next_nonce: u64,
    /// Sealed records still to be written, and how much of them has been.
    pending: Vec<u8>,
    pending_pos: usize,
}

impl<W> SecureWriter<W> {
    /// Seals what is written with `session` and sends it to `inner`.
    pub fn new(inner: W, session: Session) -> Self {
        Self {
            inner,
            session,
            next_nonce: 0,
            pending: Vec::with_capacity(BATCH),
            pending_pos: 0,
        }
    }

    /// The stream it writes to.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }
}

impl<W: AsyncWrite + Unpin> SecureWriter<W> {
    /// Writes out the pending records.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.pending_pos < self.pending.len() {
            let n = ready!(
                Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.pending_pos..])
            )?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.pending_pos += n;
        }
        self.pending.clear();
        self.pending_pos = 0;
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for SecureWriter<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let n = buf.len().min(MAX_PLAIN);
        if BATCH - this.pending.len() < HEADER + n + TAG {
            ready!(this.poll_drain(cx))?;
        }
        let at = this.pending.len();
        this.pending
            .extend_from_slice(&((n + TAG) as u32).to_le_bytes());
        this.pending.extend_from_slice(&buf[..n]);
        let tag = this
            .session
            .send
            .seal(this.next_nonce, &mut this.pending[at + HEADER..]);
        this.pending.extend_from_slice(&tag);
        this.next_nonce += 1;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection that carries a few frames each way after its greeting (the rendezvous: a
/// registration, a profile request and its answer, the table): sealed with one session for its
/// whole life when it has one, so every record in a direction gets a number of its own, or plain.
pub struct FrameConnection {
    reader: Box<dyn AsyncRead + Send + Unpin>,
    writer: Box<dyn AsyncWrite + Send + Unpin>,
    scratch: Vec<u8>,
    buf: Vec<u8>,
}

impl FrameConnection {
    /// Frames over `stream`, sealed with `session` when there is one.
    pub fn new<S>(stream: S, session: Option<Session>) -> Self
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (read, write) = tokio::io::split(stream);
        let (reader, writer): (
            Box<dyn AsyncRead + Send + Unpin>,
            Box<dyn AsyncWrite + Send + Unpin>,
        ) = match session {
            Some(session) => (
                Box::new(SecureReader::new(read, session.clone())),
                Box::new(SecureWriter::new(write, session)),
            ),
            None => (Box::new(read), Box::new(write)),
        };
        Self {
            reader,
            writer,
            scratch: Vec::new(),
            buf: Vec::new(),
        }
    }

    /// Sends `message` (flushed); returns its bytes.
    pub async fn send(&mut self, message: &ringtmp_wire::Message) -> std::io::Result<usize> {
        let n = crate::framed::write_frame(&mut self.writer, message, &mut self.scratch).await?;
        self.writer.flush().await?;
        Ok(n)
    }

    /// The next frame, bounded by `limits`.
    pub async fn recv(
        &mut self,
        limits: &ringtmp_wire::Limits,
    ) -> Result<(ringtmp_wire::Message, usize), crate::framed::ReadError> {
        crate::framed::read_frame(&mut self.reader, &mut self.buf, limits).await
    }
}
