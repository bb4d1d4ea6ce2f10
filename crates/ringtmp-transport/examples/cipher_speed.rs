//! The record ciphers alone, on one core: how fast a private link's records are sealed and
//! opened, by the implementation links use (AWS-LC, through `RecordKey`) and by `ring` (what
//! `snow`'s own transport runs), for both ciphers. Records of 65,519 bytes of plaintext, as a
//! link's writer makes them; opening closes the plaintext up over the record's 4-byte header, as
//! a link's reader does where records land.
//!
//!     cargo run --release -p ringtmp-transport --example cipher_speed
//!
//! Prints MB of plaintext per second, the median of 5 repeats of 2 GB each.

use std::time::Instant;

use ringtmp_transport::secure::{Cipher, MAX_PLAIN, RecordKey, TAG};

const REPEATS: usize = 5;
const RECORDS: u64 = 32_768;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// MB/s of `f` run `RECORDS` times, median over the repeats.
fn rate(mut f: impl FnMut(u64)) -> f64 {
    median(
        (0..REPEATS)
            .map(|_| {
                let started = Instant::now();
                for n in 0..RECORDS {
                    f(n);
                }
                (RECORDS as usize * MAX_PLAIN) as f64 / started.elapsed().as_secs_f64() / 1e6
            })
            .collect(),
    )
}

fn aws_lc(cipher: Cipher) -> (f64, f64) {
    let key = RecordKey::new(cipher, &[7; 32]);
    let mut record = vec![1u8; 4 + MAX_PLAIN + TAG];
    let seal = rate(|n| {
        std::hint::black_box(key.seal(n, &mut record[4..4 + MAX_PLAIN]));
    });
    let tag = key.seal(0, &mut record[4..4 + MAX_PLAIN]);
    record[4 + MAX_PLAIN..].copy_from_slice(&tag);
    let sealed = record.clone();
    // Each opening restores the sealed record first (a copy of 64 KiB in cache, about a tenth of
    // the time measured); record 0 every time, as it was sealed.
    let open = rate(|_| {
        record.copy_from_slice(&sealed);
        key.open(0, &mut record, 4).expect("opens");
    });
    (seal, open)
}

fn ring(cipher: Cipher) -> (f64, f64) {
    use ring::aead::{AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
    let algorithm = match cipher {
        Cipher::AesGcm => &AES_256_GCM,
        Cipher::ChaChaPoly => &CHACHA20_POLY1305,
    };
    let key = LessSafeKey::new(UnboundKey::new(algorithm, &[7; 32]).expect("key"));
    let nonce = |n: u64| {
        let mut bytes = [0u8; 12];
        bytes[4..].copy_from_slice(&n.to_be_bytes());
        Nonce::assume_unique_for_key(bytes)
    };
    let mut record = vec![1u8; 4 + MAX_PLAIN];
    let seal = rate(|n| {
        let tag = key
            .seal_in_place_separate_tag(nonce(n), Aad::empty(), &mut record[4..])
            .expect("seals");
        let _ = std::hint::black_box(tag);
    });
    let tag = key
        .seal_in_place_separate_tag(nonce(0), Aad::empty(), &mut record[4..])
        .expect("seals");
    let sealed = record.clone();
    let open = rate(|_| {
        record.copy_from_slice(&sealed);
        key.open_in_place_separate_tag(nonce(0), Aad::empty(), tag, &mut record, 4..)
            .expect("opens");
    });
    (seal, open)
}

fn main() {
    println!(
        "one core, records of {MAX_PLAIN} bytes, MB/s of plaintext (median of {REPEATS}); this \
         CPU {} AES instructions",
        if Cipher::aes_is_fast_here() {
            "has"
        } else {
            "lacks"
        }
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9}",
        "", "AWS-LC", "", "ring", ""
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9}",
        "cipher", "seal", "open", "seal", "open"
    );
    for cipher in [Cipher::AesGcm, Cipher::ChaChaPoly] {
        let (seal, open) = aws_lc(cipher);
        let (ring_seal, ring_open) = ring(cipher);
        println!(
            "{:<20} {seal:>9.0} {open:>9.0} {ring_seal:>9.0} {ring_open:>9.0}",
            cipher.name()
        );
    }
}
