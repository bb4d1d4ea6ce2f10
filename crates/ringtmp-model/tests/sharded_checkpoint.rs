//! Checkpoints written in shards that cut tensors (a parameter server's flat key ranges) load
//! into any stage partition and any other shard count, values and optimizer state exactly, and a
//! missing piece is an error naming the tensor.

use ringtmp_model::checkpoint::{self, Manifest};
use ringtmp_model::{ModelSpec, Optimizer, OptimizerConfig, Shape, Stage};

fn model() -> (Vec<ringtmp_model::Layer>, ModelSpec) {
    let spec = ModelSpec::from_toml(
        r#"
name = "shards"
[[layer]]
type = "linear"
out = 7
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 5
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 3
"#,
        "shards.toml",
    )
    .unwrap();
    (spec.build(&Shape::flat(6), 3).unwrap(), spec)
}

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

/// A whole model with distinct values and optimizer state (two Adam steps on fixed gradients).
fn trained() -> (Stage, Optimizer, Vec<ringtmp_model::Layer>, ModelSpec) {
    let (layers, spec) = model();
    let mut stage = Stage::new(&layers, 0..layers.len(), 3, 1);
    let n = stage.params().len();
    let mut opt = Optimizer::new(adam(), n);
    let grads: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    for _ in 0..2 {
        opt.step(stage.params_mut(), &grads, 0.01, 1);
    }
    (stage, opt, layers, spec)
}

/// Writes `stage` as `shards` flat ranges (cut points chosen to split tensors) with a manifest.
fn write_shards(
    dir: &std::path::Path,
    stage: &Stage,
    opt: &Optimizer,
    cuts: &[usize],
    spec: &ModelSpec,
) {
    let n = stage.params().len();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(n);
    let (mut files, mut partition) = (Vec::new(), Vec::new());
    for (s, w) in bounds.windows(2).enumerate() {
        let range = w[0]..w[1];
        let mut shard_opt = Optimizer::new(adam(), range.len());
        let state: Vec<(&str, Vec<f32>)> = opt
            .state()
            .iter()
            .map(|(name, v)| (*name, v[range.clone()].to_vec()))
            .collect();
        shard_opt.load_state(&state, opt.steps()).unwrap();
        files.push(
            checkpoint::write_range(
                dir,
                &format!("server-{s}.safetensors"),
                stage,
                range.clone(),
                &stage.params()[range.clone()],
                &shard_opt,
            )
            .unwrap(),
        );
        partition.push(checkpoint::range_layers(stage, &range));
    }
    let manifest = Manifest {
        format: checkpoint::MANIFEST_FORMAT,
        strategy: "ps".into(),
        step: opt.steps(),
        epoch: 0,
        batch_in_epoch: opt.steps(),
        dataset: "test".into(),
        batch_size: 8,
        seed: 3,
        model: spec.clone(),
        partition,
        optimizer: adam(),
        files,
        replicas: Vec::new(),
    };
    checkpoint::write_manifest(dir, &manifest).unwrap();
}

#[test]
fn shards_that_cut_tensors_load_into_stages_and_other_shard_counts() {
    let (whole, opt, layers, spec) = trained();
    let n = whole.params().len();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("step-2");
    // 3 shards, cutting inside the first weight, inside a bias and inside the last weight.
    write_shards(&dir, &whole, &opt, &[20, 47, 70], &spec);
    let manifest = checkpoint::read_manifest(&dir).unwrap();

    // Into two stages (a ring partition): layers 0..2 and 2..5.
    let mut at = 0;
    for range in [0..2, 2..5] {
        let mut stage = Stage::new(&layers, range, 99, 1);
        let len = stage.params().len();
        let mut stage_opt = Optimizer::new(adam(), len);
        checkpoint::read_stage(&dir, &manifest, &mut stage, &mut stage_opt).unwrap();
        assert_eq!(stage.params(), &whole.params()[at..at + len]);
        for ((_, got), (_, want)) in stage_opt.state().iter().zip(opt.state()) {
            assert_eq!(*got, &want[at..at + len]);
        }
        at += len;
    }
    assert_eq!(at, n);

    // Into 2 shards with other cut points.
    for range in [0..33, 33..n] {
        let mut params = vec![0.0; range.len()];
        let mut shard_opt = Optimizer::new(adam(), range.len());
        checkpoint::read_range(
            &dir,
            &manifest,
            &whole,
            range.clone(),
            &mut params,
            &mut shard_opt,
        )
        .unwrap();
        assert_eq!(params, &whole.params()[range.clone()]);
        for ((_, got), (_, want)) in shard_opt.state().iter().zip(opt.state()) {
            assert_eq!(*got, &want[range.clone()]);
        }
        assert_eq!(shard_opt.steps(), 2);
    }
}

#[test]
fn a_missing_piece_is_an_error_naming_the_tensor() {
    let (whole, opt, layers, spec) = trained();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("step-2");
    write_shards(&dir, &whole, &opt, &[20, 47, 70], &spec);
    let mut manifest = checkpoint::read_manifest(&dir).unwrap();
    // Forget the middle shard: the tensors it held pieces of cannot be assembled.
    manifest.files.remove(1);
    manifest.partition.remove(1);
    let mut stage = Stage::new(&layers, 0..layers.len(), 99, 1);
    let before = stage.params().to_vec();
    let mut stage_opt = Optimizer::new(adam(), before.len());
    let err = checkpoint::read_stage(&dir, &manifest, &mut stage, &mut stage_opt)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layers.0.weight") || err.contains("layers.2"),
        "{err}"
    );
    assert!(err.contains("cover") || err.contains("missing"), "{err}");
    assert_eq!(
        stage.params(),
        before.as_slice(),
        "nothing may change on error"
    );
}

// Issue 10.9: failed checkpoints are cleaned, old ones pruned on request, and a `latest` that
// points at a checkpoint without its manifest names the newest intact one.
#[test]
fn r10_incomplete_checkpoints_are_removed_old_ones_pruned_and_intact_ones_named() {
    let (whole, opt, _, spec) = trained();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("checkpoints");
    for step in [10, 20, 30] {
        write_shards(
            &root.join(checkpoint::checkpoint_dir_name(step)),
            &whole,
            &opt,
            &[20],
            &spec,
        );
    }
    // A checkpoint whose writing failed: a file but no manifest; and `latest` pointing at it.
    let broken = root.join(checkpoint::checkpoint_dir_name(40));
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("server-0.safetensors"), b"partial").unwrap();
    std::fs::write(root.join("latest"), checkpoint::checkpoint_dir_name(40)).unwrap();
    let e = checkpoint::resolve(tmp.path()).unwrap_err().to_string();
    assert!(
        e.contains("no manifest.json") && e.contains("step-000000030"),
        "names the newest intact checkpoint: {e}"
    );
    // Damage step 30 (a file shorter than its manifest says): step 20 is then the newest intact.
    std::fs::write(root.join("step-000000030/server-0.safetensors"), b"cut").unwrap();
    assert_eq!(
        checkpoint::newest_intact(&root),
        Some(root.join("step-000000020"))
    );
    assert_eq!(checkpoint::remove_incomplete(&root), vec![broken.clone()]);
    assert!(!broken.exists());
    let removed = checkpoint::retain_newest(&root, 2).unwrap();
    assert_eq!(removed, vec![root.join("step-000000010")]);
    assert!(root.join("step-000000020").is_dir() && root.join("step-000000030").is_dir());
}

/// Issue 14.4: `--resume auto` and automatic restarts take the newest checkpoint that verifies —
/// a missing manifest, a truncated file or a flipped byte (same size, so only the hash tells)
/// is passed over with the file named.
#[test]
fn the_newest_verified_checkpoint_skips_damaged_ones_with_the_file_named() {
    let (whole, opt, _, spec) = trained();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("checkpoints");
    for step in [10, 20, 30, 40] {
        write_shards(
            &root.join(checkpoint::checkpoint_dir_name(step)),
            &whole,
            &opt,
            &[20],
            &spec,
        );
    }
    let file = |step: u64| {
        root.join(checkpoint::checkpoint_dir_name(step))
            .join("server-1.safetensors")
    };
    // 40: no manifest; 30: a byte flipped; 20: truncated.
    std::fs::remove_file(
        root.join(checkpoint::checkpoint_dir_name(40))
            .join("manifest.json"),
    )
    .unwrap();
    let mut bytes = std::fs::read(file(30)).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(file(30), &bytes).unwrap();
    bytes.truncate(last / 2);
    std::fs::write(file(20), &bytes).unwrap();
    let (found, skipped) = checkpoint::newest_verified(&root);
    let (dir, manifest) = found.expect("step 10 is whole");
    assert_eq!(dir, root.join(checkpoint::checkpoint_dir_name(10)));
    assert_eq!(manifest.step, opt.steps());
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert!(skipped[0].contains("manifest.json"), "{}", skipped[0]);
    assert!(
        skipped[1].contains("server-1.safetensors") && skipped[1].contains("SHA-256"),
        "{}",
        skipped[1]
    );
    assert!(
        skipped[2].contains("server-1.safetensors") && skipped[2].contains("truncated"),
        "{}",
        skipped[2]
    );
    // Nothing whole at all: none, every reason given.
    std::fs::write(file(10), b"").unwrap();
    let (found, skipped) = checkpoint::newest_verified(&root);
    assert!(found.is_none() && skipped.len() == 4);
}
