//! Data and models small enough for tests that run in well under a second each.

use std::sync::OnceLock;

use ringtmp_data::Dataset;
use ringtmp_model::{LrSchedule, ModelSpec, OptimizerConfig};
use ringtmp_strategy::{Defaulted, Origin, TrainConfig};

/// The shared SmolLM2-135M-Instruct file (`../shared/models`, beside the repository), when
/// present; a test given `None` skips with the printed reason. Required where
/// `RINGTMP_REQUIRE_SHARED_MODEL` is set (CI).
pub fn shared_smollm2() -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("RINGTMP_REQUIRE_SHARED_MODEL").is_none(),
        "RINGTMP_REQUIRE_SHARED_MODEL is set but {} is absent",
        path.display()
    );
    eprintln!("SKIPPED: {} is absent", path.display());
    None
}

/// scikit-learn's digits (1,500 training and 297 test images of 8×8), bundled with the
/// repository; loaded once per test process.
pub fn digits() -> Dataset {
    static DIGITS: OnceLock<Dataset> = OnceLock::new();
    DIGITS
        .get_or_init(|| ringtmp_data::load("digits", None).expect("the bundled digits load"))
        .clone()
}

/// A regression table written to `dir/regression.csv` and loaded: 4 input columns, two targets
/// (`y0` linear in the inputs, `y1` not), 480 training and 120 test rows, standardised. The
/// values come from a fixed arithmetic sequence, so the file is the same on every machine.
pub fn regression_data(dir: &std::path::Path) -> Dataset {
    let path = dir.join("regression.csv");
    let mut text = String::from("a,b,c,d,y0,y1\n");
    for i in 0..600u32 {
        // Quasi-random inputs in [0, 1) (golden-ratio sequences), far from a grid.
        let u = |k: u32| ((i * 7 + k * 13) as f64 * 0.618_033_988_75 + f64::from(k) * 0.1).fract();
        let (a, b, c, d) = (u(1), u(2), u(3), u(4));
        let y0 = 3.0 * a - 2.0 * b + 0.5 * c + 10.0;
        let y1 = (a * b) * 40.0 + d * d * 5.0 - c;
        text.push_str(&format!("{a:.6},{b:.6},{c:.6},{d:.6},{y0:.6},{y1:.6}\n"));
    }
    std::fs::write(&path, text).expect("a writable test directory");
    let mut source = ringtmp_data::DataSource::new("csv", vec![path]);
    source.target_columns = vec!["y0".into(), "y1".into()];
    source.validation = 0.2;
    ringtmp_data::load_source(&source).expect("the regression table loads")
}

/// A model from TOML text.
///
/// # Panics
/// If the text is not a valid model (a bug in the test).
pub fn model(toml: &str, name: &str) -> ModelSpec {
    ModelSpec::from_toml(toml, name).expect("a valid test model")
}

/// A small GPT over a vocabulary of `vocab` ids: token and position embeddings of `width`, two
/// blocks of two heads, the final LayerNorm and an LM head (five layers: a ring cuts it between
/// any two).
pub fn gpt(vocab: usize, width: usize) -> ModelSpec {
    use ringtmp_model::LayerSpec::{Block, Embedding, LayerNorm, Linear};
    ModelSpec {
        name: format!("gpt-{width}"),
        layers: vec![
            Embedding {
                vocab,
                width,
                positions: true,
            },
            Block {
                heads: 2,
                mlp_ratio: 4,
            },
            Block {
                heads: 2,
                mlp_ratio: 4,
            },
            LayerNorm {
                eps: ringtmp_model::layers::NORM_EPS,
            },
            Linear {
                out: vocab,
                bias: true,
            },
        ],
        tie_embeddings: false,
        stale_momentum: None,
    }
}

/// [`gpt`] with its head tied to its token embedding (one matrix).
pub fn tied_gpt(vocab: usize, width: usize) -> ModelSpec {
    ModelSpec {
        tie_embeddings: true,
        ..gpt(vocab, width)
    }
}

/// A small convolutional model for the digits: conv 6×3×3 → ReLU → pool → 48 → ReLU → dropout →
/// 32 → ReLU → 10 (ten layers, so a ring can cut it many ways).
pub const CONV_MODEL: &str = r#"
name = "ring-test"
[[layer]]
type = "conv2d"
out_channels = 6
kernel = 3
padding = 1
[[layer]]
type = "relu"
[[layer]]
type = "max_pool2d"
kernel = 2
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 48
[[layer]]
type = "relu"
[[layer]]
type = "dropout"
p = 0.2
[[layer]]
type = "linear"
out = 32
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 10
"#;

/// A small multi-layer perceptron for the digits: 64 → 48 → ReLU → dropout → 10.
pub const MLP_MODEL: &str = r#"
name = "ps-test"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 48
[[layer]]
type = "relu"
[[layer]]
type = "dropout"
p = 0.1
[[layer]]
type = "linear"
out = 10
"#;

/// A deep, narrow perceptron with `hidden` linear layers of `width` (each followed by a ReLU) and
/// a 10-way output: enough layers for a ring of many nodes.
pub fn deep_mlp(hidden: usize, width: usize) -> ModelSpec {
    let mut toml = String::from("name = \"deep-test\"\n[[layer]]\ntype = \"flatten\"\n");
    for _ in 0..hidden {
        toml.push_str(&format!(
            "[[layer]]\ntype = \"linear\"\nout = {width}\n[[layer]]\ntype = \"relu\"\n"
        ));
    }
    toml.push_str("[[layer]]\ntype = \"linear\"\nout = 10\n");
    model(&toml, "deep-test")
}

/// The largest difference between `a` and `b`, relative to the largest magnitude in `b`.
///
/// # Panics
/// If the lengths differ.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "parameter vectors of different lengths");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
        / scale.max(f64::MIN_POSITIVE)
}

/// A small run on the digits: `steps` steps of `batch` (one epoch's schedule), SGD with momentum
/// 0.9 and weight decay 1e-4 at 0.05, one thread, seed 17, no evaluations or checkpoints but at
/// the end, a 30 s receive timeout. Tests change what they are about with `..` updates.
pub fn train_config(
    spec: ModelSpec,
    batch: usize,
    steps: u64,
    out: &std::path::Path,
) -> TrainConfig {
    TrainConfig {
        model: spec,
        dataset: "digits".into(),
        wire_dtype: ringtmp_wire::Dtype::F32,
        data_dir: None,
        epochs: 1,
        batch_size: batch,
        lr: Defaulted::given(0.05),
        momentum: Origin::Given,
        threads_from_machine: false,
        schedule: Defaulted::given(LrSchedule::Constant),
        warmup_steps: Defaulted::given(0),
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 1e-4,
        },
        threads: 1,
        seed: 17,
        target_accuracy: 0.5,
        eval_every: 0,
        out: out.to_path_buf(),
        checkpoint_every: 0,
        keep_checkpoints: None,
        resume: None,
        max_steps: Some(steps),
        train_samples: None,
        min_samples: None,
        keep_best: false,
        early_stop: None,
        recv_timeout_secs: 30.0,
        stall_timeout_secs: None,
        clip_grad_norm: None,
        text: None,
        source: None,
        init_from: None,
    }
}

/// A character-level text of a few thousand characters, windows of 8.
pub fn text_data(dir: &std::path::Path) -> (Dataset, ringtmp_strategy::TextSource) {
    let line = "The quality of mercy is not strained; it droppeth as the gentle rain from heaven \
                upon the place beneath. It is twice blest: it blesseth him that gives and him \
                that takes.\n";
    let path = dir.join("mercy.txt");
    std::fs::write(&path, line.repeat(20)).unwrap();
    let text = ringtmp_strategy::TextSource {
        files: vec![path],
        seq_len: 8,
        validation: 0.1,
        eval_tokens: 64,
        bin_vocab: 0,
        tokenizer: None,
    };
    (
        ringtmp_data::load_text_dataset(&text.options()).unwrap(),
        text,
    )
}

/// The checkpoint directories (`step-…`) under a run's `checkpoints/`, sorted.
pub fn step_dirs(out: &std::path::Path) -> Vec<String> {
    let mut dirs: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    dirs.sort();
    dirs
}
