//! The Hugging Face directory reader against `benches/reference/hf-tiny` (written by
//! `benches/reference/hf_golden.py`): two shards, f32, f16 and bf16 tensors, every value equal
//! to the f32 the golden file holds; a directory that lies about its shards refused by name.

use std::path::{Path, PathBuf};

mod common;

use ringtmp_pretrained::hf::{HfError, HfModel};
use safetensors::{Dtype, SafeTensors};

fn golden() -> PathBuf {
    common::reference("hf-tiny")
}

#[test]
fn a_sharded_directory_reads_every_tensor_as_the_f32_it_holds() {
    let model = HfModel::open(&golden()).expect("the golden directory opens");
    assert_eq!(model.config["model_type"], "llama");
    assert_eq!(model.config["num_key_value_heads"], 1);
    assert_eq!(model.shards.len(), 2);
    let dtypes: Vec<(&str, Dtype)> = model
        .tensors
        .iter()
        .map(|(n, t)| (n.as_str(), t.dtype))
        .collect();
    assert_eq!(
        dtypes,
        [
            ("lm_head.weight", Dtype::BF16),
            ("model.embed_tokens.weight", Dtype::F32),
            ("model.layers.0.self_attn.q_proj.weight", Dtype::F16),
            ("model.norm.weight", Dtype::F16),
        ]
    );
    assert_eq!(model.tensors["lm_head.weight"].shape, [8, 4]);
    let bytes = std::fs::read(golden().join("expected.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in expected.tensors() {
        let want: Vec<u32> = view
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got: Vec<u32> = model
            .tensor_f32(&name)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "{name}");
    }
    let e = model.tensor_f32("nope").unwrap_err().to_string();
    assert!(e.contains("no tensor \"nope\""), "{e}");
}

/// A copy of the golden directory with `edit` applied.
fn edited(edit: impl FnOnce(&Path)) -> (tempfile::TempDir, Result<HfModel, HfError>) {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(golden()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    edit(tmp.path());
    let opened = HfModel::open(tmp.path());
    (tmp, opened)
}

fn refused(edit: impl FnOnce(&Path)) -> String {
    match edited(edit).1 {
        Ok(_) => panic!("opened"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_directory_that_lies_about_its_shards_is_refused_by_name() {
    let index = |dir: &Path| dir.join("model.safetensors.index.json");
    let rewrite = |dir: &Path, from: &str, to: &str| {
        let text = std::fs::read_to_string(index(dir)).unwrap();
        std::fs::write(index(dir), text.replacen(from, to, 1)).unwrap();
    };
    // A shard outside the directory.
    let e = refused(|d| rewrite(d, "\"model-00002-of-00002", "\"../model-00002-of-00002"));
    assert!(e.contains("not a file of this directory"), "{e}");
    // A tensor the index puts in the wrong shard.
    let e = refused(|d| {
        rewrite(
            d,
            "\"lm_head.weight\": \"model-00002-of-00002",
            "\"lm_head.weight\": \"model-00001-of-00002",
        )
    });
    assert!(
        e.contains("\"lm_head.weight\" is not in model-00001"),
        "{e}"
    );
    // A shard missing, cut short, or not safetensors at all.
    let e = refused(|d| std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap());
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
    let e = refused(|d| {
        let path = d.join("model-00001-of-00002.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    });
    assert!(e.contains("not a safetensors file"), "{e}");
    let e = refused(|d| std::fs::write(d.join("model-00001-of-00002.safetensors"), b"{}").unwrap());
    assert!(e.contains("not a safetensors file"), "{e}");
    // No weights, or a config that is not JSON.
    let e = refused(|d| std::fs::remove_file(index(d)).unwrap());
    assert!(e.contains("no model.safetensors"), "{e}");
    let e = refused(|d| std::fs::write(d.join("config.json"), "{ not json").unwrap());
    assert!(e.contains("config.json: not JSON"), "{e}");
}

#[test]
fn a_directorys_tokenizer_gives_transformers_ids_and_its_template_and_stop_tokens() {
    let model = HfModel::open(&golden()).unwrap();
    let vocabulary = model.vocabulary().expect("the tokenizer reads");
    assert_eq!(vocabulary.bos, Some(1));
    assert_eq!(vocabulary.stop, [2, 3], "generation_config's list");
    let golden = common::read_json(&golden().join("tokens.json"));
    common::check_ids(&vocabulary.tokenizer, &golden["cases"]);
    let template = ringtmp_pretrained::template::ChatTemplate::new(
        vocabulary
            .chat_template
            .as_deref()
            .expect("chat_template.jinja"),
        "<s>",
        "</s>",
    )
    .unwrap();
    let messages: Vec<ringtmp_pretrained::template::ChatMessage> =
        serde_json::from_value(golden["chat"]["messages"].clone()).unwrap();
    assert_eq!(
        template
            .render(&messages, true, &serde_json::Map::new())
            .unwrap(),
        golden["chat"]["rendered"].as_str().unwrap()
    );
}
