//! Private links: after the greeting, every byte of a link travels inside Noise transport
//! messages (the Noise Protocol Framework), so nobody on the path can read a model or a
//! gradient, or inject, replay or reorder a frame.
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
//!
//! `snow` runs the handshake; its result, the two keys of Noise's split, seals and opens the
//! link's records with AWS-LC's ciphers directly ([`RecordKey`], [`SecureWriter`],
//! [`SecureReader`]): in place and in batches, where `snow`'s own transport copies every record
//! twice, so that a private link costs its node little more CPU than the cipher itself. The
//! records are Noise transport messages all the same (tested against `snow`'s transport, both
//! ways).

mod cipher;
mod records;

pub use cipher::{Cipher, RecordKey, Session, SessionKeys, TAG};
pub use records::{BATCH, FrameConnection, MAX_PLAIN, MAX_RECORD, SecureReader, SecureWriter};

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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
) -> Result<Session, ExchangeError> {
    let mut state = handshake_state(initiator, psk, prologue, cipher, Resolver::Fastest)?;
    exchange(stream, initiator, &mut state).await?;
    // Noise's split: the first key seals what the initiator sends, the second what it receives.
    let (initiator_sends, responder_sends) = state.dangerously_get_raw_split();
    let (send, receive) = if initiator {
        (initiator_sends, responder_sends)
    } else {
        (responder_sends, initiator_sends)
    };
    Ok(Arc::new(SessionKeys {
        send: RecordKey::new(cipher, &send),
        receive: RecordKey::new(cipher, &receive),
    }))
}

/// Why a key exchange did not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExchangeError {
    /// The connection failed under it (closed, reset, a broken pipe): the greeting was cut
    /// short, as a peer closing its oldest greetings under a flood cuts them, not refused.
    Cut(String),
    /// The exchange itself failed: a message that does not verify or is malformed.
    Failed(String),
}

impl std::fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cut(reason) | Self::Failed(reason) => f.write_str(reason),
        }
    }
}

impl From<String> for ExchangeError {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

impl From<ExchangeError> for String {
    fn from(e: ExchangeError) -> Self {
        e.to_string()
    }
}

/// Whose implementation of the handshake's primitives `snow` uses. Both speak the same bytes.
#[derive(Clone, Copy, Debug)]
enum Resolver {
    /// `ring`'s where it has them, the pure-Rust crates for the rest.
    Fastest,
    /// The pure-Rust crates only (`snow`'s default; the interop tests' reference side).
    #[cfg_attr(not(test), allow(dead_code))]
    PureRust,
}

/// A handshake about to start, for `cipher`'s protocol name.
fn handshake_state(
    initiator: bool,
    psk: &[u8; 32],
    prologue: &[u8],
    cipher: Cipher,
    resolver: Resolver,
) -> Result<snow::HandshakeState, String> {
    let params = cipher
        .noise_pattern()
        .parse()
        .map_err(|e| format!("noise parameters: {e}"))?;
    let builder = match resolver {
        Resolver::Fastest => snow::Builder::new(params),
        Resolver::PureRust => {
            snow::Builder::with_resolver(params, Box::new(snow::resolvers::DefaultResolver))
        }
    };
    let builder = builder
        .psk(0, psk)
        .and_then(|b| b.prologue(prologue))
        .map_err(|e| format!("noise setup: {e}"))?;
    if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(|e| format!("noise setup: {e}"))
}

/// The handshake's two messages, each `[u16 LE length][message]`.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    initiator: bool,
    state: &mut snow::HandshakeState,
) -> Result<(), ExchangeError> {
    // Each message is 48 bytes (an ephemeral key and a tag, no payload): a larger length is
    // refused before it is read.
    const MAX_MESSAGE: usize = 1024;
    let mut message = vec![0u8; MAX_MESSAGE];
    let mut payload = vec![0u8; MAX_MESSAGE];
    for turn in 0..2 {
        if (turn == 0) == initiator {
            let n = state
                .write_message(&[], &mut message)
                .map_err(|e| format!("noise handshake: {e}"))?;
            stream
                .write_all(&(n as u16).to_le_bytes())
                .await
                .map_err(|e| ExchangeError::Cut(format!("cannot send the key exchange: {e}")))?;
            stream
                .write_all(&message[..n])
                .await
                .map_err(|e| ExchangeError::Cut(format!("cannot send the key exchange: {e}")))?;
        } else {
            let mut len = [0u8; 2];
            stream
                .read_exact(&mut len)
                .await
                .map_err(|e| ExchangeError::Cut(format!("the key exchange did not arrive: {e}")))?;
            let n = usize::from(u16::from_le_bytes(len));
            if n > MAX_MESSAGE {
                return Err(ExchangeError::Failed(format!(
                    "the key exchange declared a message of {n} bytes (at most {MAX_MESSAGE})"
                )));
            }
            stream
                .read_exact(&mut message[..n])
                .await
                .map_err(|e| ExchangeError::Cut(format!("the key exchange did not arrive: {e}")))?;
            state
                .read_message(&message[..n], &mut payload)
                .map_err(|_| {
                    "the key exchange failed (a different secret, or not this run's peer)"
                        .to_string()
                })?;
        }
    }
    if state.is_handshake_finished() {
        Ok(())
    } else {
        Err(ExchangeError::Failed(
            "noise handshake: not finished after its two messages".into(),
        ))
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
    ) -> (
        Result<Session, ExchangeError>,
        Result<Session, ExchangeError>,
    ) {
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
    ) -> (
        Result<Session, ExchangeError>,
        Result<Session, ExchangeError>,
    ) {
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

    /// What a reader of `session` makes of `records`: read both with small reads (through the
    /// reader's buffer) and with reads of room for many records (opened in the caller's
    /// buffer), which must agree.
    async fn read_all(session: &Session, records: &[Vec<u8>]) -> std::io::Result<Vec<u8>> {
        let wire: Vec<u8> = records.concat();
        let mut small = SecureReader::new(&wire[..], session.clone());
        let mut by_small = Vec::new();
        let by_small = small.read_to_end(&mut by_small).await.map(|_| by_small);
        let mut large = SecureReader::new(&wire[..], session.clone());
        let mut by_large = Vec::new();
        let mut room = vec![0u8; 1 << 20];
        let by_large = loop {
            match large.read(&mut room).await {
                Ok(0) => break Ok(by_large),
                Ok(n) => by_large.extend_from_slice(&room[..n]),
                Err(e) => break Err(e),
            }
        };
        match (by_small, by_large) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "small and large reads disagree");
                Ok(a)
            }
            (Err(a), Err(b)) => {
                assert_eq!(a.kind(), b.kind(), "small and large reads fail differently");
                Err(a)
            }
            (a, b) => panic!("small reads: {a:?}, large reads: {b:?}"),
        }
    }

    /// A session of ours and `snow`'s own transport state (its pure-Rust primitives throughout)
    /// from one handshake: `ours_initiates` says which side leads.
    async fn ours_and_snows(
        cipher: Cipher,
        ours_initiates: bool,
    ) -> (Session, snow::StatelessTransportState) {
        let (mut x, mut y) = tokio::io::duplex(1 << 20);
        let key = psk(b"s");
        let (ours, theirs) = tokio::join!(
            async move { establish(&mut x, ours_initiates, &key, b"p", cipher).await },
            async move {
                let initiator = !ours_initiates;
                let mut state = handshake_state(initiator, &key, b"p", cipher, Resolver::PureRust)?;
                exchange(&mut y, initiator, &mut state).await?;
                state
                    .into_stateless_transport_mode()
                    .map_err(|e| e.to_string())
            }
        );
        (ours.unwrap(), theirs.unwrap())
    }

    #[tokio::test]
    async fn records_are_noise_transport_messages_both_ways() {
        // Our records, sealed and opened by AWS-LC directly, against `snow`'s reference transport
        // (pure-Rust ciphers, its own nonce layout): whichever side leads, with both ciphers, a
        // record either side seals the other opens, numbered alike.
        for cipher in CIPHERS {
            for ours_initiates in [true, false] {
                let (ours, theirs) = ours_and_snows(cipher, ours_initiates).await;
                let big: Vec<u8> = (0..150_000u32).map(|i| (i % 241) as u8).collect();
                // Ours → snow's.
                let mut opened = Vec::new();
                for (k, record) in sealed(&ours, &[b"ping", &big]).await.iter().enumerate() {
                    let mut out = vec![0u8; MAX_RECORD];
                    let n = theirs
                        .read_message(k as u64, &record[4..], &mut out)
                        .unwrap_or_else(|e| panic!("{cipher:?}: record {k}: {e}"));
                    opened.extend_from_slice(&out[..n]);
                }
                assert_eq!((&opened[..4], &opened[4..]), (&b"ping"[..], &big[..]));
                // Snow's → ours.
                let mut records = Vec::new();
                for (k, piece) in big.chunks(MAX_PLAIN).enumerate() {
                    let mut record = vec![0u8; 4 + MAX_RECORD];
                    let n = theirs
                        .write_message(k as u64, piece, &mut record[4..])
                        .unwrap();
                    record[..4].copy_from_slice(&(n as u32).to_le_bytes());
                    record.truncate(4 + n);
                    records.push(record);
                }
                let back = read_all(&ours, &records).await.unwrap();
                assert_eq!(back, big, "{cipher:?}, ours leads: {ours_initiates}");
            }
        }
    }

    /// A byte stream that hands out at most a few bytes a read, and says "not yet" every other
    /// time: the reader must piece records together across reads and wake-ups.
    struct Trickle<'a> {
        bytes: &'a [u8],
        reads: usize,
    }

    impl AsyncRead for Trickle<'_> {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.reads += 1;
            if self.reads.is_multiple_of(2) {
                cx.waker().wake_by_ref();
                return std::task::Poll::Pending;
            }
            // 1 byte to 300,000 in turn: across headers, tags and record boundaries.
            let most = [1, 7, 4_099, 65_541, 300_000][(self.reads / 2) % 5];
            let n = most.min(self.bytes.len()).min(buf.remaining());
            buf.put_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_reader_pieces_records_together_from_any_reads_into_any_buffers() {
        let (a, b) = pair(b"s", b"s", Cipher::between_two_like_this()).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let big: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
        let pieces: Vec<&[u8]> = vec![b"x", &big[..70_000], b"", &big[70_000..], b"tail"];
        let wire = sealed(&a, &pieces).await.concat();
        let mut reader = SecureReader::new(
            Trickle {
                bytes: &wire,
                reads: 0,
            },
            b,
        );
        let mut got = Vec::new();
        let mut buf = vec![0u8; 200_000];
        for k in 0.. {
            // Reads of 1 byte to 200,000 in turn into the caller's buffer: the large ones have
            // room for whole records, which are opened where they land.
            let want = [1, 13, 9_001, 200_000, 65_539][k % 5];
            let n = reader.read(&mut buf[..want]).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, pieces.concat());
    }

    #[tokio::test]
    async fn a_payload_sealed_where_it_lies_goes_out_as_the_same_records_as_a_copied_one() {
        // The writer's two ways of sealing a payload (copying it into its batch, or sealing it
        // in place and writing vectored) put the same bytes on the wire, also through a socket
        // that takes a few hundred bytes at a time.
        let (a, b) = pair(b"s", b"s", Cipher::between_two_like_this()).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let big: Vec<u8> = (0..700_001u32).map(|i| (i % 239) as u8).collect();
        let copied = sealed(&a, &[b"head", &big]).await.concat();
        let (near, mut far) = tokio::io::duplex(333);
        let drain = tokio::spawn(async move {
            let mut wire = Vec::new();
            far.read_to_end(&mut wire).await.map(|_| wire)
        });
        let mut w = SecureWriter::new(near, a);
        w.write_all(b"head").await.unwrap();
        let mut spent = big.clone();
        w.write_spent(&mut spent).await.unwrap();
        w.flush().await.unwrap();
        assert_ne!(spent, big, "the payload was sealed where it lay");
        w.shutdown().await.unwrap();
        drop(w);
        let in_place = drain.await.unwrap().unwrap();
        assert_eq!(in_place.len(), copied.len());
        assert!(in_place == copied, "the two ways differ on the wire");
        let got = read_all(&b, &[in_place]).await.unwrap();
        assert_eq!((&got[..4], &got[4..]), (&b"head"[..], &big[..]));
    }

    #[tokio::test]
    async fn a_frame_readers_large_reads_are_opened_in_its_own_buffer() {
        // Whatever sizes the socket hands out, a caller reading a large payload gets most of it
        // opened where it landed (no copy), and exactly the bytes that were sealed.
        let (a, b) = pair(b"s", b"s", Cipher::between_two_like_this()).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let big: Vec<u8> = (0..2_000_000u32).map(|i| (i % 253) as u8).collect();
        let wire = sealed(&a, &[b"prefix", &big]).await.concat();
        let mut reader = SecureReader::new(
            Trickle {
                bytes: &wire,
                reads: 0,
            },
            b,
        );
        let mut prefix = [0u8; 6];
        reader.read_exact(&mut prefix).await.unwrap();
        let mut payload = vec![0u8; big.len()];
        reader.read_exact(&mut payload).await.unwrap();
        assert_eq!((&prefix, &payload), (b"prefix", &big));
        let in_place = reader.opened_in_place() as f64 / big.len() as f64;
        println!("{in_place:.3} of the payload opened in place");
        assert!(
            in_place > 0.5,
            "only {in_place:.2} of the payload opened in place"
        );
    }

    #[tokio::test]
    async fn a_writer_gathers_records_into_batches_and_a_flush_sends_what_it_holds() {
        let (a, b) = pair(b"s", b"s", Cipher::between_two_like_this()).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let mut wire = Vec::new();
        let mut w = SecureWriter::new(&mut wire, a);
        w.write_all(b"held").await.unwrap();
        assert!(
            w.get_ref().is_empty(),
            "a small write waits for more or a flush"
        );
        w.flush().await.unwrap();
        assert_eq!(w.get_ref().len(), 4 + 4 + TAG);
        let big = vec![3u8; 3 * BATCH];
        w.write_all(&big).await.unwrap();
        w.flush().await.unwrap();
        let records = 1 + big.len().div_ceil(MAX_PLAIN);
        assert_eq!(wire.len(), 4 + big.len() + records * (4 + TAG));
        let got = read_all(&b, &[wire]).await.unwrap();
        assert_eq!((&got[..4], &got[4..]), (&b"held"[..], &big[..]));
    }

    #[tokio::test]
    async fn a_connection_numbers_every_frame_of_its_life_so_no_nonce_is_used_twice() {
        // The rendezvous sends several frames each way on one connection: the same message
        // twice must not seal to the same bytes (a reused nonce would give away the key stream
        // and, with AES-GCM, the means to forge), and the other end opens all of them in turn.
        let (a, b) = pair(b"s", b"s", Cipher::between_two_like_this()).await;
        let (a, b) = (a.unwrap(), b.unwrap());
        let (x, mut y) = tokio::io::duplex(1 << 20);
        let mut sender = FrameConnection::new(x, Some(a));
        let message = ringtmp_wire::Message::Control(ringtmp_wire::Control::Goodbye);
        let first = sender.send(&message).await.unwrap();
        sender.send(&message).await.unwrap();
        let mut wire = vec![0u8; 2 * (4 + first + TAG)];
        y.read_exact(&mut wire).await.unwrap();
        let (one, two) = wire.split_at(wire.len() / 2);
        assert_ne!(one, two, "the second frame reused the first one's nonce");
        let mut receiver = FrameConnection::new(std::io::Cursor::new(wire), Some(b));
        let limits = ringtmp_wire::Limits::default();
        for _ in 0..2 {
            let (got, _) = receiver.recv(&limits).await.unwrap();
            assert!(matches!(
                got,
                ringtmp_wire::Message::Control(ringtmp_wire::Control::Goodbye)
            ));
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
    async fn a_key_exchange_whose_connection_closes_was_cut_not_refused() {
        for initiator in [true, false] {
            let (mut ours, theirs) = tokio::io::duplex(1 << 10);
            drop(theirs);
            let key = psk(b"s");
            let got = establish(&mut ours, initiator, &key, b"p", Cipher::ChaChaPoly).await;
            assert!(
                matches!(got, Err(ExchangeError::Cut(_))),
                "initiator {initiator}: {:?}",
                got.err()
            );
        }
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
