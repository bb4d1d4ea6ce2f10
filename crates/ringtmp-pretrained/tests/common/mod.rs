//! What the readers' tests share: the golden files' place, and a golden case's token ids.

#![allow(
    dead_code,
    reason = "each test file includes these helpers and uses its own part of them"
)]

use std::path::{Path, PathBuf};

/// `benches/reference/<name>`.
pub fn reference(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/reference")
        .join(name)
}

/// The JSON file `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Checks that `tokenizer` encodes every `{"text", "ids"}` case of `cases` (special tokens
/// added as the tokenizer adds them) to the case's ids; returns them.
pub fn check_ids(tokenizer: &tokenizers::Tokenizer, cases: &serde_json::Value) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| u32::try_from(v.as_u64().unwrap()).unwrap())
            .collect();
        let encoding = tokenizer.encode(text, true).unwrap();
        assert_eq!(encoding.get_ids(), expected.as_slice(), "{text:?}");
        all.push(expected);
    }
    all
}

/// The shared SmolLM2-135M-Instruct file (`../shared/models`), when present; required under CI
/// (`RINGTMP_REQUIRE_SHARED_MODEL`).
pub fn smollm2() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("RINGTMP_REQUIRE_SHARED_MODEL").is_none(),
        "RINGTMP_REQUIRE_SHARED_MODEL is set but {} is absent",
        path.display()
    );
    eprintln!("SKIPPED: {} is absent", path.display());
    None
}
