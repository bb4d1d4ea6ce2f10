//! A mixed-architecture ring end to end: an x86-64 master and an aarch64 node (the
//! cross-built binary under qemu-user), with checkpoints crossing both ways: the aarch64 node
//! loads its layers from a checkpoint written on x86-64, writes its own stage file, and an
//! x86-64 run resumes from that. `.ci/run` cross-builds the binary first and sets
//! RINGTMP_REQUIRE_ARM=1, so in CI a missing binary or qemu fails the test; elsewhere it is
//! skipped with a notice. `RINGTMP_ARM_BINARY` names another binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ringtmp_testkit::process::{finish, free_port, stderr};

const SECRET: &str = "0123456789abcdef-mixed-arch-secret";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The aarch64 binary and the qemu-user command that runs it, or why not.
fn arm_node() -> Result<(PathBuf, Vec<String>), String> {
    let binary = std::env::var_os("RINGTMP_ARM_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/aarch64-unknown-linux-gnu/release/ringtmp"));
    if !binary.is_file() {
        return Err(format!(
            "{} not found (cargo build --release -p ringtmp-cli --target \
             aarch64-unknown-linux-gnu; .ci/run does)",
            binary.display()
        ));
    }
    let qemu = Command::new("qemu-aarch64-static")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !qemu.is_ok_and(|s| s.success()) {
        return Err("qemu-aarch64-static not found (apt-get install qemu-user-static)".into());
    }
    Ok((
        binary,
        vec![
            "qemu-aarch64-static".into(),
            "-L".into(),
            "/usr/aarch64-linux-gnu".into(),
        ],
    ))
}

fn x86() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ringtmp"));
    c.current_dir(root()).env("RINGTMP_LOG", "warn");
    c
}

fn run(mut c: Command) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (output, _) = finish(child, Duration::from_secs(300));
    output
}

#[test]
fn an_x86_master_and_an_aarch64_node_train_and_share_checkpoints() {
    let (arm, qemu) = match arm_node() {
        Ok(found) => found,
        Err(why) => {
            assert!(
                std::env::var_os("RINGTMP_REQUIRE_ARM").is_none(),
                "RINGTMP_REQUIRE_ARM is set but {why}"
            );
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let (first, mixed, last) = (
        tmp.path().join("x86"),
        tmp.path().join("mixed"),
        tmp.path().join("x86-again"),
    );
    let common = [
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--eval-every",
        "0",
    ];
    // 1. x86-64 alone writes a checkpoint at step 4.
    let mut c = x86();
    c.args(["train", "--strategy", "local", "--max-steps", "4"])
        .args(["--checkpoint-every", "4", "--out"])
        .arg(&first)
        .args(common);
    let o = run(c);
    assert!(o.status.success(), "{}", stderr(&o));

    // 2. The mixed ring resumes from it: the aarch64 node loads its layers from the x86-64
    // file, both train to step 8 and checkpoint (each node writes its own stage file).
    let config = tmp.path().join("ring.toml");
    std::fs::write(
        &config,
        format!(
            "strategy = \"ring\"\ndataset = \"digits\"\nmodel = \"mlp\"\nbatch-size = 32\n\
             max-steps = 8\neval-every = 0\ncheckpoint-every = 8\nresume = {:?}\nout = {:?}\n",
            first.display().to_string(),
            mixed.display().to_string()
        ),
    )
    .unwrap();
    let port = free_port().to_string();
    let env = [
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
        ("RINGTMP_SECRET", SECRET),
        ("RINGTMP_LOG", "warn"),
    ];
    let cache = tmp.path().join("cache");
    let node = Command::new(&qemu[0])
        .args(&qemu[1..])
        .arg(&arm)
        .args(["node", "--job", "train", "--connect-timeout", "120"])
        .envs(env)
        .env("RANK", "1")
        .env("RINGTMP_CACHE_DIR", &cache)
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut c = x86();
    c.args([
        "node",
        "--job",
        "train",
        "--connect-timeout",
        "120",
        "--config",
    ])
    .arg(&config)
    .envs(env)
    .env("RANK", "0")
    .env("RINGTMP_CACHE_DIR", &cache);
    let master = run(c);
    let (node, _) = finish(node, Duration::from_secs(300));
    let log = stderr(&master);
    assert!(master.status.success(), "rank 0: {log}");
    assert!(node.status.success(), "rank 1 (aarch64): {}", stderr(&node));
    // Planned from the aarch64 node's own profile, which says what it is.
    assert!(log.contains("nodes' own profiles"), "{log}");
    let line = log
        .lines()
        .find(|l| l.trim_start().starts_with("node 1: ") && l.contains("speed"))
        .unwrap_or_else(|| panic!("no profile line for node 1: {log}"));
    assert!(line.contains("neon"), "{line}");
    assert!(log.contains("resuming from"), "{log}");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(mixed.join("checkpoints/step-000000008/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["files"].as_array().unwrap().len(), 2, "{manifest}");

    // 3. x86-64 alone resumes from the mixed checkpoint (stage 1's file written on aarch64).
    let mut c = x86();
    c.args([
        "train",
        "--strategy",
        "local",
        "--max-steps",
        "10",
        "--resume",
    ])
    .arg(&mixed)
    .arg("--out")
    .arg(&last)
    .args(common);
    let o = run(c);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(last.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 10, "{summary}");
    assert!(
        summary["final_test_accuracy"].as_f64().unwrap() > 0.3,
        "{summary}"
    );
}
