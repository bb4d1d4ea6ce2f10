//! Language models as a user meets them: `--dataset text` trains a GPT preset in one process and
//! on a ring and reports validation loss, perplexity and bits per character; bad text, windows
//! that do not fit, token ids past the vocabulary and a checkpoint of another vocabulary are
//! each one clear error with exit status 2 that writes nothing.

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

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path.display().to_string()
}

/// A few thousand characters whose validation part uses only characters the training part has.
fn text() -> Vec<u8> {
    "Now is the winter of our discontent made glorious summer by this sun of York.\n"
        .repeat(60)
        .into_bytes()
}

fn succeeded(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
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

fn json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn train(data: &str, out: &Path, extra: &[&str]) -> Output {
    let out = out.display().to_string();
    let mut args = vec![
        "train",
        "--dataset",
        "text",
        "--data-file",
        data,
        "--model",
        "gpt-nano",
        "--seq-len",
        "16",
        "--threads",
        "1",
        "--out",
        &out,
    ];
    args.extend_from_slice(extra);
    ringtmp(&args)
}

#[test]
fn a_gpt_trains_on_text_and_reports_loss_perplexity_and_bits_per_character() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write(tmp.path(), "winter.txt", &text());
    let run = tmp.path().join("local");
    let stdout = succeeded(&train(
        &data,
        &run,
        &[
            "--strategy",
            "local",
            "--max-steps",
            "30",
            "--eval-every",
            "15",
            "--checkpoint-every",
            "30",
        ],
    ));
    assert!(
        stdout.contains("final validation loss") && stdout.contains("bits per character"),
        "{stdout}"
    );
    let summary = json(run.join("summary.json"));
    let lm = &summary["language"];
    assert_eq!(
        (lm["seq_len"].as_u64(), lm["unit"].as_str()),
        (Some(16), Some("char"))
    );
    let loss = lm["final_val_loss"].as_f64().unwrap();
    // It learns: below the loss of a uniform guess over the vocabulary.
    assert!(loss < (lm["vocab"].as_f64().unwrap()).ln(), "{summary}");
    let bits = lm["final_bits_per_unit"].as_f64().unwrap();
    assert!(
        (bits - loss / std::f64::consts::LN_2).abs() < 1e-9,
        "{summary}"
    );
    assert!(lm["tokens_per_second"].as_f64().unwrap() > 0.0);
    let evals: Vec<Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["event"] == "eval")
        .collect();
    assert_eq!(evals.len(), 2, "{evals:?}");
    for e in &evals {
        let loss = e["test_loss"].as_f64().unwrap();
        assert!(
            (e["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9,
            "{e}"
        );
        assert!(e["bits_per_char"].as_f64().is_some(), "{e}");
    }
    // The vocabulary travels with the checkpoint.
    let manifest = json(run.join("checkpoints/step-000000030/manifest.json"));
    assert!(
        manifest["vocabulary"]
            .as_str()
            .is_some_and(|v| v.starts_with("chars:")),
        "{manifest}"
    );

    // The ring (clipping by the global norm picks the 1f1b schedule) trains the same model.
    let ring = tmp.path().join("ring");
    let out = train(
        &data,
        &ring,
        &["--strategy", "ring", "--nodes", "2", "--max-steps", "20"],
    );
    let stdout = succeeded(&out);
    assert!(stdout.contains("final validation loss"), "{stdout}");
    let summary = json(ring.join("summary.json"));
    assert_eq!(summary["schedule"], "1f1b", "{summary}");
    assert!(summary["language"]["final_val_loss"].as_f64().is_some());
}

/// `ringtmp generate` on a ring's checkpoint (its stages in two files): the prompt and exactly
/// the tokens asked for, the same text for the same seed (also split over two node processes),
/// another for another seed, the figures on stderr; and each bad input one error, exit status 2.
#[test]
fn generate_continues_a_prompt_from_any_strategys_checkpoint_and_refuses_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write(tmp.path(), "winter.txt", &text());
    let ring = tmp.path().join("ring");
    succeeded(&train(
        &data,
        &ring,
        &[
            "--strategy",
            "ring",
            "--nodes",
            "2",
            "--use-all-nodes",
            "--max-steps",
            "40",
            "--checkpoint-every",
            "40",
        ],
    ));
    let manifest = json(ring.join("checkpoints/step-000000040/manifest.json"));
    assert_eq!(
        manifest["files"].as_array().map(Vec::len),
        Some(2),
        "{manifest}"
    );
    assert_eq!(manifest["context"], 16, "{manifest}");
    let ring_dir = ring.display().to_string();
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--checkpoint", &ring_dir, "--threads", "1"];
        args.extend_from_slice(extra);
        ringtmp(&args)
    };
    let sampled = |seed: &str| {
        let out = generate(&["--prompt", "Now is", "--tokens", "40", "--seed", seed]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (succeeded(&out), stderr)
    };
    let (first, stderr) = sampled("3");
    assert!(first.starts_with("Now is"), "{first}");
    // The prompt, 40 characters and the closing newline.
    assert_eq!(first.chars().count(), "Now is".len() + 40 + 1, "{first:?}");
    assert!(
        first.chars().all(|c| {
            "Now is the winter of our discontent made glorious summer by this sun of York.\n"
                .contains(c)
        }),
        "{first:?}"
    );
    assert!(
        stderr.contains("first token after") && stderr.contains("tokens/s"),
        "{stderr}"
    );
    assert_eq!(sampled("3").0, first);
    assert_ne!(sampled("4").0, first);
    // Split over two node processes, each with its own layers and cache: the same text.
    let split = generate(&[
        "--prompt", "Now is", "--tokens", "40", "--seed", "3", "--nodes", "2",
    ]);
    let split_err = String::from_utf8_lossy(&split.stderr).into_owned();
    assert_eq!(succeeded(&split), first, "{split_err}");
    assert!(split_err.contains("split over 2 nodes"), "{split_err}");
    refused(
        &generate(&["--prompt", "Now", "--tokens", "3", "--nodes", "9"]),
        &["--nodes 9", "5 layers"],
    );
    // Greedy decoding of a model that has learnt this one line continues it.
    let greedy = succeeded(&generate(&[
        "--prompt",
        "Now is the winter of",
        "--tokens",
        "8",
        "--temperature",
        "0",
    ]));
    assert!(greedy.starts_with("Now is the winter of"), "{greedy}");

    refused(
        &generate(&["--prompt", "Now is 7", "--tokens", "5"]),
        &["character '7'", "not in the model's vocabulary"],
    );
    refused(&generate(&["--tokens", "0"]), &["--tokens 0"]);
    // A split whose node cannot hold its layers' parameters, before any node starts.
    refused(
        &generate(&["--tokens", "3", "--nodes", "2", "--node-memory-limit", "1M"]),
        &[
            "node 0 holds layers 0..",
            "more than its limit of 1 MiB",
            "--nodes",
        ],
    );
    refused(
        &generate(&["--tokens", "3", "--node-memory-limit", "1G"]),
        &["apply to a split over --nodes N"],
    );
    refused(
        &generate(&["--prompt", "", "--tokens", "3"]),
        &["--prompt: empty"],
    );
    refused(
        &ringtmp(&[
            "generate",
            "--checkpoint",
            &tmp.path().join("none").display().to_string(),
        ]),
        &["no checkpoint here"],
    );
    // An image classifier is not a language model.
    let image = tmp.path().join("image");
    succeeded(&ringtmp(&[
        "train",
        "--strategy",
        "local",
        "--dataset",
        "digits",
        "--max-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--out",
        &image.display().to_string(),
    ]));
    refused(
        &ringtmp(&["generate", "--checkpoint", &image.display().to_string()]),
        &["not a language model's checkpoint", "no vocabulary"],
    );
}

#[test]
fn bad_text_is_an_error_naming_the_file_and_place_that_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never");
    let not_utf8 = write(tmp.path(), "latin1.txt", b"caf\xe9 au lait\n");
    refused(
        &train(&not_utf8, &out, &["--max-steps", "1"]),
        &["latin1.txt", "byte 3", "not UTF-8"],
    );
    let empty = write(tmp.path(), "empty.txt", b"");
    refused(
        &train(&empty, &out, &["--max-steps", "1"]),
        &["empty.txt", "empty"],
    );
    let short = write(tmp.path(), "short.txt", &b"to be or not to be, ".repeat(4));
    refused(
        &train(&short, &out, &["--max-steps", "1"]),
        &["--seq-len 16", "short.txt", "validation"],
    );
    // A nanoGPT .bin (bare u16 ids) with an id past the vocabulary it is read with.
    let ids: Vec<u8> = [1u16, 2, 3, 700, 4]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    let bin = write(tmp.path(), "train.bin", &ids);
    refused(
        &train(&bin, &out, &["--vocab-size", "512", "--max-steps", "1"]),
        &["train.bin", "token 3", "700", "512"],
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());

    // A checkpoint of one text resumed on another whose vocabulary differs.
    let data = write(tmp.path(), "winter.txt", &text());
    let first = tmp.path().join("first");
    succeeded(&train(
        &data,
        &first,
        &[
            "--strategy",
            "local",
            "--max-steps",
            "4",
            "--checkpoint-every",
            "2",
        ],
    ));
    let other = write(
        tmp.path(),
        "other.txt",
        &text()
            .iter()
            .map(|&b| if b == b'w' { b'W' } else { b })
            .collect::<Vec<u8>>(),
    );
    let before = std::fs::read_to_string(first.join("metrics.jsonl")).unwrap();
    let resumed = tmp.path().join("resumed");
    let first_dir = first.display().to_string();
    refused(
        &train(
            &other,
            &resumed,
            &[
                "--strategy",
                "local",
                "--max-steps",
                "8",
                "--resume",
                &first_dir,
            ],
        ),
        &["cannot resume", "vocabulary", "differ at id"],
    );
    assert!(!resumed.exists());
    assert_eq!(
        std::fs::read_to_string(first.join("metrics.jsonl")).unwrap(),
        before
    );
}

#[test]
fn a_byte_level_bpe_tokenizer_feeds_the_ring_and_names_its_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write(tmp.path(), "winter.txt", &text());
    let tokenizer = tmp.path().join("tokenizer.json");
    ringtmp_data::text::train_byte_level_bpe(&[PathBuf::from(&data)], 320, &tokenizer).unwrap();
    let tokenizer = tokenizer.display().to_string();
    let run = tmp.path().join("ring");
    let stdout = succeeded(&train(
        &data,
        &run,
        &[
            "--tokenizer",
            &tokenizer,
            "--strategy",
            "ring",
            "--nodes",
            "2",
            "--max-steps",
            "6",
            "--checkpoint-every",
            "6",
        ],
    ));
    assert!(stdout.contains("bits per token"), "{stdout}");
    let summary = json(run.join("summary.json"));
    let lm = &summary["language"];
    // The bytes and the merges this repetitive text has (at most the 320 asked for).
    let vocab = lm["vocab"].as_u64().unwrap();
    assert!(
        (257..=320).contains(&vocab) && lm["unit"] == "token",
        "{summary}"
    );
    let manifest = json(run.join("checkpoints/step-000000006/manifest.json"));
    assert!(
        manifest["vocabulary"]
            .as_str()
            .is_some_and(|v| v.starts_with("tokenizer:") && v.ends_with(&format!(":{vocab}"))),
        "{manifest}"
    );
    // It generates with its tokenizer, and only with it.
    let run_arg = run.display().to_string();
    let text = succeeded(&ringtmp(&[
        "generate",
        "--checkpoint",
        &run_arg,
        "--tokenizer",
        &tokenizer,
        "--prompt",
        "Now is",
        "--tokens",
        "12",
    ]));
    assert!(text.starts_with("Now is"), "{text}");
    refused(
        &ringtmp(&["generate", "--checkpoint", &run_arg, "--prompt", "Now"]),
        &["trained with a tokenizer", "--tokenizer"],
    );
    // Another tokenizer (fewer merges) cannot continue it.
    let other = tmp.path().join("other.json");
    ringtmp_data::text::train_byte_level_bpe(&[PathBuf::from(&data)], 280, &other).unwrap();
    refused(
        &ringtmp(&[
            "generate",
            "--checkpoint",
            &run_arg,
            "--tokenizer",
            &other.display().to_string(),
        ]),
        &["--tokenizer", "but the model was trained with"],
    );
    let run_dir = run.display().to_string();
    refused(
        &train(
            &data,
            &tmp.path().join("resumed"),
            &[
                "--tokenizer",
                &other.display().to_string(),
                "--strategy",
                "local",
                "--resume",
                &run_dir,
            ],
        ),
        &["cannot resume", "vocabulary", "tokenizer.json"],
    );
}

/// `--tie-embeddings`: the ring trains a tied GPT when the master holds the embedding and the
/// head (the plan says so, and its checkpoint generates), and refuses it where
/// the two would be on different nodes, or where the model has no embedding to tie to.
#[test]
fn a_tied_gpt_trains_where_one_node_holds_both_ends_and_is_refused_elsewhere() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write(tmp.path(), "tied.txt", &text());
    let ring = tmp.path().join("ring");
    let ran = train(
        &data,
        &ring,
        &[
            "--tie-embeddings",
            "--master-holds-head",
            "--nodes",
            "2",
            "--max-steps",
            "6",
            "--checkpoint-every",
            "6",
        ],
    );
    let said = String::from_utf8_lossy(&ran.stderr).into_owned() + &succeeded(&ran);
    assert!(
        said.contains("the head is tied to the token embedding"),
        "{said}"
    );
    let generated = ringtmp(&[
        "generate",
        "--checkpoint",
        &ring.display().to_string(),
        "--prompt",
        "Now",
        "--tokens",
        "5",
    ]);
    succeeded(&generated);
    refused(
        &train(
            &data,
            &tmp.path().join("split"),
            &["--tie-embeddings", "--nodes", "2", "--max-steps", "2"],
        ),
        &[
            "ties its head to its token embedding",
            "--master-holds-head",
        ],
    );
    refused(
        &ringtmp(&[
            "train",
            "--model",
            "mlp",
            "--dataset",
            "digits",
            "--tie-embeddings",
            "--max-steps",
            "1",
            "--out",
            &tmp.path().join("mlp").display().to_string(),
        ]),
        &["tie_embeddings", "does not start with an embedding"],
    );
}
