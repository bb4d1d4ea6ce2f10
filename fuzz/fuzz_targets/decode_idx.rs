//! Any bytes as an IDX file: a decoded array or a typed error naming the offset, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ringtmp_data::idx::decode(data, std::path::Path::new("fuzz.idx"));
});
