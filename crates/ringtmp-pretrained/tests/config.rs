//! The architecture read from a `config.json` or a GGUF file's metadata: parameter counts equal
//! to `transformers`' for tiny models of every family (`benches/reference/config_golden.py`),
//! to the shared SmolLM2 file's tensors, and descriptions that are not models refused by key.

mod common;

use ringtmp_pretrained::config::{ChainLayer, Family, ModelConfig, RopeScaling, chain_layer};
use ringtmp_pretrained::gguf::Gguf;

#[test]
fn every_familys_parameters_are_transformers_count() {
    let golden = common::read_json(&common::reference("configs/parameters.json"));
    let mut families = Vec::new();
    for case in golden.as_array().unwrap() {
        let config = ModelConfig::from_hf(std::path::Path::new("config.json"), &case["config"])
            .unwrap_or_else(|e| panic!("{e}: {}", case["config"]));
        assert_eq!(
            config.parameters(),
            case["parameters"].as_u64().unwrap(),
            "{config:?}"
        );
        families.push(config.family);
    }
    assert_eq!(
        families,
        [
            Family::Llama,
            Family::Llama,
            Family::Qwen2,
            Family::Qwen3,
            Family::Gpt2
        ]
    );
    let llama3 =
        ModelConfig::from_hf(std::path::Path::new("config.json"), &golden[0]["config"]).unwrap();
    assert_eq!(
        llama3.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0
        })
    );
    assert_eq!((llama3.heads, llama3.kv_heads, llama3.head_dim), (4, 2, 16));
}

#[test]
fn a_description_that_is_no_model_is_refused_by_key() {
    let path = std::path::Path::new("config.json");
    let refused = |json: serde_json::Value| {
        ModelConfig::from_hf(path, &json)
            .expect_err("refused")
            .to_string()
    };
    let base = || {
        serde_json::json!({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 96,
            "vocab_size": 128})
    };
    assert!(refused(base()).contains("4 heads do not share 3 key/value heads"));
    let mut no_width = base();
    no_width.as_object_mut().unwrap().remove("hidden_size");
    assert!(refused(no_width).contains("no hidden_size"));
    let mut other = base();
    other["model_type"] = "mamba".into();
    assert!(refused(other).contains("model_type \"mamba\""));
    let mut rope = base();
    rope["num_key_value_heads"] = 2.into();
    rope["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    assert!(refused(rope).contains("rope_scaling \"yarn\""));
    let mut negative = base();
    negative["num_attention_heads"] = (-4).into();
    assert!(refused(negative).contains("num_attention_heads is -4"));
}

#[test]
fn the_shared_smollm2_architecture_counts_its_tensors() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let file = Gguf::open(&path).unwrap();
    let config = ModelConfig::from_gguf(&file).unwrap();
    assert_eq!(config.family, Family::Llama);
    assert_eq!(
        (
            config.layers,
            config.width,
            config.heads,
            config.kv_heads,
            config.head_dim,
            config.intermediate,
            config.vocab,
            config.context
        ),
        (30, 576, 9, 3, 64, 1536, 49_152, 8192)
    );
    assert_eq!(config.rope_theta, 100_000.0);
    assert!(config.tie_embeddings, "no output.weight");
    let tensors: u64 = file.tensors.iter().map(|t| t.elements()).sum();
    assert_eq!(config.parameters(), tensors);
    assert_eq!(tensors, 134_515_008);
    // Every tensor has its place in the chain, and each block holds a block's parameters.
    let mut per_layer = std::collections::BTreeMap::new();
    for t in &file.tensors {
        let layer = chain_layer(&t.name).unwrap_or_else(|| panic!("{}", t.name));
        *per_layer.entry(layer).or_insert(0u64) += t.elements();
    }
    assert_eq!(per_layer.len(), 32, "the embedding, 30 blocks, the head");
    assert_eq!(per_layer[&ChainLayer::Embedding], 49_152 * 576);
    assert_eq!(
        per_layer[&ChainLayer::Head],
        576,
        "the final norm; the head is tied"
    );
    for b in 0..30 {
        assert_eq!(
            per_layer[&ChainLayer::Block(b)],
            config.block_parameters(),
            "block {b}"
        );
    }
}

#[test]
fn tensor_names_of_both_conventions_find_their_chain_layer() {
    for (name, layer) in [
        ("model.embed_tokens.weight", Some(ChainLayer::Embedding)),
        (
            "model.layers.12.self_attn.k_proj.bias",
            Some(ChainLayer::Block(12)),
        ),
        (
            "transformer.h.3.attn.c_attn.weight",
            Some(ChainLayer::Block(3)),
        ),
        ("transformer.wpe.weight", Some(ChainLayer::Embedding)),
        ("lm_head.weight", Some(ChainLayer::Head)),
        ("blk.0.ffn_gate.weight", Some(ChainLayer::Block(0))),
        ("output_norm.weight", Some(ChainLayer::Head)),
        ("rope_freqs.weight", Some(ChainLayer::Shared)),
        ("blk.x.ffn_gate.weight", None),
        ("vision_tower.weight", None),
    ] {
        assert_eq!(chain_layer(name), layer, "{name}");
    }
}
