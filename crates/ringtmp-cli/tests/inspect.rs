//! `ringtmp inspect` on the golden Hugging Face directory and on the shared SmolLM2 GGUF file:
//! what it says of each, and a path that is no model refused with exit 2.

use std::path::PathBuf;
use std::process::{Command, Output};

fn ringtmp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn inspect_describes_a_directory_and_refuses_what_is_no_model() {
    let dir = repo().join("benches/reference/hf-tiny");
    let out = ringtmp(&["inspect", dir.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "a Hugging Face model directory, 2 shard(s)",
        "Llama — 1 blocks, width 4, 2 heads (1 key/value heads, head size 2)",
        "parameters: 220",
        "tensors: 4 (1 BF16, 2 F16, 1 F32)",
        // The golden directory holds only a few of the architecture's tensors.
        "note: the tensors hold 84 parameters, where this architecture has 220",
        "tokenizer: 400 tokens, BOS \"<s>\", stops at \"</s>\", \"<|user|>\"; a chat template",
    ] {
        assert!(text.contains(needle), "{needle:?} in\n{text}");
    }
    for bad in ["no-such-model.gguf", "README.md"] {
        let out = ringtmp(&["inspect", repo().join(bad).to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
    }
}

#[test]
fn inspect_describes_the_shared_smollm2_file() {
    let Some(path) = ringtmp_testkit::fixtures::shared_smollm2() else {
        return;
    };
    let out = ringtmp(&["inspect", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for needle in [
        "GGUF version 3",
        "Llama — 30 blocks, width 576, 9 heads (3 key/value heads, head size 64), MLP 1536, \
         vocabulary 49152, context 8192",
        "RoPE base 100000; RMSNorm epsilon 1e-5; head tied to the embedding",
        "parameters: 134515008 (28311552 in the embedding, 3540096 in each of 30 blocks, 576 in \
         the head)",
        "weights 513.1 MiB at f32, 256.6 MiB at bf16; full training with AdamW 2.00 GiB",
        "tensors: 272 (61 F32, 210 Q4_1, 1 Q8_0)",
        "tokenizer: 49152 tokens, BOS \"<|im_start|>\", stops at \"<|im_end|>\"; a chat template",
    ] {
        assert!(text.contains(needle), "{needle:?} in\n{text}");
    }
    assert!(
        !text.contains("note:"),
        "the file holds the whole architecture:\n{text}"
    );
}

#[test]
fn inspect_plans_a_ring_under_a_memory_limit() {
    let dir = repo().join("benches/reference/pretrained/qwen3");
    let out = ringtmp(&[
        "inspect",
        dir.to_str().unwrap(),
        "--nodes",
        "2",
        "--node-memory-limit",
        "600K",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // 106,944 parameters (the untied head its own) split nearly evenly; 16 bytes each to
    // fine-tune is over 600 KiB on either node.
    for needle in [
        "ring of 2 node(s) (layers balanced by parameters; each node 0.6 MiB)",
        "node 0: layers 0..2, 53440 parameters; generate 0.2 MiB, fine-tune 0.8 MiB (over)",
        "node 1: layers 2..5, 53504 parameters",
        "1 node(s) to generate, no ring: one layer alone is more to fine-tune",
    ] {
        assert!(text.contains(needle), "{needle:?} in\n{text}");
    }
    let out = ringtmp(&["inspect", dir.to_str().unwrap(), "--nodes", "9"]);
    assert_eq!(out.status.code(), Some(2), "more nodes than layers");
}
