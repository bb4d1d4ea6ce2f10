//! Mutual authentication by HMAC-SHA256 challenge–response over a shared secret.
//!
//! Both sides send `Hello { run_id, rank, nonce }` with a fresh 32-byte random nonce, then
//! `Proof { mac }` where `mac = HMAC(secret, "ringtmp-auth-v1" ‖ run_id ‖ prover rank ‖ verifier
//! rank ‖ verifier's nonce ‖ prover's nonce)`. Each side checks the other's proof (in constant
//! time) before acting on anything else it sent. Binding both ranks and both nonces means a proof
//! cannot be replayed on another connection or reflected back to its sender.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

const CONTEXT: &[u8] = b"ringtmp-auth-v1";

/// Who proves what to whom on one connection.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// The run both sides claim.
    pub run_id: u64,
    /// Rank of the side producing the proof.
    pub prover: u32,
    /// Rank of the side checking it.
    pub verifier: u32,
    /// The verifier's challenge.
    pub verifier_nonce: &'a [u8; 32],
    /// The prover's own nonce.
    pub prover_nonce: &'a [u8; 32],
}

fn mac(secret: &[u8], t: &Transcript<'_>) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(CONTEXT);
    mac.update(&t.run_id.to_le_bytes());
    mac.update(&t.prover.to_le_bytes());
    mac.update(&t.verifier.to_le_bytes());
    mac.update(t.verifier_nonce);
    mac.update(t.prover_nonce);
    mac
}

/// The proof the prover sends.
pub fn prove(secret: &[u8], t: &Transcript<'_>) -> [u8; 32] {
    mac(secret, t).finalize().into_bytes().into()
}

/// Whether `proof` is the prover's correct proof for `t` (constant-time comparison).
pub fn verify(secret: &[u8], t: &Transcript<'_>, proof: &[u8; 32]) -> bool {
    mac(secret, t).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_transcript() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let t = Transcript {
            run_id: 9,
            prover: 1,
            verifier: 0,
            verifier_nonce: &a,
            prover_nonce: &b,
        };
        let p = prove(b"secret", &t);
        assert!(verify(b"secret", &t, &p));
        assert!(!verify(b"other", &t, &p));
        let reflected = Transcript {
            prover: 0,
            verifier: 1,
            verifier_nonce: &b,
            prover_nonce: &a,
            ..t
        };
        assert!(
            !verify(b"secret", &reflected, &p),
            "a proof cannot be reflected to its sender"
        );
        let other_run = Transcript { run_id: 10, ..t };
        assert!(!verify(b"secret", &other_run, &p));
        let mut flipped = p;
        flipped[0] ^= 1;
        assert!(!verify(b"secret", &t, &flipped));
    }
}
