//! A private link's byte streams: what is written is sealed into records, what is read is
//! opened from them, and nothing of a record is handed on before its tag is checked.
//!
//! On the wire a record is `[u32 LE ciphertext length][ciphertext ≤ 65,535 bytes, tag last]`, a
//! Noise transport message. Each direction numbers its records 0, 1, 2, … and the receiver opens
//! record k with nonce k, so a forged, replayed, dropped or reordered record fails
//! authentication; the reader then ends the link with an error (`InvalidData`).
//!
//! Both ends work in place and in batches of up to [`BATCH`] bytes a system call, because on a
//! loopback or LAN link the cipher competes with training for the same cores:
//! - the writer seals a tensor payload its caller is done with where it lies and writes headers,
//!   records and tags in one vectored write a batch ([`SecureWriter::write_spent`]); other
//!   writes are copied into its batch and sealed there;
//! - the reader takes the socket's bytes straight into a caller's buffer that has room for a
//!   whole record (a frame reader filling a payload) and opens each record where it landed,
//!   closing the plaintext up over the headers and tags; smaller reads are served from its own
//!   buffer, filled a batch at a time, with one copy out.
//!
//! `benches/allreduce_vs_ddp.sh` and `ringtmp bench-transport` measure what this is worth.

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

/// How many more bytes complete the record that `bytes` begins (0: it is all there; while its
/// header is incomplete, the header's missing bytes). A length out of bounds is a forgery.
fn missing(bytes: &[u8]) -> std::io::Result<usize> {
    let Some(header) = bytes.first_chunk::<HEADER>() else {
        return Ok(HEADER - bytes.len());
    };
    let len = u32::from_le_bytes(*header) as usize;
    if !(TAG..=MAX_RECORD).contains(&len) {
        return Err(forged());
    }
    Ok((HEADER + len).saturating_sub(bytes.len()))
}

/// Opens the complete records of `region[at..]` in turn with `key` (from record number `nonce`
/// on), each one's plaintext written at `region[opened..]`: the plaintext closes up over the
/// headers and tags. Returns where the first incomplete record starts and where the plaintext
/// ends.
fn open_records(
    key: &super::cipher::RecordKey,
    nonce: &mut u64,
    region: &mut [u8],
    mut at: usize,
    mut opened: usize,
) -> std::io::Result<(usize, usize)> {
    while region.len() - at >= HEADER && missing(&region[at..])? == 0 {
        let header: [u8; HEADER] = region[at..at + HEADER].try_into().expect("4 bytes");
        let body = at + HEADER..at + HEADER + u32::from_le_bytes(header) as usize - TAG;
        key.open(
            *nonce,
            &mut region[opened..body.end + TAG],
            body.start - opened,
        )
        .map_err(|_| forged())?;
        *nonce += 1;
        opened += body.len();
        at = body.end + TAG;
    }
    Ok((at, opened))
}

/// A read with room for this many bytes takes the socket's bytes straight into the caller's
/// buffer: a whole record fits.
const DIRECT: usize = HEADER + MAX_RECORD;

/// The receiving side of a private link: opens records from `inner` into a plain byte stream.
///
/// A caller with room for a whole record (a frame reader filling a tensor's payload) gets the
/// socket's bytes straight into its buffer, opened where they land; a smaller read is served
/// from the reader's own buffer, which is filled a batch at a time and copied out.
pub struct SecureReader<R> {
    inner: R,
    session: Session,
    next_nonce: u64,
    /// What came from the socket: opened plaintext not yet handed out (`plain`), then bytes of
    /// records not yet opened (`sealed`, starting at a record's header).
    buf: Box<[u8]>,
    plain: std::ops::Range<usize>,
    sealed: std::ops::Range<usize>,
    /// Plaintext bytes opened straight in callers' buffers.
    opened_in_place: u64,
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
            opened_in_place: 0,
        }
    }

    /// How many plaintext bytes were opened straight in callers' buffers (the rest went
    /// through the reader's own buffer and were copied out).
    pub fn opened_in_place(&self) -> u64 {
        self.opened_in_place
    }

    /// Opens the complete records in the buffer; `Ok(true)` when one was.
    fn open_buffered(&mut self) -> std::io::Result<bool> {
        let start = self.sealed.start;
        let (at, opened) = open_records(
            &self.session.receive,
            &mut self.next_nonce,
            &mut self.buf[..self.sealed.end],
            start,
            start,
        )?;
        self.plain = start..opened;
        self.sealed.start = at;
        Ok(at > start)
    }
}

/// What a read straight into the caller's buffer came to.
enum Direct {
    /// Plaintext was handed out.
    Opened,
    /// The stream ended between records.
    End,
    /// No record was complete; what came waits in the reader's own buffer.
    Incomplete,
}

impl<R: AsyncRead + Unpin> SecureReader<R> {
    /// Reads up to [`BATCH`] bytes from the socket into `out`'s free space, opens every complete
    /// record where it landed, and reads the rest of a record cut off at the end where it can
    /// (so that the next read starts at a record again); a record still incomplete waits in the
    /// reader's own buffer. Only when nothing is buffered: the socket's next byte is a record's
    /// first.
    fn poll_read_direct(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<Direct>> {
        let start = out.filled().len();
        let room = out.remaining().min(BATCH);
        let (mut landed, mut at, mut opened) = (0, 0, 0);
        let mut want = room;
        let pending = loop {
            // SAFETY: the free space is handed to `inner` inside a `ReadBuf`, which writes only
            // initialised bytes into it; nothing here de-initialises any of it.
            let free = unsafe { &mut out.unfilled_mut()[landed..landed + want] };
            let mut raw = ReadBuf::uninit(free);
            match Pin::new(&mut self.inner).poll_read(cx, &mut raw) {
                Poll::Pending => break true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            let n = raw.filled().len();
            if n == 0 {
                if landed == 0 {
                    return Poll::Ready(Ok(Direct::End));
                }
                break false; // the buffered path reports the cut record
            }
            // SAFETY: `inner` filled, so initialised, the next `n` bytes of the free space.
            unsafe { out.assume_init(landed + n) };
            landed += n;
            let region = &mut out.initialized_mut()[start..start + landed];
            (at, opened) = open_records(
                &self.session.receive,
                &mut self.next_nonce,
                region,
                at,
                opened,
            )?;
            want = missing(&region[at..])?;
            if at == landed || landed + want > room {
                break false;
            }
        };
        let rest = landed - at;
        self.buf[..rest].copy_from_slice(&out.initialized_mut()[start + at..start + landed]);
        self.sealed = 0..rest;
        out.advance(opened);
        self.opened_in_place += opened as u64;
        if opened > 0 {
            Poll::Ready(Ok(Direct::Opened))
        } else if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(Direct::Incomplete))
        }
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
            if this.sealed.is_empty() && out.remaining() >= DIRECT {
                match ready!(this.poll_read_direct(cx, out))? {
                    Direct::Opened | Direct::End => return Poll::Ready(Ok(())),
                    Direct::Incomplete => continue,
                }
            }
            if this.open_buffered()? {
                continue;
            }
            // The record at `sealed` is incomplete. A caller with room for whole records gets
            // only its rest read here, so that the next read goes straight to the caller; others
            // a batch. A whole record fits behind the front of the buffer.
            let want = if out.remaining() >= DIRECT {
                missing(&this.buf[this.sealed.clone()])?
            } else {
                usize::MAX
            };
            if this.buf.len() - this.sealed.start < DIRECT {
                let moved = this.sealed.len();
                this.buf.copy_within(this.sealed.clone(), 0);
                this.sealed = 0..moved;
            }
            let end = this.buf.len().min(this.sealed.end.saturating_add(want));
            let mut free = ReadBuf::new(&mut this.buf[this.sealed.end..end]);
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
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
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

impl<W: AsyncWrite + Unpin> SecureWriter<W> {
    /// Writes `payload` as records after what is pending, sealing it where it lies: its bytes
    /// are ciphertext afterwards (for a caller that is done with them, like a link's writer
    /// with a tensor it has sent), and none is copied. The records and their headers and tags
    /// go to the socket [`BATCH`] bytes at a time, in one vectored write each.
    pub async fn write_spent(&mut self, payload: &mut [u8]) -> std::io::Result<()> {
        const RECORDS: usize = BATCH / (HEADER + MAX_RECORD);
        for batch in payload.chunks_mut(RECORDS * MAX_PLAIN) {
            let mut framing = [([0u8; HEADER], [0u8; TAG]); RECORDS];
            for (record, (header, tag)) in batch.chunks_mut(MAX_PLAIN).zip(&mut framing) {
                *header = ((record.len() + TAG) as u32).to_le_bytes();
                *tag = self.session.send.seal(self.next_nonce, record);
                self.next_nonce += 1;
            }
            let mut slices = Vec::with_capacity(1 + 3 * RECORDS);
            slices.push(std::io::IoSlice::new(&self.pending[self.pending_pos..]));
            for (record, (header, tag)) in batch.chunks(MAX_PLAIN).zip(&framing) {
                slices.extend([header.as_slice(), record, tag].map(std::io::IoSlice::new));
            }
            write_all_vectored(&mut self.inner, &mut slices).await?;
            self.pending.clear();
            self.pending_pos = 0;
        }
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin + Send> crate::framed::FrameSink for SecureWriter<W> {
    async fn write_spent(&mut self, payload: &mut [u8]) -> std::io::Result<()> {
        SecureWriter::write_spent(self, payload).await
    }
}

/// Writes every byte of `slices` in order, as few system calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    inner: &mut W,
    mut slices: &mut [std::io::IoSlice<'_>],
) -> std::io::Result<()> {
    std::io::IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = inner.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
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
