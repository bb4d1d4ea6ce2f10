//! Private links: after the greeting, every byte of a link travels inside Noise transport
//! messages (the Noise Protocol Framework, through the `snow` crate), so nobody on the path can
//! read a model or a gradient, or inject, replay or reorder a frame.
//!
//! The session comes from a `Noise_NNpsk0_25519_<cipher>_BLAKE2s` handshake: ephemeral
//! Diffie-Hellman keys on both sides (forward secrecy: a secret that leaks later does not open
//! recorded traffic) mixed with a pre-shared key derived from the run's shared secret (only nodes
//! that hold it complete the handshake), and a prologue binding it to the greeting it follows (run
//! id, both ranks and both nonces).
//!
//! The cipher is chosen per link ([`Cipher::agreed`]): AES-256-GCM when both ends have AES
//! instructions (x86-64 with AES-NI and carry-less multiply, ARMv8 with its crypto extension),
//! ChaCha20-Poly1305 otherwise — a Raspberry Pi 4 has no AES instructions, and there ChaCha is
//! several times faster. On a machine with them AES-GCM costs about half of ChaCha's CPU per byte
//! (`ringtmp bench-transport` measures both), and on loopback or a fast network that CPU is taken
//! from the node's training. Each side says in its greeting whether it would use AES; the
//! protocol name is hashed into the handshake, so two ends that disagreed could not complete it.
//! Both ciphers run on `ring`'s assembly (snow's `ring-accelerated`), the same bytes as the
//! pure-Rust crates'.
//!
//! On the wire a record is `[u32 LE ciphertext length][ciphertext ≤ 65,535 bytes]`, a Noise
//! transport message. Each direction numbers its records 0, 1, 2, … and the receiver decrypts
//! record k with nonce k, so a forged, replayed, dropped or reordered record fails
//! authentication; the reader then ends the link with an error (`InvalidData`) and never hands
//! on a byte of it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use snow::StatelessTransportState;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// The authenticated cipher that seals a private link's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cipher {
    /// ChaCha20-Poly1305: fast everywhere, including CPUs without AES instructions.
    ChaChaPoly,
    /// AES-256-GCM: about half of ChaCha's CPU per byte where the CPU has AES instructions.
    AesGcm,
}

impl Cipher {
    /// Whether this CPU has the instructions that make AES-256-GCM the cheaper cipher: AES and
    /// carry-less multiplication (x86-64 AES-NI and PCLMULQDQ, ARMv8 AES and PMULL). Without them
    /// `ring` falls back to a constant-time AES several times slower than ChaCha.
    pub fn aes_is_fast_here() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("aes")
                && std::arch::is_x86_feature_detected!("pclmulqdq")
        }
        #[cfg(target_arch = "aarch64")]
        {
            std::arch::is_aarch64_feature_detected!("aes")
                && std::arch::is_aarch64_feature_detected!("pmull")
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            false
        }
    }

    /// The cipher of a link whose two ends would (`true`) or would not use AES: AES-256-GCM only
    /// when both would, so a board without AES instructions never runs the slow one. Symmetric,
    /// so both ends reach the same choice from the two greetings.
    pub fn agreed(mine: bool, theirs: bool) -> Self {
        if mine && theirs {
            Self::AesGcm
        } else {
            Self::ChaChaPoly
        }
    }

    /// The cipher of a link between two nodes like this one.
    pub fn between_two_like_this() -> Self {
        let here = Self::aes_is_fast_here();
        Self::agreed(here, here)
    }

    /// The Noise protocol name a link with this cipher speaks after the greeting.
    pub fn noise_pattern(self) -> &'static str {
        match self {
            Self::ChaChaPoly => "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s",
            Self::AesGcm => "Noise_NNpsk0_25519_AESGCM_BLAKE2s",
        }
    }

    /// Its usual name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ChaChaPoly => "ChaCha20-Poly1305",
            Self::AesGcm => "AES-256-GCM",
        }
    }
}
/// Largest Noise message.
const MAX_RECORD: usize = 65_535;
/// Authentication tag per record.
const TAG: usize = 16;
/// Most plaintext one record carries.
const MAX_PLAIN: usize = MAX_RECORD - TAG;

/// An established session: the two directions' keys, shared by a link's reader and writer (each
/// keeps its own record counter).
pub type Session = Arc<StatelessTransportState>;

/// The pre-shared key of a run: SHA-256 of a label and the shared secret (the secret may have any
/// length; the label keeps this key apart from the greeting's HMAC key).
pub fn psk(secret: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"ringtmp link psk v1\0");
    h.update(secret);
    h.finalize().into()
}

/// Runs the Noise handshake on `stream` for a link sealed with `cipher`: the `initiator` sends
/// `-> psk, e`, the responder answers `<- e, ee`. Errors are the reason, for the caller to wrap
/// with the peer's name.
pub async fn establish<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    initiator: bool,
    psk: &[u8; 32],
    prologue: &[u8],
    cipher: Cipher,
) -> Result<Session, String> {
    establish_with(
        stream,
        initiator,
        psk,
        prologue,
        cipher,
        Primitives::Fastest,
    )
    .await
}

/// Whose implementation of the Noise primitives a session uses. Both speak the same bytes.
#[derive(Clone, Copy, Debug)]
enum Primitives {
    /// `ring`'s assembly where it has them (both ciphers; ChaCha20-Poly1305 gave 1.2–1.4× the
    /// throughput of a private link on loopback, `ringtmp bench-transport`), the pure-Rust crates
    /// for the rest.
    Fastest,
    /// The pure-Rust crates only (`snow`'s default resolver; the interop test's
    /// other side).
    #[cfg_attr(not(test), allow(dead_code))]
    PureRust,
}

async fn establish_with<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    initiator: bool,
    psk: &[u8; 32],
    prologue: &[u8],
    cipher: Cipher,
    primitives: Primitives,
) -> Result<Session, String> {
    let params = cipher
        .noise_pattern()
        .parse()
        .map_err(|e| format!("noise parameters: {e}"))?;
    let builder = match primitives {
        Primitives::Fastest => snow::Builder::new(params),
        Primitives::PureRust => {
            snow::Builder::with_resolver(params, Box::new(snow::resolvers::DefaultResolver))
        }
    };
    let builder = builder
        .psk(0, psk)
        .and_then(|b| b.prologue(prologue))
        .map_err(|e| format!("noise setup: {e}"))?;
    let mut state = if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(|e| format!("noise setup: {e}"))?;
    let mut message = vec![0u8; MAX_RECORD];
    let mut payload = vec![0u8; MAX_RECORD];
    for turn in 0..2 {
        if (turn == 0) == initiator {
            let n = state
                .write_message(&[], &mut message)
                .map_err(|e| format!("noise handshake: {e}"))?;
            stream
                .write_all(&(n as u16).to_le_bytes())
                .await
                .map_err(|e| format!("cannot send the key exchange: {e}"))?;
            stream
                .write_all(&message[..n])
                .await
                .map_err(|e| format!("cannot send the key exchange: {e}"))?;
        } else {
            let mut len = [0u8; 2];
            stream
                .read_exact(&mut len)
                .await
                .map_err(|e| format!("the key exchange did not arrive: {e}"))?;
            let n = usize::from(u16::from_le_bytes(len));
            stream
                .read_exact(&mut message[..n])
                .await
                .map_err(|e| format!("the key exchange did not arrive: {e}"))?;
            state
                .read_message(&message[..n], &mut payload)
                .map_err(|_| {
                    "the key exchange failed (a different secret, or not this run's peer)"
                        .to_string()
                })?;
        }
    }
    state
        .into_stateless_transport_mode()
        .map(Arc::new)
        .map_err(|e| format!("noise handshake: {e}"))
}

fn forged() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "a record failed authentication (forged, replayed, reordered or corrupted in transit)",
    )
}

/// The receiving side of a private link: decrypts records from `inner` into a plain byte
/// stream.
pub struct SecureReader<R> {
    inner: R,
    session: Session,
    next_nonce: u64,
    /// The record being read: header, then ciphertext.
    header: [u8; 4],
    header_filled: usize,
    record: Vec<u8>,
    record_filled: usize,
    /// Decrypted bytes not yet handed out.
    plain: Vec<u8>,
    plain_pos: usize,
}

impl<R> SecureReader<R> {
    /// Decrypts what `inner` carries with `session`.
    pub fn new(inner: R, session: Session) -> Self {
        Self {
            inner,
            session,
            next_nonce: 0,
            header: [0; 4],
            header_filled: 0,
            record: Vec::new(),
            record_filled: 0,
            plain: Vec::with_capacity(MAX_RECORD),
            plain_pos: 0,
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SecureReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.plain_pos < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.plain_pos);
                buf.put_slice(&this.plain[this.plain_pos..this.plain_pos + n]);
                this.plain_pos += n;
                return Poll::Ready(Ok(()));
            }
            while this.header_filled < 4 {
                let mut rb = ReadBuf::new(&mut this.header[this.header_filled..]);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
                let n = rb.filled().len();
                if n == 0 {
                    return if this.header_filled == 0 {
                        Poll::Ready(Ok(())) // end of stream between records
                    } else {
                        Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()))
                    };
                }
                this.header_filled += n;
            }
            let len = u32::from_le_bytes(this.header) as usize;
            if !(TAG..=MAX_RECORD).contains(&len) {
                return Poll::Ready(Err(forged()));
            }
            this.record.resize(len, 0);
            while this.record_filled < len {
                let mut rb = ReadBuf::new(&mut this.record[this.record_filled..]);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
                let n = rb.filled().len();
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()));
                }
                this.record_filled += n;
            }
            this.plain.resize(MAX_RECORD, 0);
            let n = this
                .session
                .read_message(this.next_nonce, &this.record, &mut this.plain)
                .map_err(|_| forged())?;
            this.next_nonce += 1;
            this.plain.truncate(n);
            this.plain_pos = 0;
            (this.header_filled, this.record_filled) = (0, 0);
        }
    }
}

/// The sending side of a private link: every write becomes one record (up to 65,519 bytes of
/// it). A record is complete on the socket only after the next write or a flush, so the link's
/// writer flushes after each frame.
pub struct SecureWriter<W> {
    inner: W,
    session: Session,
    next_nonce: u64,
    /// The sealed record still to be written, and how much of it has been.
    pending: Vec<u8>,
    pending_pos: usize,
}

impl<W> SecureWriter<W> {
    /// Encrypts what is written with `session` and sends it to `inner`.
    pub fn new(inner: W, session: Session) -> Self {
        Self {
            inner,
            session,
            next_nonce: 0,
            pending: Vec::with_capacity(4 + MAX_RECORD),
            pending_pos: 0,
        }
    }
}

impl<W: AsyncWrite + Unpin> SecureWriter<W> {
    /// Writes out the pending record.
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
        ready!(this.poll_drain(cx))?;
        let n = buf.len().min(MAX_PLAIN);
        this.pending.resize(4 + n + TAG, 0);
        let sealed = this
            .session
            .write_message(this.next_nonce, &buf[..n], &mut this.pending[4..])
            .map_err(|e| std::io::Error::other(format!("sealing a record: {e}")))?;
        this.next_nonce += 1;
        this.pending[..4].copy_from_slice(&(sealed as u32).to_le_bytes());
        this.pending.truncate(4 + sealed);
        this.pending_pos = 0;
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

/// Writes one frame on a connection that carries exactly one frame each way after its greeting
/// (the rendezvous), sealed with `session` when there is one. A second frame in the same
/// direction would reuse nonce 0, so links use a [`SecureWriter`] for their lifetime instead.
pub async fn write_one_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    session: Option<&Session>,
    message: &ringtmp_wire::Message,
) -> std::io::Result<usize> {
    let mut scratch = Vec::new();
    match session {
        None => crate::framed::write_frame(stream, message, &mut scratch).await,
        Some(session) => {
            let mut sealed = SecureWriter::new(stream, session.clone());
            let n = crate::framed::write_frame(&mut sealed, message, &mut scratch).await?;
            sealed.flush().await?;
            Ok(n)
        }
    }
}

/// Reads the one frame such a connection carries towards this side (see [`write_one_frame`]).
pub async fn read_one_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    session: Option<&Session>,
    limits: &ringtmp_wire::Limits,
) -> Result<(ringtmp_wire::Message, usize), crate::framed::ReadError> {
    let mut buf = Vec::new();
    match session {
        None => crate::framed::read_frame(stream, &mut buf, limits).await,
        Some(session) => {
            let mut sealed = SecureReader::new(stream, session.clone());
            crate::framed::read_frame(&mut sealed, &mut buf, limits).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CIPHERS: [Cipher; 2] = [Cipher::ChaChaPoly, Cipher::AesGcm];

    /// Two sessions of one handshake over an in-memory pipe, each side with its own cipher.
    async fn pair_with(
        (secret_a, cipher_a): (&[u8], Cipher),
        (secret_b, cipher_b): (&[u8], Cipher),
    ) -> (Result<Session, String>, Result<Session, String>) {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let (pa, pb) = (psk(secret_a), psk(secret_b));
        // Each side closes its end when it is done, as a link does, so a refusal is not a hang.
        tokio::join!(
            async move { establish(&mut a, true, &pa, b"prologue", cipher_a).await },
            async move { establish(&mut b, false, &pb, b"prologue", cipher_b).await }
        )
    }

    async fn pair(
        secret_a: &[u8],
        secret_b: &[u8],
        cipher: Cipher,
    ) -> (Result<Session, String>, Result<Session, String>) {
        pair_with((secret_a, cipher), (secret_b, cipher)).await
    }

    /// `records` sealed by a writer of `session`, as they travel.
    async fn sealed(session: &Session, chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut wire = Vec::new();
        let mut w = SecureWriter::new(&mut wire, session.clone());
        for c in chunks {
            w.write_all(c).await.unwrap();
            w.flush().await.unwrap();
        }
        let mut records = Vec::new();
        let mut rest = &wire[..];
        while !rest.is_empty() {
            let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            records.push(rest[..4 + len].to_vec());
            rest = &rest[4 + len..];
        }
        records
    }

    async fn read_all(session: &Session, records: &[Vec<u8>]) -> std::io::Result<Vec<u8>> {
        let wire: Vec<u8> = records.concat();
        let mut r = SecureReader::new(&wire[..], session.clone());
        let mut out = Vec::new();
        r.read_to_end(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn a_node_on_rings_primitives_and_one_on_the_pure_rust_ones_understand_each_other() {
        // A node built before `ring`'s ciphers were switched on, or on a platform where it falls
        // back, must still join: the handshake and records in both directions, both ciphers.
        for cipher in CIPHERS {
            for initiator_primitives in [Primitives::Fastest, Primitives::PureRust] {
                let responder_primitives = match initiator_primitives {
                    Primitives::Fastest => Primitives::PureRust,
                    Primitives::PureRust => Primitives::Fastest,
                };
                let (mut x, mut y) = tokio::io::duplex(1 << 20);
                let key = psk(b"s");
                let (a, b) = tokio::join!(
                    async move {
                        establish_with(&mut x, true, &key, b"p", cipher, initiator_primitives).await
                    },
                    async move {
                        establish_with(&mut y, false, &key, b"p", cipher, responder_primitives)
                            .await
                    }
                );
                let (a, b) = (a.unwrap(), b.unwrap());
                let big: Vec<u8> = (0..150_000u32).map(|i| (i % 241) as u8).collect();
                let there = read_all(&b, &sealed(&a, &[b"ping", &big]).await)
                    .await
                    .unwrap();
                assert_eq!((&there[..4], &there[4..]), (&b"ping"[..], &big[..]));
                let back = read_all(&a, &sealed(&b, &[&big]).await).await.unwrap();
                assert_eq!(back, big, "{cipher:?}, {initiator_primitives:?} initiator");
            }
        }
    }

    #[test]
    fn aes_only_when_both_ends_have_it() {
        assert_eq!(Cipher::agreed(true, true), Cipher::AesGcm);
        for (mine, theirs) in [(true, false), (false, true), (false, false)] {
            assert_eq!(Cipher::agreed(mine, theirs), Cipher::ChaChaPoly);
        }
    }

    #[tokio::test]
    async fn ends_that_disagree_on_the_cipher_cannot_complete_the_key_exchange() {
        // The greeting makes both ends choose alike; were one of them to choose otherwise (a bug,
        // or a greeting altered in transit), the protocol names differ and the handshake fails
        // instead of sealing records that the other end cannot open.
        let (a, b) = pair_with((b"s", Cipher::AesGcm), (b"s", Cipher::ChaChaPoly)).await;
        assert!(a.is_err() || b.is_err(), "one side must refuse");
    }

    #[tokio::test]
    async fn records_round_trip_and_large_writes_split() {
        for cipher in CIPHERS {
            let (a, b) = pair(b"s", b"s", cipher).await;
            let (a, b) = (a.unwrap(), b.unwrap());
            let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
            let records = sealed(&a, &[b"hello", &big]).await;
            assert_eq!(records.len(), 1 + big.len().div_ceil(MAX_PLAIN));
            assert!(
                !records.concat().windows(5).any(|w| w == b"hello"),
                "the plaintext is not on the wire ({cipher:?})"
            );
            let got = read_all(&b, &records).await.unwrap();
            assert_eq!(&got[..5], b"hello");
            assert_eq!(&got[5..], &big[..]);
        }
    }

    #[tokio::test]
    async fn forged_replayed_reordered_and_dropped_records_are_refused() {
        for cipher in CIPHERS {
            forged_replayed_reordered_and_dropped_records_are_refused_with(cipher).await;
        }
    }

    async fn forged_replayed_reordered_and_dropped_records_are_refused_with(cipher: Cipher) {
        let (a, b) = pair(b"s", b"s", cipher).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let records = sealed(&a, &[b"one", b"two", b"three"]).await;
        let mut flipped = records.clone();
        let last = flipped[1].len() - 1;
        flipped[1][last] ^= 1;
        let replayed = vec![records[0].clone(), records[0].clone()];
        let reordered = vec![records[1].clone(), records[0].clone()];
        let dropped = vec![records[0].clone(), records[2].clone()];
        for (what, wire) in [
            ("forged", flipped),
            ("replayed", replayed),
            ("reordered", reordered),
            ("dropped", dropped),
        ] {
            let e = read_all(&b, &wire).await.unwrap_err();
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::InvalidData,
                "{what}, {cipher:?}"
            );
        }
        // And the other direction's key does not open these.
        assert!(read_all(&a, &records).await.is_err());
    }

    #[tokio::test]
    async fn a_different_secret_fails_the_key_exchange() {
        for cipher in CIPHERS {
            let (a, b) = pair(b"secret one", b"secret two", cipher).await;
            assert!(
                a.is_err() || b.is_err(),
                "one side must refuse ({cipher:?})"
            );
        }
    }
}
