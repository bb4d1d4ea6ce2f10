//! Pretrained models through the commands: `predict --pretrained` writes `transformers`'
//! logits, `generate --pretrained --chat` answers the shared SmolLM2 file's known question in
//! one process and split over nodes, and every bad model or request is one line and exit 2.

use std::path::{Path, PathBuf};
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

fn tiny(name: &str) -> PathBuf {
    repo().join("benches/reference/pretrained").join(name)
}

/// Every tensor of a safetensors file as f32 values.
fn golden(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn predict_writes_transformers_logits_for_every_position() {
    let dir = tiny("qwen3");
    let g = golden(&dir.join("golden.safetensors"));
    let ids: Vec<u16> = g["input_ids"][..12].iter().map(|v| *v as u16).collect();
    let tmp = tempfile::tempdir().unwrap();
    let got = predicted(&dir, &ids, &tmp.path().join("logits.npy"));
    assert_eq!(got.len(), 12 * 160, "[12, 160]");
    let worst = got
        .iter()
        .zip(&g["logits"][..12 * 160])
        .map(|(a, b)| (*a as f32 - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn generate_answers_a_chat_as_transformers_does_whole_and_split() {
    let Some(model) = ringtmp_testkit::fixtures::shared_smollm2() else {
        return;
    };
    let question = "What is the capital of France?";
    for nodes in ["1", "2"] {
        let out = ringtmp(&[
            "generate",
            "--pretrained",
            model.to_str().unwrap(),
            "--chat",
            question,
            "--tokens",
            "24",
            "--nodes",
            nodes,
        ]);
        assert!(out.status.success(), "{}", said(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        // transformers' greedy answer, its end of turn not printed.
        assert_eq!(
            text.trim(),
            "The capital of France is Paris.",
            "--nodes {nodes}"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("37 prompt tokens, 7 generated"), "{stderr}");
    }
}

#[test]
fn bad_models_and_requests_are_one_line_and_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let unknown = tmp.path().join("mamba");
    std::fs::create_dir(&unknown).unwrap();
    std::fs::write(unknown.join("config.json"), r#"{"model_type": "mamba"}"#).unwrap();
    std::fs::copy(
        tiny("qwen2").join("model.safetensors"),
        unknown.join("model.safetensors"),
    )
    .unwrap();
    let truncated = tmp.path().join("truncated.gguf");
    let gguf = repo().join("benches/reference/gguf/quants.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let qwen2 = tiny("qwen2");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "generate",
                "--pretrained",
                "no-such-model.gguf",
                "--chat",
                "hi",
            ],
            "no such file",
        ),
        (
            vec![
                "generate",
                "--pretrained",
                unknown.to_str().unwrap(),
                "--chat",
                "hi",
            ],
            "\"mamba\"",
        ),
        (
            vec![
                "generate",
                "--pretrained",
                truncated.to_str().unwrap(),
                "--chat",
                "hi",
            ],
            "truncated.gguf",
        ),
        // The tiny models ship no tokenizer: --chat needs one.
        (
            vec![
                "generate",
                "--pretrained",
                qwen2.to_str().unwrap(),
                "--chat",
                "hi",
            ],
            "tokenizer",
        ),
        (
            vec![
                "predict",
                "--pretrained",
                qwen2.to_str().unwrap(),
                "--prompt-ids",
                "1,999",
                "--logits",
                "x.npy",
            ],
            "id 999 is past the model's vocabulary of 160",
        ),
        (
            vec![
                "generate",
                "--pretrained",
                qwen2.to_str().unwrap(),
                "--prompt-ids",
                "1,2",
                "--top-p",
                "0",
            ],
            "--top-p 0",
        ),
    ];
    for (args, needle) in cases {
        let out = ringtmp(&args);
        let text = said(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(needle), "{args:?}: {needle:?} in {text}");
        assert_eq!(text.trim().lines().count(), 1, "{args:?}: one line: {text}");
    }
}

/// `ringtmp train --pretrained MODEL --dataset text` on the files `data` in windows of 16, into
/// `out`, with `extra` options.
fn train_on(model: &Path, data: &[&Path], out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "--pretrained",
        model.to_str().unwrap(),
        "--dataset",
        "text",
        "--seq-len",
        "16",
        "--out",
        out.to_str().unwrap(),
        "--data-file",
    ];
    args.extend(data.iter().map(|d| d.to_str().unwrap()));
    args.extend(extra);
    ringtmp(&args)
}

/// [`train_on`] token files of a 160-id vocabulary.
fn train_on_ids(model: &Path, data: &[&Path], out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["--vocab-size", "160"];
    args.extend(extra);
    train_on(model, data, out, &args)
}

/// Fine-tunes `model` in one process on `text` repeated `times` (written into `dir`, read by
/// the model's own tokenizer), with `extra` options; the run's directory (its success
/// asserted).
fn train_on_text(model: &Path, dir: &Path, text: &str, times: usize, extra: &[&str]) -> PathBuf {
    let (file, run) = (dir.join("text.txt"), dir.join("run"));
    std::fs::write(&file, text.repeat(times)).unwrap();
    let mut args = vec!["--strategy", "local"];
    args.extend(extra);
    let out = train_on(model, &[&file], &run, &args);
    assert!(out.status.success(), "{}", said(&out));
    run
}

/// The losses of `metrics.jsonl`'s steps.
fn step_losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["event"] == "step")
        .map(|e| e["loss"].as_f64().unwrap())
        .collect()
}

/// Full fine-tuning of a pretrained model (the tiny Llama with grouped-query attention, on
/// token ids): the ring's two nodes, each reading its own layers from the model's files, take
/// `local`'s steps, and the model learns its repeating text.
#[test]
fn fine_tuning_a_pretrained_model_on_the_ring_takes_locals_steps() {
    let tmp = tempfile::tempdir().unwrap();
    // A pattern of 50 ids repeated: a model that learns it predicts well.
    let pattern: Vec<u16> = (0..50u16).map(|i| (i * 37 + 11) % 160).collect();
    let ids: Vec<u8> = pattern
        .iter()
        .cycle()
        .take(20_000)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let (train, val) = (tmp.path().join("train.bin"), tmp.path().join("val.bin"));
    std::fs::write(&train, &ids).unwrap();
    std::fs::write(&val, &ids[..4000]).unwrap();
    let model = tiny("llama-gqa");
    let run = |strategy: &str, nodes: &str| {
        let out = tmp.path().join(strategy);
        let output = train_on_ids(
            &model,
            &[&train, &val],
            &out,
            &[
                "--strategy",
                strategy,
                "--nodes",
                nodes,
                "--batch-size",
                "4",
                "--train-samples",
                "120",
                "--lr",
                "3e-3",
                "--warmup-steps",
                "0",
            ],
        );
        assert!(output.status.success(), "{strategy}: {}", said(&output));
        step_losses(&out)
    };
    let local = run("local", "1");
    let ring = run("ring", "2");
    assert_eq!(local.len(), 30);
    for (step, (a, b)) in local.iter().zip(&ring).enumerate() {
        assert!((a - b).abs() < 1e-4, "step {step}: local {a}, ring {b}");
    }
    let (first, last) = (local[0], local[local.len() - 1]);
    assert!(last < 0.5 * first, "learns the pattern: {first} → {last}");
    // The ring's checkpoint as a Hugging Face directory: read back as a pretrained model, it
    // gives the checkpoint's logits.
    let exported = tmp.path().join("hf");
    let out = ringtmp(&[
        "export",
        "--checkpoint",
        tmp.path().join("ring").to_str().unwrap(),
        "--to",
        "hf",
        exported.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", said(&out));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["rope_scaling"]["rope_type"], "llama3");
    let got = predicted(&exported, &pattern[..16], &tmp.path().join("logits.npy"));
    let dir = ringtmp_model::checkpoint::resolve(&tmp.path().join("ring")).unwrap();
    let manifest = ringtmp_model::checkpoint::read_manifest(&dir).unwrap();
    let layers = manifest
        .model
        .build_for(
            &ringtmp_model::Shape::flat(16),
            &ringtmp_model::Shape(vec![16, 160]),
        )
        .unwrap();
    let mut stage = ringtmp_model::Stage::new(&layers, 0..layers.len(), 0, 1);
    ringtmp_model::checkpoint::read_params(&dir, &manifest, &mut stage).unwrap();
    let x: Vec<f32> = pattern[..16].iter().map(|&v| f32::from(v)).collect();
    let want = stage.infer(&x, 1).unwrap();
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f32 - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "{worst}");
}

/// The logits `predict --pretrained MODEL` writes for `ids`.
fn predicted(model: &Path, ids: &[u16], npy: &Path) -> Vec<f64> {
    let window: Vec<String> = ids.iter().map(u16::to_string).collect();
    let out = ringtmp(&[
        "predict",
        "--pretrained",
        model.to_str().unwrap(),
        "--prompt-ids",
        &window.join(","),
        "--logits",
        npy.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", said(&out));
    let bytes = std::fs::read(npy).unwrap();
    let header = ringtmp_data::npy::parse_header(npy, &bytes).unwrap();
    ringtmp_data::npy::values_f64(&header, &bytes)
}

/// A fine-tuned checkpoint of the tiny Llama with a tied head, multi-query attention and linear
/// RoPE scaling written as GGUF: read back at f32 it gives the Hugging Face export's logits,
/// at Q8_0 within 3% of the logits' range (8-bit blocks of 32); a model with Llama 3's RoPE
/// scaling (which GGUF keeps as a table of factors) too.
#[test]
fn a_checkpoint_exports_to_gguf_with_its_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u8> = (0..4000u32)
        .map(|i| ((i * 37 + 11) % 160) as u16)
        .flat_map(u16::to_le_bytes)
        .collect();
    let data = tmp.path().join("ids.bin");
    std::fs::write(&data, &ids).unwrap();
    let train = |model: &str| {
        let out = tmp.path().join(model);
        let output = train_on_ids(
            &tiny(model),
            &[&data],
            &out,
            &[
                "--strategy",
                "local",
                "--batch-size",
                "4",
                "--train-samples",
                "8",
            ],
        );
        assert!(output.status.success(), "{}", said(&output));
        out
    };
    let run = train("llama-tied");
    let export = |to: &str, out: &Path, dtype: Option<&str>| {
        let mut args = vec![
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--to",
            to,
            out.to_str().unwrap(),
        ];
        args.extend(dtype.iter().flat_map(|d| ["--dtype", d]));
        ringtmp(&args)
    };
    let hf = tmp.path().join("hf");
    assert!(export("hf", &hf, None).status.success());
    let window: Vec<u16> = (0..16u16).map(|i| (i * 37 + 11) % 160).collect();
    let want = predicted(&hf, &window, &tmp.path().join("hf.npy"));
    let range = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (dtype, tolerance) in [("f32", 1e-5), ("q8_0", 0.03 * range)] {
        let file = tmp.path().join(format!("model-{dtype}.gguf"));
        let out = export("gguf", &file, Some(dtype));
        assert!(out.status.success(), "{}", said(&out));
        let got = predicted(&file, &window, &tmp.path().join(format!("{dtype}.npy")));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < tolerance, "{dtype}: {worst}");
    }
    // Llama 3's RoPE scaling travels as llama.cpp's table of factors (`rope_freqs`).
    let run = train("llama-gqa");
    let export = |to: &str, out: &Path| {
        let mut args = vec![
            "export",
            "--checkpoint",
            run.to_str().unwrap(),
            "--to",
            to,
            out.to_str().unwrap(),
        ];
        if to == "gguf" {
            args.extend(["--dtype", "f32"]);
        }
        let out = ringtmp(&args);
        assert!(out.status.success(), "{}", said(&out));
    };
    let (hf, file) = (tmp.path().join("gqa-hf"), tmp.path().join("gqa.gguf"));
    export("hf", &hf);
    export("gguf", &file);
    let want = predicted(&hf, &window, &tmp.path().join("gqa-hf.npy"));
    let got = predicted(&file, &window, &tmp.path().join("gqa.npy"));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "llama3 scaling through GGUF: {worst}");
}

/// A byte-level BPE `tokenizer.json` of a few dozen tokens (far fewer than the tiny models'
/// 160 rows): `<s>`, `</s>`, the letters, space (`Ġ`), `.`, and merges into `the`, ` the`,
/// `at`.
fn small_byte_level_tokenizer() -> String {
    let mut vocab = serde_json::Map::new();
    let tokens = ["<s>", "</s>"]
        .into_iter()
        .map(str::to_string)
        .chain(('a'..='z').map(String::from))
        .chain(["Ġ", ".", "th", "the", "Ġthe", "at"].map(String::from));
    for (id, token) in tokens.enumerate() {
        vocab.insert(token, id.into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<s>"), special(1, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                          "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": ["t h", "th e", "Ġ the", "a t"]},
    })
    .to_string()
}

/// A model whose embedding has more rows than its tokenizer has tokens (as Qwen 2.5's) is
/// fine-tuned on text with its own tokenizer; the checkpoint exported to GGUF carries that
/// tokenizer (written as llama.cpp writes a byte-level BPE), so the file alone reads the same
/// text into the same logits as the Hugging Face export with its `tokenizer.json`.
#[test]
fn a_text_run_from_a_directory_exports_to_gguf_with_its_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for file in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(tiny("llama-tied").join(file), model.join(file)).unwrap();
    }
    std::fs::write(model.join("tokenizer.json"), small_byte_level_tokenizer()).unwrap();
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}"#,
    )
    .unwrap();
    let run = train_on_text(
        &model,
        tmp.path(),
        "the cat sat on the mat. the rat ate the oat. ",
        60,
        &["--batch-size", "4", "--max-steps", "3"],
    );
    let export = |to: &str, out: &Path| {
        let mut args = vec!["export", "--checkpoint", run.to_str().unwrap(), "--to", to];
        args.push(out.to_str().unwrap());
        if to == "gguf" {
            args.extend(["--dtype", "f32"]);
        }
        let output = ringtmp(&args);
        assert!(output.status.success(), "{}", said(&output));
        said(&output)
    };
    let (hf, file) = (tmp.path().join("hf"), tmp.path().join("cats.gguf"));
    export("hf", &hf);
    let said_gguf = export("gguf", &file);
    assert!(said_gguf.contains("the tokenizer of"), "{said_gguf}");
    let logits = |model: &Path, npy: &str| {
        let npy = tmp.path().join(npy);
        let out = ringtmp(&[
            "predict",
            "--pretrained",
            model.to_str().unwrap(),
            "--text",
            "the cat ate the oat",
            "--logits",
            npy.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", said(&out));
        let bytes = std::fs::read(&npy).unwrap();
        let header = ringtmp_data::npy::parse_header(&npy, &bytes).unwrap();
        (
            header.shape.clone(),
            ringtmp_data::npy::values_f64(&header, &bytes),
        )
    };
    let (want_shape, want) = logits(&hf, "hf.npy");
    let (got_shape, got) = logits(&file, "gguf.npy");
    assert_eq!(got_shape, want_shape, "the same tokens, BOS first");
    assert_eq!(
        want_shape[1], 160,
        "every row of the embedding is predicted"
    );
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "{worst}");
}

/// A model directory missing one tensor is refused by `train` before any node starts, naming
/// the tensor.
#[test]
fn a_missing_tensor_is_refused_before_any_node_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qwen2-missing");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(tiny("qwen2").join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(tiny("qwen2").join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = file
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "model.layers.1.mlp.up_proj.weight")
        .collect();
    let written = safetensors::serialize(kept, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), written).unwrap();
    let ids: Vec<u8> = (0..2000u16)
        .map(|i| i % 160)
        .flat_map(u16::to_le_bytes)
        .collect();
    let data = tmp.path().join("ids.bin");
    std::fs::write(&data, ids).unwrap();
    let out = train_on_ids(&dir, &[&data], &tmp.path().join("run"), &["--nodes", "2"]);
    let text = said(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("no tensor \"model.layers.1.mlp.up_proj.weight\""),
        "{text}"
    );
    assert!(!text.contains("[node"), "no node started: {text}");
}

/// A run fine-tuning the shared SmolLM2 file keeps its tokenizer, template and end of turn: one
/// step at a negligible rate, then `generate --checkpoint RUN --chat` answers as the model
/// does, in one process and over 2 nodes.
#[test]
fn a_fine_tuned_run_chats_from_its_checkpoint() {
    let Some(model) = ringtmp_testkit::fixtures::shared_smollm2() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let run = train_on_text(
        &model,
        tmp.path(),
        "The quick brown fox jumps over the lazy dog. ",
        200,
        &[
            "--batch-size",
            "1",
            "--max-steps",
            "1",
            "--eval-tokens",
            "16",
            "--lr",
            "1e-9",
        ],
    );
    for kept in ["tokenizer.json", "chat_template.jinja", "vocabulary.json"] {
        assert!(run.join(kept).is_file(), "{kept}");
    }
    for nodes in ["1", "2"] {
        let out = ringtmp(&[
            "generate",
            "--checkpoint",
            run.to_str().unwrap(),
            "--chat",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--tokens",
            "24",
            "--nodes",
            nodes,
        ]);
        assert!(out.status.success(), "{}", said(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "The capital of France is Paris.",
            "--nodes {nodes}"
        );
    }
}
