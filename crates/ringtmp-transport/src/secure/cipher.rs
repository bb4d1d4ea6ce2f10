//! The two ciphers a private link may be sealed with, and a session's keys: one per direction,
//! each sealing or opening the records of its direction in place, numbered 0, 1, 2, … with the
//! nonce layout of the Noise Protocol Framework, so a record is a Noise transport message (the
//! secure module's tests check this against `snow`'s own transport, both ways).
//!
//! Invariant: a key seals (or opens) each record number once. The counters live with the link's
//! writer and reader ([`super::records`]), one each, both starting at 0 for a session.

use aws_lc_rs::aead::{AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};

/// Authentication tag per record.
pub const TAG: usize = 16;

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
    /// the AES libraries fall back to constant-time code several times slower than ChaCha.
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

/// One direction's key. Records are sealed and opened in place by AWS-LC (`aws-lc-rs`), with no
/// associated data, as Noise's transport messages are. AWS-LC picks its assembly per CPU at run
/// time, and where the CPU has AVX-512 with vector AES (Zen 4 and 5, Intel since Ice Lake) its
/// AES-256-GCM runs on 512-bit registers: on one Zen 5 core 21.8–23.9 GB/s sealing and
/// 16.5–18.0 opening 64 KiB records, against 10.3–10.8 and 10.4–10.7 for `ring`'s 256-bit code
/// (`cargo run --release -p ringtmp-transport --example cipher_speed`). With `ring`'s, the
/// cipher took a sixth of a private all-reduce's CPU (docs/benchmarks/logs/issue-45.md).
pub struct RecordKey {
    key: LessSafeKey,
    cipher: Cipher,
}

impl RecordKey {
    /// The key `bytes` (a Noise split's output) for `cipher`.
    pub fn new(cipher: Cipher, bytes: &[u8; 32]) -> Self {
        let algorithm = match cipher {
            Cipher::AesGcm => &AES_256_GCM,
            Cipher::ChaChaPoly => &CHACHA20_POLY1305,
        };
        let key = UnboundKey::new(algorithm, bytes).expect("a 32-byte key fits both ciphers");
        Self {
            key: LessSafeKey::new(key),
            cipher,
        }
    }

    /// Noise's nonce for record `n`: four zero bytes, then the counter, big-endian for AES-GCM
    /// and little-endian for ChaCha20-Poly1305 (the Noise specification, section 12).
    fn nonce(&self, n: u64) -> Nonce {
        let mut bytes = [0u8; 12];
        bytes[4..].copy_from_slice(&match self.cipher {
            Cipher::AesGcm => n.to_be_bytes(),
            Cipher::ChaChaPoly => n.to_le_bytes(),
        });
        Nonce::assume_unique_for_key(bytes)
    }

    /// Encrypts record `n`'s plaintext in place; returns its tag.
    pub fn seal(&self, n: u64, data: &mut [u8]) -> [u8; TAG] {
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(n), Aad::empty(), data)
            .expect("a record is far below the ciphers' limits");
        tag.as_ref()
            .try_into()
            .expect("both ciphers' tags are 16 bytes")
    }

    /// Opens record `n`, whose ciphertext and tag are `in_out[at..]`, into the front of
    /// `in_out`; returns the plaintext's length. `Err` (the bytes then undefined, to be dropped)
    /// for a record that was not sealed with this key and number, or was altered. With `at` > 0
    /// the plaintext closes up over what lay before it (a reader that opens records where they
    /// landed, over their headers and the tags before them).
    pub fn open(&self, n: u64, in_out: &mut [u8], at: usize) -> Result<usize, Forged> {
        self.key
            .open_within(self.nonce(n), Aad::empty(), in_out, at..)
            .map(|plain| plain.len())
            .map_err(|_| Forged)
    }
}

/// A record failed authentication.
#[derive(Debug)]
pub struct Forged;

/// An established session: the two directions' keys, shared by a link's reader and writer
/// (each keeps its own record counter).
pub struct SessionKeys {
    /// Seals what this side sends.
    pub(crate) send: RecordKey,
    /// Opens what it receives.
    pub(crate) receive: RecordKey,
}

/// A session, shared by a link's reader and writer.
pub type Session = std::sync::Arc<SessionKeys>;
