//! Any bytes from a peer: the frame decoder must return a frame, "incomplete" or an error — never
//! panic, never allocate beyond its limits — and what it accepts must re-encode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringtmp_wire::{Limits, decode, encode};

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_payload_bytes: 1 << 20, max_elements: 1 << 18, ..Limits::default() };
    let mut rest = data;
    while let Ok(Some((message, used))) = decode(rest, &limits) {
        let mut again = Vec::new();
        encode(&message, &mut again);
        assert_eq!(decode(&again, &limits).unwrap().unwrap().0, message);
        rest = &rest[used..];
    }
});
