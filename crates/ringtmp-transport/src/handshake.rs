//! The authenticated greeting on a fresh connection. Both sides send `Hello` (run id, rank, a
//! random nonce, whether they encrypt and whether they would use AES), then `Proof` (an HMAC over
//! both nonces and ranks); each verifies the other before anything else is read. A wrong protocol
//! version shows up as a frame the decoder refuses; a wrong run id, an unexpected rank, a bad
//! proof or a disagreement about encryption is refused here. Until the proof verifies, the peer
//! is a stranger: named by its address (a rank it claims is quoted as a claim), and its frames
//! bounded by [`Limits::greeting`] (a few hundred bytes, no tensor), the whole greeting by one
//! deadline. Then, unless both run with
//! `--insecure-plaintext`, the Noise handshake of [`crate::secure`] (bound to this greeting by its
//! prologue, with the cipher both greetings agree on) makes the session every later byte travels
//! in. The `aes` flags are not under the proof: someone on the path who flips one makes the two
//! ends choose different ciphers, and the key exchange fails — no more than cutting the
//! connection, which they can do anyway — and flipping both only swaps one sound cipher for the
//! other. Every read has a deadline.

use std::net::SocketAddr;

use rand::Rng;
use ringtmp_wire::auth::{Transcript, prove, verify};
use ringtmp_wire::{Control, Limits, Message};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::timeout;

use crate::config::TransportConfig;
use crate::error::{PeerName, TransportError};
use crate::framed::{ReadError, read_frame, write_frame};
use crate::secure::Session;

/// Runs the handshake on `stream` with the peer at `addr`; `accept(rank)` says whether a peer of
/// that rank is welcome here. Returns the peer's verified rank.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: SocketAddr,
    cfg: &TransportConfig,
    accept: impl Fn(u32) -> bool,
) -> Result<(u32, Option<Session>), TransportError> {
    // One deadline for the whole greeting, so a stranger that sends a byte now and then cannot
    // keep it open by resetting a per-message timer.
    match timeout(cfg.handshake_timeout, greet(stream, addr, cfg, accept)).await {
        Ok(done) => done,
        Err(_) => Err(refused(
            &PeerName {
                rank: None,
                addr: Some(addr),
            },
            format!(
                "the handshake did not complete within {:?}",
                cfg.handshake_timeout
            ),
        )),
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "the greeting's steps in protocol order"
)]
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: SocketAddr,
    cfg: &TransportConfig,
    accept: impl Fn(u32) -> bool,
) -> Result<(u32, Option<Session>), TransportError> {
    // The peer is named by its address alone until its proof verifies: a rank it claims before
    // that is a stranger's word.
    let peer = PeerName {
        rank: None,
        addr: Some(addr),
    };
    let mut nonce = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce);
    let hello = Message::Control(Control::Hello {
        run_id: cfg.run_id,
        rank: cfg.rank,
        nonce,
        encrypted: cfg.encrypt,
        aes: cfg.aes,
    });
    let mut scratch = Vec::new();
    write_frame(stream, &hello, &mut scratch)
        .await
        .map_err(|e| refused(&peer, format!("cannot send hello: {e}")))?;

    let (their_run, their_rank, their_nonce, their_encryption, their_aes) =
        match next(stream, &peer, cfg).await? {
            Message::Control(Control::Hello {
                run_id,
                rank,
                nonce,
                encrypted,
                aes,
            }) => (run_id, rank, nonce, encrypted, aes),
            other => {
                return Err(refused(
                    &peer,
                    format!("expected a hello, got {}", describe(&other)),
                ));
            }
        };
    if their_run != cfg.run_id {
        return Err(refused(
            &peer,
            format!(
                "it belongs to run {their_run:016x}, this is run {:016x}",
                cfg.run_id
            ),
        ));
    }
    if their_rank == cfg.rank || !accept(their_rank) {
        return Err(refused(
            &peer,
            format!("it claims rank {their_rank}, which is not expected to connect here"),
        ));
    }
    if their_encryption != cfg.encrypt {
        let (plain, private) = if cfg.encrypt {
            ("it", "this node")
        } else {
            ("this node", "it")
        };
        return Err(refused(
            &peer,
            format!(
                "it claims rank {their_rank}; {plain} runs with --insecure-plaintext and \
                 {private} does not; every node of a run must agree"
            ),
        ));
    }
    let mine = Transcript {
        run_id: cfg.run_id,
        prover: cfg.rank,
        verifier: their_rank,
        verifier_nonce: &their_nonce,
        prover_nonce: &nonce,
    };
    let proof = Message::Control(Control::Proof {
        mac: prove(&cfg.secret, &mine),
    });
    write_frame(stream, &proof, &mut scratch)
        .await
        .map_err(|e| refused(&peer, format!("cannot send proof: {e}")))?;
    let mac = match next(stream, &peer, cfg).await? {
        Message::Control(Control::Proof { mac }) => mac,
        other => {
            return Err(refused(
                &peer,
                format!("expected a proof, got {}", describe(&other)),
            ));
        }
    };
    let theirs = Transcript {
        run_id: cfg.run_id,
        prover: their_rank,
        verifier: cfg.rank,
        verifier_nonce: &nonce,
        prover_nonce: &their_nonce,
    };
    if !verify(&cfg.secret, &theirs, &mac) {
        return Err(refused(
            &peer,
            format!(
                "authentication failed: it claims rank {their_rank}, but its proof does not \
                 match this node's secret (a stranger, or a node started with a different \
                 RINGTMP_SECRET or --secret-file)"
            ),
        ));
    }
    let peer = PeerName {
        rank: Some(their_rank),
        addr: Some(addr),
    };
    if !cfg.encrypt {
        return Ok((their_rank, None));
    }
    // The lower rank leads the key exchange; the prologue binds it to this greeting.
    let initiator = cfg.rank < their_rank;
    let (low, high) = if initiator {
        ((cfg.rank, &nonce), (their_rank, &their_nonce))
    } else {
        ((their_rank, &their_nonce), (cfg.rank, &nonce))
    };
    let mut prologue = b"ringtmp link v1".to_vec();
    prologue.extend_from_slice(&cfg.run_id.to_le_bytes());
    for (rank, nonce) in [low, high] {
        prologue.extend_from_slice(&rank.to_le_bytes());
        prologue.extend_from_slice(nonce.as_slice());
    }
    let cipher = crate::secure::Cipher::agreed(cfg.aes, their_aes);
    tracing::debug!(
        peer = their_rank,
        cipher = cipher.name(),
        "sealing the link"
    );
    let session = timeout(
        cfg.handshake_timeout,
        crate::secure::establish(
            stream,
            initiator,
            &crate::secure::psk(&cfg.secret),
            &prologue,
            cipher,
        ),
    )
    .await
    .map_err(|_| {
        refused(
            &peer,
            format!("no key exchange within {:?}", cfg.handshake_timeout),
        )
    })?
    .map_err(|e| match e {
        crate::secure::ExchangeError::Cut(reason) => TransportError::GreetingCut {
            peer: peer.clone(),
            reason,
        },
        crate::secure::ExchangeError::Failed(reason) => refused(&peer, reason),
    })?;
    Ok((their_rank, Some(session)))
}

async fn next<S: AsyncRead + Unpin>(
    stream: &mut S,
    peer: &PeerName,
    cfg: &TransportConfig,
) -> Result<Message, TransportError> {
    let mut buf = Vec::new();
    match timeout(
        cfg.handshake_timeout,
        read_frame(stream, &mut buf, &Limits::greeting()),
    )
    .await
    {
        Err(_) => Err(refused(
            peer,
            format!("no handshake message within {:?}", cfg.handshake_timeout),
        )),
        Ok(Ok((message, _))) => Ok(message),
        Ok(Err(ReadError::Decode(e))) => {
            Err(refused(peer, format!("malformed handshake frame: {e}")))
        }
        Ok(Err(ReadError::Closed)) => Err(TransportError::GreetingCut {
            peer: peer.clone(),
            reason: "closed".into(),
        }),
        Ok(Err(ReadError::Io(e))) => Err(TransportError::GreetingCut {
            peer: peer.clone(),
            reason: e.to_string(),
        }),
    }
}

fn refused(peer: &PeerName, reason: String) -> TransportError {
    TransportError::Handshake {
        peer: peer.clone(),
        reason,
    }
}

fn describe(m: &Message) -> String {
    match m {
        Message::Control(c) => format!("{c:?}")
            .split([' ', '{'])
            .next()
            .unwrap_or("control")
            .to_string(),
        Message::Tensor(..) => "a tensor".into(),
    }
}
