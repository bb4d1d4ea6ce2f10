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
    // A checkpoint directory is named for its step, and its manifest must say the same.
    let step = dir
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse().ok())
        .unwrap_or(opt.steps());
    write_manifest(dir, "ps", step, spec, partition, files);
}

/// Writes the manifest of a test checkpoint of `files` (layer ranges `partition`) at `step`.
fn write_manifest(
    dir: &std::path::Path,
    strategy: &str,
    step: u64,
    spec: &ModelSpec,
    partition: Vec<(usize, usize)>,
    files: Vec<checkpoint::FileEntry>,
) {
    let manifest = Manifest {
        format: checkpoint::MANIFEST_FORMAT,
        strategy: strategy.into(),
        step,
        epoch: 0,
        batch_in_epoch: step,
        dataset: "test".into(),
        batch_size: 8,
        seed: 3,
        model: spec.clone(),
        partition,
        optimizer: adam(),
        files,
        lr: None,
        replicas: Vec::new(),
        vocabulary: None,
        context: None,
        objective: Default::default(),
        recipe: None,
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

// Failed checkpoints are cleaned, old ones pruned on request, and a `latest` that
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

/// `--resume auto` and automatic restarts take the newest checkpoint that verifies —
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
    assert_eq!(manifest.step, 10);
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

/// The values a stage of a model cut inside its layers holds, taken from the unsplit model's
/// flat vector `whole` (laid out as `whole_stage`): whole layers' ranges, and a head's or a
/// tail's rows of its layer's weight and bias.
fn rows_of(stage: &Stage, whole_stage: &Stage, whole: &[f32]) -> Vec<f32> {
    use ringtmp_model::LayerKind;
    let range_of = |index: usize| {
        whole_stage
            .param_ranges()
            .find(|(l, _)| l.index == index)
            .map(|(_, r)| r)
            .unwrap()
    };
    let mut out = Vec::new();
    for (layer, _) in stage.param_ranges() {
        let r = range_of(layer.index);
        let part = |p: &ringtmp_model::layers::LinearPart, head: bool| {
            let (w, b) = whole[r.clone()].split_at(p.in_features * p.out_features);
            let rows = if head {
                0..p.split
            } else {
                p.split..p.out_features
            };
            let mut v = w[rows.start * p.in_features..rows.end * p.in_features].to_vec();
            v.extend_from_slice(&b[rows]);
            v
        };
        match &layer.kind {
            LayerKind::LinearHead(p) => out.extend(part(p, true)),
            LayerKind::LinearTail(p) => out.extend(part(p, false)),
            _ => out.extend_from_slice(&whole[r]),
        }
    }
    out
}

/// Writes each stage's file and the manifest (layer ranges in the model's indices).
fn write_stages(dir: &std::path::Path, stages: &[(&Stage, &Optimizer)], spec: &ModelSpec) {
    let (mut files, mut partition) = (Vec::new(), Vec::new());
    for (s, (stage, opt)) in stages.iter().enumerate() {
        files.push(
            checkpoint::write_stage(dir, &format!("stage-{s}.safetensors"), stage, opt).unwrap(),
        );
        let last = stage.layers().last().unwrap().index + 1;
        partition.push((stage.first_layer(), last));
    }
    write_manifest(dir, "ring", 2, spec, partition, files);
}

/// Reads `range` of `layers` from `dir` into a fresh stage and its optimizer.
fn read(
    dir: &std::path::Path,
    layers: &[ringtmp_model::Layer],
    range: std::ops::Range<usize>,
) -> (Stage, Optimizer) {
    let manifest = checkpoint::read_manifest(dir).unwrap();
    let mut stage = Stage::new(layers, range, 99, 1);
    let mut opt = Optimizer::new(adam(), stage.params().len());
    checkpoint::read_stage(dir, &manifest, &mut stage, &mut opt).unwrap();
    (stage, opt)
}

// A model cut inside a linear layer (the ring's finer cut) checkpoints as the unsplit model: its
// head and tail store their rows as pieces of the layer's tensors, which an unsplit model, or one
// cut elsewhere, reads back exactly (values and optimizer state), and it reads an unsplit
// model's checkpoint.
#[test]
fn a_model_cut_inside_a_layer_checkpoints_as_the_unsplit_model() {
    let (whole, opt, layers, spec) = trained();
    let state =
        |o: &Optimizer| -> Vec<Vec<f32>> { o.state().iter().map(|(_, v)| v.to_vec()).collect() };
    let tmp = tempfile::tempdir().unwrap();
    // The whole model's checkpoint, read into two stages cut inside layer 2 (7 → 5) after 2 rows.
    let unsplit = tmp.path().join("unsplit");
    write_stages(&unsplit, &[(&whole, &opt)], &spec);
    let cut = ringtmp_model::layers::cut_linear(&layers, 2, 2).unwrap();
    let mut stages = Vec::new();
    for range in [0..3, 3..cut.len()] {
        let (stage, stage_opt) = read(&unsplit, &cut, range);
        assert_eq!(
            stage.params(),
            rows_of(&stage, &whole, whole.params()).as_slice()
        );
        for (got, want) in state(&stage_opt).iter().zip(state(&opt)) {
            assert_eq!(got, &rows_of(&stage, &whole, &want));
        }
        stages.push((stage, stage_opt));
    }
    // Those two stages' checkpoint, read into the unsplit model and into one cut after 3 rows.
    let split = tmp.path().join("split");
    let refs: Vec<(&Stage, &Optimizer)> = stages.iter().map(|(s, o)| (s, o)).collect();
    write_stages(&split, &refs, &spec);
    let (back, back_opt) = read(&split, &layers, 0..layers.len());
    assert_eq!(back.params(), whole.params());
    assert_eq!(state(&back_opt), state(&opt));
    let other = ringtmp_model::layers::cut_linear(&layers, 2, 3).unwrap();
    for range in [0..3, 3..other.len()] {
        let (stage, stage_opt) = read(&split, &other, range);
        assert_eq!(
            stage.params(),
            rows_of(&stage, &whole, whole.params()).as_slice()
        );
        for (got, want) in state(&stage_opt).iter().zip(state(&opt)) {
            assert_eq!(got, &rows_of(&stage, &whole, &want));
        }
    }
}
