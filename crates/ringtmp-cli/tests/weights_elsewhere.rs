//! A language model's weights leaving and entering ringtmp: the export carries the vocabulary,
//! context and architecture (recipe.json, model.py's `encode`/`decode`, the weights' metadata);
//! `--init-from` checks the architecture a file states against the model it loads into;
//! `ringtmp eval` scores a checkpoint or a foreign file as the run itself scored it; and
//! `export --to nanogpt` takes what nanoGPT's GPT can hold and refuses the rest (its files
//! against nanoGPT itself: tests/export.rs's golden).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn ringtmp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .output()
        .expect("run ringtmp")
}

fn succeeded(out: &Output) -> (String, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stderr: {stderr}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

/// Exit status 2, one `error:` line holding every one of `needles`, no panic.
fn refused(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
}

/// Text whose characters need every kind of escape in Python and JSON, the validation part
/// using only characters the training part has.
const LINE: &str = "It's \"quoted\", a back\\slash,\ta tab, café — 🎭 and York.\n";

fn text_file(dir: &Path) -> String {
    let path = dir.join("play.txt");
    std::fs::write(&path, LINE.repeat(80)).unwrap();
    path.display().to_string()
}

/// The data options of every command here, at `seq` positions per window.
fn data<'a>(file: &'a str, seq: &'a str) -> Vec<&'a str> {
    vec![
        "--dataset",
        "text",
        "--data-file",
        file,
        "--seq-len",
        seq,
        "--threads",
        "1",
    ]
}

/// A gpt-nano trained a few steps on `file` into `dir/run`, exported to `dir/export`.
fn trained_and_exported(dir: &Path, file: &str) -> (PathBuf, PathBuf) {
    let run = dir.join("run");
    let mut args = vec!["train", "--strategy", "local", "--model", "gpt-nano"];
    args.extend(data(file, "16"));
    args.extend(["--max-steps", "6", "--out", run.to_str().unwrap()]);
    succeeded(&ringtmp(&args));
    let export = dir.join("export");
    succeeded(&ringtmp(&[
        "export",
        "--checkpoint",
        run.to_str().unwrap(),
        export.to_str().unwrap(),
    ]));
    (run, export)
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn manifest(run: &Path) -> Value {
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    json(
        &run.join("checkpoints")
            .join(latest.trim())
            .join("manifest.json"),
    )
}

/// Runs model.py's `encode` and `decode` on `sample` under Python with stand-ins for torch
/// (the text functions need none): `None` when there is no python3.
fn python_codec(model_py: &Path, sample: &str) -> Option<(Vec<u32>, String)> {
    let script = r#"
import json, sys, types
torch = types.ModuleType("torch"); nn = types.ModuleType("torch.nn")
functional = types.ModuleType("torch.nn.functional")
nn.Module = object; nn.functional = functional; torch.nn = nn
sys.modules.update({"torch": torch, "torch.nn": nn, "torch.nn.functional": functional})
source = open(sys.argv[1], encoding="utf-8").read()
scope = {"__name__": "model", "__file__": sys.argv[1]}
exec(compile(source, sys.argv[1], "exec"), scope)
sample = sys.stdin.read()
ids = scope["encode"](sample)
print(json.dumps({"ids": ids, "text": scope["decode"](ids)}))
"#;
    use std::io::Write as _;
    let mut child = match Command::new("python3")
        .args(["-c", script, model_py.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            eprintln!("skipping model.py's codec check: no python3 ({e})");
            return None;
        }
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(sample.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "model.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect();
    Some((ids, v["text"].as_str().unwrap().to_string()))
}

#[test]
fn an_exported_language_model_carries_its_vocabulary_context_and_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    let file = text_file(tmp.path());
    let (run, export) = trained_and_exported(tmp.path(), &file);
    let line = manifest(&run)["vocabulary"].as_str().unwrap().to_string();
    let vocabulary = ringtmp_data::Vocabulary::from_line(&line, "manifest").unwrap();
    let ringtmp_data::Vocabulary::Chars(chars) = &vocabulary else {
        panic!("a character vocabulary: {line}")
    };

    let recipe = json(&export.join("recipe.json"));
    assert_eq!(recipe["task"], "next-token");
    assert_eq!(recipe["context"], 16);
    let tokens: Vec<String> = chars.iter().map(char::to_string).collect();
    assert_eq!(recipe["vocabulary"]["kind"], "characters");
    assert_eq!(recipe["vocabulary"]["tokens"], serde_json::json!(tokens));
    assert_eq!(recipe["architecture"]["n_head"], 2);
    assert_eq!(recipe["architecture"]["n_layer"], 2);
    assert_eq!(recipe["architecture"]["vocab_size"], chars.len());

    let metadata =
        ringtmp_model::arch::safetensors_metadata(&export.join("model.safetensors")).unwrap();
    for (key, value) in [
        ("format", "pt".to_string()),
        ("n_head", "2".into()),
        ("n_embd", "64".into()),
        ("block_size", "16".into()),
        ("mlp_ratio", "4".into()),
        ("vocab_size", chars.len().to_string()),
    ] {
        assert_eq!(metadata.get(key), Some(&value), "{key} in {metadata:?}");
    }

    let sample = LINE.repeat(2);
    let want = vocabulary.encode(&sample).unwrap();
    if let Some((ids, text)) = python_codec(&export.join("model.py"), &sample) {
        assert_eq!(
            ids, want,
            "model.py's encode is not the ids ringtmp trained on"
        );
        assert_eq!(text, sample, "model.py's decode does not invert its encode");
    }
}

#[test]
fn init_from_checks_the_architecture_the_weights_state() {
    let tmp = tempfile::tempdir().unwrap();
    let file = text_file(tmp.path());
    let (run, export) = trained_and_exported(tmp.path(), &file);
    let weights = export.join("model.safetensors");
    let weights = weights.to_str().unwrap();
    let vocab = manifest(&run)["model"]["layer"][0]["vocab"]
        .as_u64()
        .unwrap();
    let four_heads = tmp.path().join("four.toml");
    std::fs::write(
        &four_heads,
        format!(
            "name = \"four\"\n[[layer]]\ntype = \"embedding\"\nvocab = {vocab}\nwidth = 64\n\
             [[layer]]\ntype = \"block\"\nheads = 4\n[[layer]]\ntype = \"block\"\nheads = 4\n\
             [[layer]]\ntype = \"layer_norm\"\n[[layer]]\ntype = \"linear\"\nout = {vocab}\n"
        ),
    )
    .unwrap();
    let check_at = |model: &[&str], weights: &str, seq: &str| {
        let mut args = vec!["validate-config"];
        args.extend(model);
        args.extend(data(&file, seq));
        args.extend(["--init-from", weights]);
        ringtmp(&args)
    };
    let check = |model: &[&str], weights: &str| check_at(model, weights, "16");
    // The tensors of 2 heads fit 4 heads of the same width: only the metadata tells.
    refused(
        &check(&["--model-file", four_heads.to_str().unwrap()], weights),
        &[
            "heads 2 where the model has 4",
            "its metadata says",
            "--model gpt-nano --seq-len 16 has that shape",
        ],
    );
    refused(
        &check_at(&["--model", "gpt-nano"], weights, "32"),
        &["context 16 where the model has 32", "pass --seq-len 16"],
    );
    let (stdout, _) = succeeded(&check(&["--model", "gpt-nano"], weights));
    assert!(stdout.contains("its weights fit the model"), "{stdout}");
    assert!(
        stdout.contains("architecture: 2 blocks, 2 heads, width 64, context 16, MLP ratio 4"),
        "{stdout}"
    );

    // A file that states nothing (as nanoGPT's own writes them) loads with a warning.
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    let bare_weights = bare.join("weights.safetensors");
    let tensors = ringtmp_model::interop::read_safetensors(Path::new(weights)).unwrap();
    let tensors: Vec<ringtmp_model::interop::Tensor> = tensors
        .into_iter()
        .map(|(name, (shape, values))| ringtmp_model::interop::Tensor {
            name,
            shape,
            values,
        })
        .collect();
    ringtmp_model::interop::write_safetensors(&bare_weights, &tensors, &[]).unwrap();
    let bare_weights = bare_weights.to_str().unwrap();
    let (_, stderr) = succeeded(&check(
        &["--model-file", four_heads.to_str().unwrap()],
        bare_weights,
    ));
    assert!(
        stderr.contains("does not say how many attention heads"),
        "{stderr}"
    );
    // A config.json beside it (nanoGPT's model_args, Hugging Face's names) states them.
    std::fs::write(
        bare.join("config.json"),
        r#"{"n_layer": 2, "num_attention_heads": 4, "n_embd": 64, "n_positions": 16}"#,
    )
    .unwrap();
    refused(
        &check(&["--model", "gpt-nano"], bare_weights),
        &["heads 4 where the model has 2", "config.json beside it"],
    );
}

#[test]
fn eval_scores_weights_as_their_run_scored_them() {
    let tmp = tempfile::tempdir().unwrap();
    let file = text_file(tmp.path());
    let (run, export) = trained_and_exported(tmp.path(), &file);
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last_eval: Value = metrics
        .lines()
        .rev()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["event"] == "eval")
        .expect("the run evaluated");
    let want = (
        last_eval["test_loss"].as_f64().unwrap(),
        last_eval["test_accuracy"].as_f64().unwrap(),
    );
    let score = |out: Output| {
        let (stdout, stderr) = succeeded(&out);
        assert!(stderr.contains("validation loss"), "{stderr}");
        let v: Value = serde_json::from_str(stdout.trim()).unwrap();
        (v["loss"].as_f64().unwrap(), v["accuracy"].as_f64().unwrap())
    };
    let close = |(loss, acc): (f64, f64), what: &str| {
        assert!(
            (loss - want.0).abs() <= 1e-6 * want.0.abs() && acc == want.1,
            "{what}: loss {loss}, accuracy {acc}; the run's last evaluation {want:?}"
        );
    };
    // The run's options come from its train.toml.
    close(
        score(ringtmp(&[
            "eval",
            "--checkpoint",
            run.to_str().unwrap(),
            "--json",
            "--threads",
            "1",
        ])),
        "eval --checkpoint",
    );
    let mut args = vec!["eval", "--json", "--model", "gpt-nano"];
    args.extend(data(&file, "16"));
    let weights = export.join("model.safetensors");
    args.extend(["--init-from", weights.to_str().unwrap()]);
    close(score(ringtmp(&args)), "eval --init-from the export");

    refused(
        &ringtmp(&[
            "eval",
            "--checkpoint",
            run.to_str().unwrap(),
            "--epochs",
            "2",
        ]),
        &["--epochs trains", "without training"],
    );
    let other = tmp.path().join("other.txt");
    std::fs::write(&other, "zzzz qqqq ".repeat(300)).unwrap();
    refused(
        &ringtmp(&[
            "eval",
            "--checkpoint",
            run.to_str().unwrap(),
            "--data-file",
            other.to_str().unwrap(),
        ]),
        &["is not the model's"],
    );
}

#[test]
fn nanogpt_takes_a_tied_character_model_and_refuses_what_its_gpt_cannot_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let file = text_file(tmp.path());
    let train = |name: &str, text: &str, extra: &[&str]| {
        let run = tmp.path().join(name);
        let mut args = vec!["train", "--strategy", "local", "--model", "gpt-nano"];
        args.extend(data(text, "16"));
        args.extend(["--max-steps", "3", "--out", run.to_str().unwrap()]);
        args.extend(extra);
        succeeded(&ringtmp(&args));
        run
    };
    let export = |run: &Path, out: &Path| {
        ringtmp(&[
            "export",
            "--to",
            "nanogpt",
            "--checkpoint",
            run.to_str().unwrap(),
            out.to_str().unwrap(),
        ])
    };
    // A tied model of few characters: written, the head's bias carried by ln_f's.
    let tied = train("tied", &file, &["--tie-embeddings"]);
    let out = tmp.path().join("nanogpt");
    let (_, said) = succeeded(&export(&tied, &out));
    assert!(said.contains("carried by transformer.ln_f.bias"), "{said}");
    assert!(out.join("ckpt.pt").is_file() && out.join("meta.pkl").is_file());

    // 70 characters over a width of 64: the final LayerNorm's bias cannot carry the head's.
    let wide = tmp.path().join("wide.txt");
    let alphabet: String = (33u8..103).map(char::from).collect();
    std::fs::write(&wide, format!("{alphabet}\n").repeat(40)).unwrap();
    let wide = train("wide", wide.to_str().unwrap(), &["--tie-embeddings"]);
    let refused_out = tmp.path().join("refused");
    refused(
        &export(&wide, &refused_out),
        &[
            "vocabulary of 71 is more than its width 64 + 1",
            "--to pytorch",
        ],
    );
    assert!(
        !refused_out.exists(),
        "a refused export leaves no directory"
    );
    // An untied head has no place in nanoGPT's GPT.
    let untied = train("untied", &file, &[]);
    refused(
        &export(&untied, &refused_out),
        &["nanoGPT ties its head", "--tie-embeddings"],
    );
}
