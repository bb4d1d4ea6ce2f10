//! Weights in and out: `ringtmp export --to pytorch` writes what PyTorch loads into the module
//! its `model.py` builds and then computes the logits ringtmp computes (golden files made by
//! benches/reference/export_parity.py with torch), `ringtmp predict` reads a user's inputs as
//! training read them, and `--init-from` starts training from weights trained elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ringtmp_data::npy;

fn ringtmp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtmp"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run ringtmp")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn golden(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/export")
        .join(kind)
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
}

fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let header = npy::parse_header(path, &bytes).unwrap();
    let values = npy::values_f64(&header, &bytes);
    (header.shape, values.iter().map(|&v| v as f32).collect())
}

fn sha256(path: &Path) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

/// Exports the golden checkpoint of `kind`, checks the files are those PyTorch ran (model.py
/// text, the weights' bytes), and that ringtmp's own logits on the golden inputs are PyTorch's.
/// `RINGTMP_BLESS=1` rewrites the golden model.py and hash (then run the script again).
fn check_export(kind: &str, inputs: &str) {
    let dir = golden(kind);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    let checkpoint = dir.join("checkpoint");
    ok(&ringtmp(&[
        "export",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--to",
        "pytorch",
        out.to_str().unwrap(),
    ]));
    let model_py = std::fs::read_to_string(out.join("model.py")).unwrap();
    let hash = sha256(&out.join("model.safetensors"));
    if std::env::var_os("RINGTMP_BLESS").is_some() {
        std::fs::write(dir.join("model.py.golden"), &model_py).unwrap();
        std::fs::write(dir.join("model.safetensors.sha256"), format!("{hash}\n")).unwrap();
        eprintln!(
            "blessed; now: ringtmp export --checkpoint {} OUT && python3 \
             benches/reference/export_parity.py OUT {} {}",
            checkpoint.display(),
            dir.join(inputs).display(),
            dir.join("torch_logits.npy").display()
        );
    }
    assert_eq!(
        model_py,
        std::fs::read_to_string(dir.join("model.py.golden")).unwrap(),
        "model.py differs from the one PyTorch ran (RINGTMP_BLESS=1 and rerun the script)"
    );
    assert_eq!(
        hash,
        std::fs::read_to_string(dir.join("model.safetensors.sha256"))
            .unwrap()
            .trim(),
        "the exported weights differ from those PyTorch ran"
    );
    let logits = tmp.path().join("logits.npy");
    ok(&ringtmp(&[
        "predict",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--data-file",
        dir.join(inputs).to_str().unwrap(),
        "--logits",
        logits.to_str().unwrap(),
    ]));
    let (shape, ours) = read_npy(&logits);
    let (torch_shape, theirs) = read_npy(&dir.join("torch_logits.npy"));
    assert_eq!(shape, torch_shape);
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = ours
        .iter()
        .zip(&theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-5 * scale.max(1.0),
        "{kind}: ringtmp and PyTorch differ by {worst} (logits up to {scale})"
    );
}

#[test]
fn exported_models_give_pytorch_the_same_logits() {
    // Three channels: the convolutions' OIHW weights and a flattened 6-channel image.
    check_export("cnn", "inputs.npy");
    // A transformer: embeddings, a block, the final norm and the head.
    check_export("gpt", "ids.npy");
}

fn log_softmax(rows: &[f32], width: usize) -> Vec<f64> {
    rows.chunks_exact(width)
        .flat_map(|row| {
            let max = row.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            row.iter().map(move |&v| v as f64 - max - sum.ln())
        })
        .collect()
}

/// A tied GPT exported for nanoGPT: the files are those nanoGPT's own GPT ran (their hashes),
/// and its log-probabilities there (with the tanh GELU ringtmp computes; nanoGPT's exact GELU
/// moves them by about 1e-3, measured by the script) are ringtmp's, the head's bias carried by
/// the final LayerNorm's. Models nanoGPT cannot hold are refused, naming why.
#[test]
fn a_tied_gpt_exports_to_nanogpt_as_nanogpt_runs_it() {
    let dir = golden("nanogpt");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("nanogpt");
    let checkpoint = dir.join("checkpoint");
    let said = ok(&ringtmp(&[
        "export",
        "--to",
        "nanogpt",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        out.to_str().unwrap(),
    ]));
    assert!(said.contains("carried by transformer.ln_f.bias"), "{said}");
    let hashes = ["ckpt.pt", "meta.pkl"].map(|f| sha256(&out.join(f)));
    if std::env::var_os("RINGTMP_BLESS").is_some() {
        for (f, h) in ["ckpt.pt", "meta.pkl"].iter().zip(&hashes) {
            std::fs::write(dir.join(format!("{f}.sha256")), format!("{h}\n")).unwrap();
        }
        eprintln!(
            "blessed; now: python3 benches/reference/nanogpt_export.py OUT {} LOGITS NANOGPT {}",
            dir.join("ids.npy").display(),
            dir.join("torch_logprobs.npy").display()
        );
    }
    for (f, h) in ["ckpt.pt", "meta.pkl"].iter().zip(&hashes) {
        let want = std::fs::read_to_string(dir.join(format!("{f}.sha256"))).unwrap();
        assert_eq!(h, want.trim(), "{f} differs from the one nanoGPT ran");
    }
    let logits = tmp.path().join("logits.npy");
    ok(&ringtmp(&[
        "predict",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--data-file",
        dir.join("ids.npy").to_str().unwrap(),
        "--logits",
        logits.to_str().unwrap(),
    ]));
    let (shape, ours) = read_npy(&logits);
    let (torch_shape, theirs) = read_npy(&dir.join("torch_logprobs.npy"));
    assert_eq!(shape, torch_shape);
    let width = *shape.last().unwrap();
    let worst = log_softmax(&ours, width)
        .iter()
        .zip(&theirs)
        .fold(0f64, |m, (a, &b)| m.max((a - b as f64).abs()));
    assert!(
        worst <= 1e-5,
        "nanoGPT's log-probabilities differ by {worst}"
    );

    // An untied head (the gpt golden) has no place in nanoGPT's GPT.
    let refused = ringtmp(&[
        "export",
        "--to",
        "nanogpt",
        "--checkpoint",
        golden("gpt").join("checkpoint").to_str().unwrap(),
        tmp.path().join("untied").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("nanoGPT ties its head") && stderr.contains("--tie-embeddings"),
        "{stderr}"
    );
    let refused = ringtmp(&[
        "export",
        "--to",
        "onnx",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        tmp.path().join("onnx").to_str().unwrap(),
    ]);
    assert_eq!(refused.status.code(), Some(2));
}

const DIGITS_CNN: &str = r#"
name = "digits-cnn"
[[layer]]
type = "conv2d"
out_channels = 6
kernel = 3
[[layer]]
type = "relu"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 10
"#;

fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

fn train(out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "train",
        "--dataset",
        "digits",
        "--batch-size",
        "32",
        "--out",
        out.to_str().unwrap(),
        "--overwrite",
    ];
    args.extend_from_slice(extra);
    ok(&ringtmp(&args))
}

#[test]
fn init_from_an_export_starts_every_strategy_from_those_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = t.join("model.toml");
    std::fs::write(&model, DIGITS_CNN).unwrap();
    let model = model.to_str().unwrap();
    let first = t.join("first");
    train(
        &first,
        &[
            "--model-file",
            model,
            "--strategy",
            "local",
            "--max-steps",
            "15",
            "--checkpoint-every",
            "15",
        ],
    );
    let exported = t.join("exported");
    ok(&ringtmp(&[
        "export",
        "--checkpoint",
        first.to_str().unwrap(),
        exported.to_str().unwrap(),
    ]));
    let weights = exported.join("model.safetensors");
    let weights = weights.to_str().unwrap();
    // No step: the model is the exported one, so it scores as the first run ended.
    let again = t.join("again");
    let said = train(
        &again,
        &[
            "--model-file",
            model,
            "--strategy",
            "local",
            "--max-steps",
            "0",
            "--init-from",
            weights,
        ],
    );
    assert!(
        said.contains("4 tensors (") && said.contains("pytorch names"),
        "{said}"
    );
    assert_eq!(
        summary(&again)["final_test_accuracy"],
        summary(&first)["final_test_accuracy"]
    );
    // A ring (two stages, each loading its own layers by name) and local, three steps from the
    // same weights: the same model.
    let mut logits = Vec::new();
    for (name, strategy) in [
        ("local", &["--strategy", "local"][..]),
        (
            "ring",
            &["--strategy", "ring", "--nodes", "2", "--schedule", "1f1b"],
        ),
    ] {
        let out = t.join(name);
        let mut extra = vec![
            "--model-file",
            model,
            "--max-steps",
            "3",
            "--checkpoint-every",
            "3",
        ];
        extra.extend_from_slice(&["--init-from", weights]);
        extra.extend_from_slice(strategy);
        train(&out, &extra);
        let path = t.join(format!("{name}.npy"));
        ok(&ringtmp(&[
            "predict",
            "--checkpoint",
            out.to_str().unwrap(),
            "--limit",
            "50",
            "--logits",
            path.to_str().unwrap(),
        ]));
        logits.push(read_npy(&path).1);
    }
    let worst = logits[0]
        .iter()
        .zip(&logits[1])
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst < 1e-3,
        "ring and local from the same weights differ by {worst}"
    );
    // Another model's weights: every problem listed, exit 2, nothing trained.
    let out = ringtmp(&[
        "train",
        "--dataset",
        "digits",
        "--strategy",
        "local",
        "--model",
        "mlp",
        "--init-from",
        weights,
        "--weight-map",
        "pytorch",
        "--out",
        t.join("refused").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--init-from") && stderr.contains("0.weight"),
        "{stderr}"
    );
    assert!(!t.join("refused").join("summary.json").exists());
    // A NaN among the weights: refused naming the tensor, before any node starts.
    let mut bytes = std::fs::read(weights).unwrap();
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    let poisoned = t.join("nan.safetensors");
    std::fs::write(&poisoned, bytes).unwrap();
    let out = ringtmp(&[
        "train",
        "--dataset",
        "digits",
        "--strategy",
        "local",
        "--model-file",
        model,
        "--init-from",
        poisoned.to_str().unwrap(),
        "--out",
        t.join("nan").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("not finite") && stderr.contains("tensor"),
        "{stderr}"
    );
}

#[test]
fn predict_reads_a_table_by_column_names_and_writes_class_names() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let mut rows = String::from("x1,x2,kind\n");
    for i in 0..240 {
        let (a, b) = ((i % 12) as f32 / 12.0, (i % 7) as f32 / 7.0);
        rows.push_str(&format!("{a},{b},{}\n", if a > b { "up" } else { "down" }));
    }
    let table = t.join("t.csv");
    std::fs::write(&table, rows).unwrap();
    let run = t.join("run");
    train_table(&table, &run);
    // The columns in another order, and no label: predictions by class name.
    let new = t.join("new.csv");
    std::fs::write(&new, "x2,x1\n0.1,0.9\n0.9,0.1\n").unwrap();
    let csv = t.join("p.csv");
    ok(&ringtmp(&[
        "predict",
        "--checkpoint",
        run.to_str().unwrap(),
        "--data-file",
        new.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]));
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "source,predicted,probability");
    assert!(
        lines[1].contains(",up,") && lines[2].contains(",down,"),
        "{text}"
    );
    // A table without a column the model reads is refused, naming it.
    let bad = t.join("bad.csv");
    std::fs::write(&bad, "x1\n0.5\n").unwrap();
    let out = ringtmp(&[
        "predict",
        "--checkpoint",
        run.to_str().unwrap(),
        "--data-file",
        bad.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no column \"x2\""));
}

/// A small table with nothing but the data named: enough steps for it (the floor, not two
/// epochs' handful), the best evaluation's checkpoint kept, and `ringtmp eval` scoring it on a
/// labelled file (accuracy; R² for a regression); `--early-stop` is refused where the workers
/// would not all stop.
#[test]
fn a_small_table_trains_enough_steps_keeps_its_best_and_eval_scores_it() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let table = |name: &str, rows: std::ops::Range<usize>, regression: bool| {
        let mut text = String::from("x1,x2,label\n");
        for i in rows {
            let (a, b) = ((i % 12) as f32 / 12.0, (i % 7) as f32 / 7.0);
            let label = if regression {
                format!("{:.1}", 100.0 + 50.0 * a - 30.0 * b)
            } else {
                if a > b { "1" } else { "0" }.to_string()
            };
            text.push_str(&format!("{a},{b},{label}\n"));
        }
        let path = t.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    for regression in [false, true] {
        let (train, test) = (
            table("train.csv", 0..300, regression),
            table("test.csv", 300..400, regression),
        );
        let run = t.join(format!("run-{regression}"));
        ok(&ringtmp(&[
            "train",
            "--dataset",
            "csv",
            "--data-file",
            train.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
        ]));
        assert_eq!(summary(&run)["steps"], 1000, "the floor on steps");
        let best = std::fs::read_to_string(run.join("checkpoints/best")).unwrap();
        let out = ringtmp(&[
            "eval",
            "--checkpoint",
            run.to_str().unwrap(),
            "--data-file",
            test.to_str().unwrap(),
            "--json",
        ]);
        ok(&out);
        let score: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
        assert!(score["checkpoint"].as_str().unwrap().ends_with(best.trim()));
        match regression {
            false => assert!(score["accuracy"].as_f64().unwrap() > 0.9, "{score}"),
            true => assert!(score["r2"].as_f64().unwrap() > 0.9, "{score}"),
        }
    }
    let refused = ringtmp(&[
        "train",
        "--dataset",
        "csv",
        "--data-file",
        t.join("train.csv").to_str().unwrap(),
        "--strategy",
        "allreduce",
        "--early-stop",
        "3",
    ]);
    bad_input(&refused, "--early-stop stops local and ring runs");
}

fn train_table(table: &Path, run: &Path) {
    ok(&ringtmp(&[
        "train",
        "--dataset",
        "csv",
        "--data-file",
        table.to_str().unwrap(),
        "--label",
        "kind",
        "--strategy",
        "local",
        "--epochs",
        "30",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--checkpoint-every",
        "1000",
        "--out",
        run.to_str().unwrap(),
    ]));
}

// An export never replaces a user's files without being told, and a place it cannot write is
// bad input (exit 2), found before anything is computed.
#[test]
fn an_export_refuses_to_overwrite_a_file_or_an_earlier_export() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = golden("cnn").join("checkpoint");
    let export = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "export",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        ringtmp(&args)
    };
    let out = tmp.path().join("export");
    ok(&export(&out, &[]));
    std::fs::write(out.join("model.py"), "# my own edits\n").unwrap();
    let again = export(&out, &[]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--overwrite"));
    assert_eq!(
        std::fs::read_to_string(out.join("model.py")).unwrap(),
        "# my own edits\n"
    );
    ok(&export(&out, &["--overwrite"]));
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    assert_eq!(export(&file, &[]).status.code(), Some(2));
}

// `predict --limit 0` and `--threads 0` are bad input, not a panic.
#[test]
fn predict_refuses_zero_rows_and_zero_threads() {
    let checkpoint = golden("cnn").join("checkpoint");
    for flag in ["--limit", "--threads"] {
        let out = ringtmp(&[
            "predict",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            flag,
            "0",
        ]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// A checkpoint missing a file its manifest lists, or an input that is not there, is bad
// input (exit 2), named.
#[test]
fn missing_files_are_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let damaged = tmp.path().join("checkpoint");
    std::fs::create_dir_all(&damaged).unwrap();
    for entry in std::fs::read_dir(golden("cnn").join("checkpoint")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&path, damaged.join(path.file_name().unwrap())).unwrap();
        }
    }
    let out = tmp.path().join("out");
    let export = ringtmp(&[
        "export",
        "--checkpoint",
        damaged.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    bad_input(&export, "safetensors");
    let missing = tmp.path().join("no-such.npy");
    let csv = tmp.path().join("p.csv");
    let predict = ringtmp(&[
        "predict",
        "--checkpoint",
        golden("cnn").join("checkpoint").to_str().unwrap(),
        "--data-file",
        missing.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    bad_input(&predict, "no-such.npy");
}

/// Asserts that `out` is a refusal of bad input (exit 2) whose message contains `needle`.
fn bad_input(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(needle), "{needle:?} not in: {stderr}");
}
