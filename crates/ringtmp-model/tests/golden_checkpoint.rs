//! Checkpoints across machines: a small model initialised from its seed and stepped
//! twice with SGD momentum on fixed gradients, written here, must be byte for byte the checkpoint
//! in `tests/golden/checkpoint/` (written on x86-64), and that checkpoint must load here into the
//! same values and optimizer state. CI runs this on x86-64 and, cross-built, on aarch64 under
//! qemu-user: a checkpoint written on either loads on the other. It also pins that a seed gives
//! the same initial parameters on both (the layers' generators and normal sampling use no
//! platform maths that could round differently).
//!
//! A deliberate format change updates the files: `RINGTMP_BLESS=1 cargo test -p ringtmp-model
//! --test golden_checkpoint`.

use std::path::{Path, PathBuf};

use ringtmp_model::checkpoint::{self, Manifest};
use ringtmp_model::{ModelSpec, Optimizer, OptimizerConfig, Shape, Stage};

fn spec() -> ModelSpec {
    ModelSpec::from_toml(
        r#"
name = "golden"
[[layer]]
type = "conv2d"
out_channels = 2
kernel = 3
[[layer]]
type = "relu"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 3
"#,
        "golden.toml",
    )
    .unwrap()
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 1e-4,
    }
}

/// The model from seed 11, after two steps on gradients that are exact binary fractions.
fn stepped() -> (Stage, Optimizer, Vec<ringtmp_model::Layer>) {
    let layers = spec().build(&Shape::image(5, 5, 1), 3).unwrap();
    let mut stage = Stage::new(&layers, 0..layers.len(), 11, 1);
    let n = stage.params().len();
    let mut opt = Optimizer::new(sgd(), n);
    let grads: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) / 64.0).collect();
    for _ in 0..2 {
        opt.step(stage.params_mut(), &grads, 0.125, 1);
    }
    (stage, opt, layers)
}

fn write(dir: &Path, stage: &Stage, opt: &Optimizer) {
    let file = checkpoint::write_stage(dir, "stage-0.safetensors", stage, opt).unwrap();
    let manifest = Manifest {
        format: checkpoint::MANIFEST_FORMAT,
        strategy: "local".into(),
        step: opt.steps(),
        epoch: 0,
        batch_in_epoch: opt.steps(),
        dataset: "golden".into(),
        batch_size: 4,
        seed: 11,
        model: spec(),
        partition: vec![(0, stage.layers().len())],
        optimizer: sgd(),
        files: vec![file],
        lr: None,
        replicas: Vec::new(),
        vocabulary: None,
        context: None,
        objective: Default::default(),
        recipe: None,
    };
    checkpoint::write_manifest(dir, &manifest).unwrap();
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/checkpoint")
}

#[test]
fn a_checkpoint_is_the_same_bytes_on_every_machine_and_loads_from_them() {
    let (stage, opt, layers) = stepped();
    if std::env::var_os("RINGTMP_BLESS").is_some() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        write(&golden_dir(), &stage, &opt);
    }
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &stage, &opt);
    for name in ["stage-0.safetensors", "manifest.json"] {
        let here = std::fs::read(tmp.path().join(name)).unwrap();
        let golden = std::fs::read(golden_dir().join(name)).unwrap();
        assert!(
            here == golden,
            "{name}: written differently on this machine ({} bytes, golden {})",
            here.len(),
            golden.len()
        );
    }
    // The golden checkpoint loads into a stage initialised from another seed.
    let manifest = checkpoint::read_manifest(&golden_dir()).unwrap();
    let mut loaded = Stage::new(&layers, 0..layers.len(), 99, 1);
    let mut loaded_opt = Optimizer::new(sgd(), loaded.params().len());
    checkpoint::read_stage(&golden_dir(), &manifest, &mut loaded, &mut loaded_opt).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(loaded.params()), bits(stage.params()));
    for ((_, got), (_, want)) in loaded_opt.state().iter().zip(opt.state()) {
        assert_eq!(bits(got), bits(want));
    }
}

/// A manifest edited by hand (its step changed) is refused, naming what is wrong; so is one
/// whose checksum was removed, with or without its step changed. One of the format that
/// predates checksums, otherwise whole, still reads.
#[test]
fn an_edited_manifest_is_refused() {
    let (stage, opt, _) = stepped();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp
        .path()
        .join(checkpoint::checkpoint_dir_name(opt.steps()));
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, &stage, &opt);
    checkpoint::verify(&dir).unwrap();
    let path = dir.join("manifest.json");
    let original: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let rewrite = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut value = original.clone();
        edit(value.as_object_mut().unwrap());
        std::fs::write(&path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
        checkpoint::verify(&dir)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let earlier = opt.steps() - 1;
    let err = rewrite(&|m| {
        m.insert("step".into(), earlier.into());
    })
    .unwrap_err();
    assert!(err.contains("changed after it was written"), "{err}");
    let err = rewrite(&|m| {
        m.insert("step".into(), earlier.into());
        m.remove("integrity");
    })
    .unwrap_err();
    assert!(err.contains("lost the checksum"), "{err}");
    // Passed off as a file from before checksums, its step still has to match its directory.
    let err = rewrite(&|m| {
        m.insert("step".into(), earlier.into());
        m.remove("integrity");
        m.insert(
            "format".into(),
            checkpoint::MANIFEST_FORMAT_WITHOUT_CHECKSUM.into(),
        );
    })
    .unwrap_err();
    assert!(
        err.contains(&format!("says step {earlier}")) && err.contains("step-0"),
        "{err}"
    );
    // Its checksum removed: refused, since its format says it was written with one…
    let err = rewrite(&|m| {
        m.remove("integrity");
    })
    .unwrap_err();
    assert!(err.contains("lost the checksum"), "{err}");
    // …and a file of the format before checksums, otherwise whole, still reads.
    rewrite(&|m| {
        m.remove("integrity");
        m.insert(
            "format".into(),
            checkpoint::MANIFEST_FORMAT_WITHOUT_CHECKSUM.into(),
        );
    })
    .unwrap();
}
