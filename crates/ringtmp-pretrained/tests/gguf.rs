//! The GGUF reader against files the `gguf` package wrote: every metadata type read back,
//! every tensor type dequantised to the package's values bit for bit
//! (`benches/reference/gguf_golden.py`), a bad file refused with the offset, never a panic,
//! and the shared SmolLM2 file read as `transformers` reads it.

use std::path::PathBuf;

mod common;

use ringtmp_pretrained::gguf::{
    Gguf, GgufError, GgufWriter, TensorType, Value, tokenizer_metadata,
};
use ringtmp_pretrained::vocabulary::Vocabulary;

fn golden() -> PathBuf {
    common::reference("gguf/quants.gguf")
}

#[test]
fn every_metadata_type_reads_back() {
    let file = Gguf::open(&golden()).expect("the golden file opens");
    assert_eq!(file.version, 3);
    let get = |k: &str| file.get(k).cloned().unwrap_or_else(|| panic!("{k}"));
    assert_eq!(get("test.u8"), Value::U8(200));
    assert_eq!(get("test.i8"), Value::I8(-100));
    assert_eq!(get("test.u16"), Value::U16(60000));
    assert_eq!(get("test.i16"), Value::I16(-30000));
    assert_eq!(get("test.u32"), Value::U32(4_000_000_000));
    assert_eq!(get("test.i32"), Value::I32(-2_000_000_000));
    assert_eq!(get("test.f32"), Value::F32(0.15625));
    assert_eq!(get("test.u64"), Value::U64((1 << 63) + 5));
    assert_eq!(get("test.i64"), Value::I64(-(1 << 62)));
    assert_eq!(get("test.f64"), Value::F64(-2.5e-300));
    assert_eq!(get("test.bool"), Value::Bool(true));
    assert_eq!(get("test.string"), Value::String("grüße, 世界".into()));
    assert_eq!(
        get("test.strings"),
        Value::Array(vec![
            Value::String("a".into()),
            Value::String(String::new()),
            Value::String("ccc".into())
        ])
    );
    let ints: Vec<i64> = match get("test.ints") {
        Value::Array(items) => items
            .iter()
            .map(|v| match v {
                Value::I32(i) => i64::from(*i),
                Value::I64(i) => *i,
                other => panic!("{other:?}"),
            })
            .collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(ints, [1, -2, 3]);
    assert_eq!(get("general.architecture").as_str(), Some("ringtmp-test"));
}

#[test]
fn every_tensor_type_dequantises_to_the_gguf_packages_values_bit_for_bit() {
    let file = Gguf::open(&golden()).expect("the golden file opens");
    let types = [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
        "Q8_K",
    ];
    for name in types {
        let quantised = file.tensor(&format!("q.{name}")).unwrap();
        assert_eq!(quantised.kind.name(), name);
        assert_eq!(
            quantised.dims,
            [512, 2],
            "{name}: GGUF's innermost-first order"
        );
        let got = file.dequantize(&format!("q.{name}")).unwrap();
        let expected = file.dequantize(&format!("expected.{name}")).unwrap();
        assert_eq!(got.len(), 1024, "{name}");
        let differ = got
            .iter()
            .zip(&expected)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{name}: {differ} of 1024 values differ from gguf's"
        );
        println!("{name}: 1024 values equal to gguf.quants.dequantize's, bit for bit");
    }
}

/// Writes `bytes` to a file and opens it.
fn open_bytes(bytes: &[u8]) -> Result<Gguf, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    Gguf::open(&path)
}

#[test]
fn a_truncated_or_corrupt_file_is_an_error_naming_the_offset_never_a_panic() {
    let bytes = std::fs::read(golden()).unwrap();
    let file = Gguf::open(&golden()).unwrap();
    let data_start = file.tensors.iter().map(|t| t.offset).min().unwrap() as usize;
    // Every cut through the header, metadata and table, and a few through the data.
    let cuts = (0..data_start.min(4096)).chain([data_start + 1, bytes.len() - 1]);
    for cut in cuts {
        match open_bytes(&bytes[..cut]) {
            Err(GgufError::Malformed { offset, .. }) => assert!(offset <= cut as u64),
            Err(other) => panic!("cut at {cut}: {other}"),
            Ok(_) => panic!("a file cut at {cut} of {} opened", bytes.len()),
        }
    }
    // A tensor count no file could hold: refused before anything is allocated for it.
    let mut huge = bytes.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = open_bytes(&huge).err().expect("refused").to_string();
    assert!(e.contains("at byte 8") && e.contains("tensor count"), "{e}");
    // Not GGUF at all, and a version this reader does not know.
    let e = open_bytes(b"PK\x03\x04 not a model")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    let mut v9 = bytes.clone();
    v9[4..8].copy_from_slice(&9u32.to_le_bytes());
    let e = open_bytes(&v9).err().unwrap().to_string();
    assert!(e.contains("version 9"), "{e}");
}

#[test]
fn random_bytes_after_a_valid_header_never_panic() {
    // A deterministic stream of corruptions: every byte of the header, metadata and tensor
    // table set to a few values in turn.
    let bytes = std::fs::read(golden()).unwrap();
    let file = Gguf::open(&golden()).unwrap();
    let data_start = file.tensors.iter().map(|t| t.offset).min().unwrap() as usize;
    for at in 8..data_start {
        for v in [0x00, 0xFF, 0x7F] {
            let mut b = bytes.clone();
            b[at] = v;
            if let Ok(file) = open_bytes(&b) {
                for t in &file.tensors {
                    let _ = file.dequantize(&t.name);
                }
            }
        }
    }
}

/// The sum of the values' bit patterns: equal only if the values are (as the `gguf` package
/// dequantised them when this test was written; the figures are its).
fn fingerprint(values: &[f32]) -> u64 {
    values.iter().map(|v| u64::from(v.to_bits())).sum()
}

#[test]
fn the_shared_smollm2_file_reads_as_the_gguf_package_reads_it() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let file = Gguf::open(&path).expect("the shared model opens");
    let meta = |k: &str| file.get(k).unwrap_or_else(|| panic!("{k}")).clone();
    assert_eq!(meta("general.architecture").as_str(), Some("llama"));
    assert_eq!(meta("llama.block_count").as_u64(), Some(30));
    assert_eq!(meta("llama.embedding_length").as_u64(), Some(576));
    assert_eq!(meta("llama.attention.head_count").as_u64(), Some(9));
    assert_eq!(meta("llama.attention.head_count_kv").as_u64(), Some(3));
    assert_eq!(meta("llama.feed_forward_length").as_u64(), Some(1536));
    assert_eq!(meta("llama.rope.freq_base").as_f64(), Some(100_000.0));
    assert_eq!(meta("tokenizer.ggml.model").as_str(), Some("gpt2"));
    let Value::Array(tokens) = meta("tokenizer.ggml.tokens") else {
        panic!("the vocabulary")
    };
    assert_eq!(tokens.len(), 49_152);
    assert_eq!(file.tensors.len(), 272);
    let count = |kind: TensorType| file.tensors.iter().filter(|t| t.kind == kind).count();
    assert_eq!(
        (
            count(TensorType::Q4_1),
            count(TensorType::Q8_0),
            count(TensorType::F32)
        ),
        (210, 1, 61)
    );
    let params: u64 = file.tensors.iter().map(|t| t.elements()).sum();
    assert_eq!(params, 134_515_008);
    for (name, first, print) in [
        ("token_embd.weight", 0xbdda_3400, 0x00d0_2dd6_6b05_96c0_u64),
        ("blk.0.attn_q.weight", 0xbdc5_4000, 0x0002_7be4_c063_c200),
        ("blk.29.ffn_down.weight", 0xbe8b_f000, 0x0006_a059_0436_9200),
        ("output_norm.weight", 0x3fe1_0000, 0x0000_0090_c682_0000),
    ] {
        let values = file.dequantize(name).unwrap();
        assert_eq!(values[0].to_bits(), first, "{name}");
        assert_eq!(fingerprint(&values), print, "{name}");
    }
}

#[test]
fn the_shared_smollm2_tokenizer_gives_transformers_ids() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let file = Gguf::open(&path).expect("the shared model opens");
    let vocabulary = file.vocabulary().expect("its tokenizer builds");
    assert_eq!(
        (vocabulary.bos, vocabulary.stop.as_slice()),
        (Some(1), &[2][..])
    );
    assert!(!vocabulary.add_bos);
    let template = vocabulary
        .chat_template
        .as_deref()
        .expect("a chat template");
    assert!(template.contains("<|im_start|>"), "{template}");
    let golden = common::read_json(&common::reference("gguf/smollm2-tokens.json"));
    let ids = common::check_ids(&vocabulary.tokenizer, &golden["cases"]);
    for (case, ids) in golden["cases"].as_array().unwrap().iter().zip(ids) {
        let decoded = vocabulary.tokenizer.decode(&ids, false).unwrap();
        assert_eq!(decoded, case["decoded"].as_str().unwrap());
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, no merges: they follow from
/// the pieces' scores) gives `transformers`' ids — BOS first, control and user-defined tokens
/// whole, bytes the vocabulary lacks as byte pieces — and decodes as it does.
#[test]
fn a_sentencepiece_tokenizer_gives_transformers_ids() {
    let file = Gguf::open(&common::reference("gguf/spm-tokenizer.gguf")).unwrap();
    let vocabulary = file.vocabulary().expect("its tokenizer builds");
    let golden = common::read_json(&common::reference("gguf/spm-tokens.json"));
    assert_eq!(
        vocabulary.tokenizer.get_vocab_size(true) as u64,
        golden["vocab_size"].as_u64().unwrap()
    );
    assert!(vocabulary.add_bos, "llama.cpp's and transformers' default");
    let bos = vocabulary.bos.expect("a BOS");
    for case in golden["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let mut ids = vocabulary
            .tokenizer
            .encode(text, true)
            .unwrap()
            .get_ids()
            .to_vec();
        ids.insert(0, bos);
        assert_eq!(ids, want, "{text:?}");
        let decoded = vocabulary.tokenizer.decode(&ids, false).unwrap();
        assert_eq!(decoded, case["decoded"].as_str().unwrap(), "{text:?}");
    }
}

#[test]
fn the_shared_smollm2_tokenizer_writes_the_files_own_lists() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let file = Gguf::open(&path).unwrap();
    let vocabulary = file.vocabulary().unwrap();
    let rows = vocabulary.tokenizer.get_vocab_size(true);
    let written: std::collections::BTreeMap<String, Value> = tokenizer_metadata(&vocabulary, rows)
        .unwrap()
        .into_iter()
        .collect();
    for key in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
    ] {
        assert!(written[key] == file.metadata[key], "{key}");
    }
    // Written into a file and read back: the same ids.
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .unwrap();
    for (k, v) in written {
        w.metadata(&k, v).unwrap();
    }
    let back = dir.path().join("t.gguf");
    w.write(&back).unwrap();
    let back = Gguf::open(&back).unwrap().vocabulary().unwrap();
    let text = "Hello, world! Grüße aus Köln — 東京は晴れ 12345 <|im_start|>user\nnaïve 🙂";
    let ids = |v: &Vocabulary| v.tokenizer.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(ids(&back), ids(&vocabulary));
}

#[test]
fn a_file_opened_for_its_weights_skips_the_tokenizer_and_keeps_the_rest() {
    let path = common::reference("gguf/spm-tokenizer.gguf");
    let (whole, weights) = (
        Gguf::open(&path).unwrap(),
        Gguf::open_weights(&path).unwrap(),
    );
    let tokens = whole
        .array_len("tokenizer.ggml.tokens")
        .expect("its tokens");
    assert!(tokens > 100, "{tokens} tokens");
    assert_eq!(weights.array_len("tokenizer.ggml.tokens"), Some(tokens));
    assert!(weights.get("tokenizer.ggml.tokens").is_none());
    assert!(weights.weights_only() && !whole.weights_only());
    for (key, value) in &whole.metadata {
        let skipped = key.starts_with("tokenizer.") && matches!(value, Value::Array(_));
        assert_eq!(weights.get(key).is_none(), skipped, "{key}");
    }
    assert_eq!(whole.tensors, weights.tensors);
    let Err(refused) = weights.vocabulary() else {
        panic!("a tokenizer from a file opened for its weights")
    };
    let refused = refused.to_string();
    assert!(refused.contains("weights alone"), "{refused}");
}

#[test]
fn writing_quantises_as_the_gguf_package_and_reads_back() {
    use ringtmp_pretrained::gguf::{GgufWriter, quantize};
    let golden = Gguf::open(&golden()).unwrap();
    let values = golden.dequantize("q.F32").unwrap();
    for (kind, name) in [
        (TensorType::F16, "q.F16"),
        (TensorType::Bf16, "q.BF16"),
        (TensorType::Q8_0, "q.Q8_0"),
    ] {
        let ours = quantize(kind, &values).unwrap();
        let theirs = golden.raw(golden.tensor(name).unwrap());
        assert!(
            ours == theirs,
            "{name}: our bytes differ from gguf.quants.quantize's"
        );
    }
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.metadata("test.f64", Value::F64(-0.5)).unwrap();
    w.metadata("test.bool", Value::Bool(false)).unwrap();
    w.metadata("test.ids", Value::Array(vec![Value::U32(7), Value::U32(9)]))
        .unwrap();
    assert!(
        w.metadata(
            "test.mixed",
            Value::Array(vec![Value::U32(1), Value::I8(2)])
        )
        .is_err()
    );
    for (name, kind) in [
        ("a", TensorType::F32),
        ("b", TensorType::F16),
        ("c", TensorType::Bf16),
        ("d", TensorType::Q8_0),
    ] {
        w.tensor(name, &[512, 2], kind, &values).unwrap();
    }
    assert!(
        w.tensor("e", &[31, 2], TensorType::Q8_0, &values[..62])
            .is_err()
    );
    assert!(w.tensor("f", &[512, 2], TensorType::Q4K, &values).is_err());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("written.gguf");
    w.write(&path).unwrap();
    let back = Gguf::open(&path).expect("our file reads back");
    assert_eq!(back.version, 3);
    assert_eq!(back.get("test.f64"), Some(&Value::F64(-0.5)));
    assert_eq!(back.get("test.bool"), Some(&Value::Bool(false)));
    assert_eq!(
        back.get("test.ids"),
        Some(&Value::Array(vec![Value::U32(7), Value::U32(9)]))
    );
    for (name, expected) in [
        ("a", "q.F32"),
        ("b", "q.F16"),
        ("c", "q.BF16"),
        ("d", "q.Q8_0"),
    ] {
        let t = back.tensor(name).unwrap();
        assert_eq!(t.dims, [512, 2]);
        assert_eq!(t.offset % 32, 0, "{name} aligned");
        let got: Vec<u32> = back
            .dequantize(name)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let want: Vec<u32> = golden
            .dequantize(expected)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "{name}");
    }
}
