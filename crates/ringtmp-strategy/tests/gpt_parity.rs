//! A small GPT trained by ringtmp equals the same GPT trained by PyTorch: the same
//! initial weights, the same batches, AdamW with decoupled decay (none on norms, biases and
//! embeddings) and clipping by the global norm on; the per-step losses agree within 1e-4
//! relative over 20 steps. The ring trains the same model to the same losses.
//!
//! The inputs PyTorch needs live in `tests/golden/gpt_parity/`: the initial weights
//! (`init.safetensors`, ringtmp's checkpoint format) and every step's token windows and learning
//! rate (`batches.json`). This test regenerates both and checks they are what is committed, so
//! the golden losses always belong to this build's model. `benches/reference/gpt_parity.py`
//! reads them and writes `tests/golden/gpt_torch.json`, the per-step losses this test compares
//! with, so the check runs where torch is not installed.
//!
//! After a deliberate change (of the initialisation, the sampler or the corpus):
//! `RINGTMP_BLESS=1 cargo test --release -p ringtmp-strategy --test gpt_parity`, then
//! `python3 benches/reference/gpt_parity.py > crates/ringtmp-strategy/tests/golden/gpt_torch.json`.

use std::path::{Path, PathBuf};

use ringtmp_data::{BatchPlan, Dataset, TextOptions};
use ringtmp_model::{LrSchedule, OptimizerConfig, Stage, checkpoint};
use ringtmp_strategy::Defaulted;
use ringtmp_strategy::{Event, TextSource, TrainConfig, train_local};
use serde_json::{Value, json};

const STEPS: u64 = 20;
const BATCH: usize = 4;
const SEQ: usize = 16;
const CLIP: f32 = 0.5;

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// The first 20,000 characters of the bundled Shakespeare, as a file of its own.
fn corpus(dir: &Path) -> PathBuf {
    let bundled = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare");
    let options = TextOptions {
        files: vec![bundled.join("shakespeare.txt.gz")],
        seq_len: SEQ,
        validation: 0.1,
        eval_tokens: 256,
        bin_vocab: 0,
        tokenizer: None,
    };
    let whole = ringtmp_data::load_text_dataset(&options).expect("the bundled corpus loads");
    let ringtmp_data::Task::NextToken { vocab, .. } = &whole.task else {
        panic!("text")
    };
    let (mut x, mut y) = (Vec::new(), Vec::new());
    // Whole windows of the training split's start, decoded back to text.
    let ids: Vec<u32> = (0..20_000 / SEQ as u32)
        .flat_map(|k| {
            whole.train.gather(&[k * SEQ as u32], &mut x, &mut y);
            x.iter().map(|&t| t as u32).collect::<Vec<_>>()
        })
        .collect();
    let path = dir.join("prefix.txt");
    std::fs::write(&path, vocab.decode(&ids).expect("character ids")).unwrap();
    path
}

fn setup(dir: &Path, out: &Path) -> (TrainConfig, Dataset) {
    let text = TextSource {
        files: vec![corpus(dir)],
        seq_len: SEQ,
        validation: 0.1,
        eval_tokens: 256,
        bin_vocab: 0,
        tokenizer: None,
    };
    let data = ringtmp_data::load_text_dataset(&text.options()).unwrap();
    let cfg = TrainConfig {
        optimizer: OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_embeddings: false,
        },
        lr: Defaulted::given(3e-3),
        schedule: Defaulted::given(LrSchedule::CosineTo { min_ratio: 0.1 }),
        warmup_steps: Defaulted::given(5),
        clip_grad_norm: Some(CLIP),
        dataset: "text".into(),
        text: Some(text),
        source: None,
        init_from: None,
        seed: 5,
        ..ringtmp_testkit::fixtures::train_config(
            ringtmp_testkit::fixtures::gpt(data.classes, 32),
            BATCH,
            STEPS,
            out,
        )
    };
    (cfg, data)
}

/// What PyTorch needs besides the weights: each step's windows and learning rate.
fn batches(cfg: &TrainConfig, data: &Dataset) -> Value {
    let spec = ringtmp_strategy::RunSpec::new(cfg.clone(), data, cfg.batch_size).unwrap();
    let mut plan = BatchPlan::new(data.train.len(), cfg.batch_size, cfg.seed).unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let steps: Vec<Value> = (0..STEPS)
        .map(|step| {
            let epoch = step / spec.steps_per_epoch;
            let index = (step % spec.steps_per_epoch) as usize;
            data.train.gather(plan.batch(epoch, index), &mut x, &mut y);
            let x: Vec<u32> = x.iter().map(|&t| t as u32).collect();
            json!({"x": x, "y": y, "lr": spec.lr_at(step)})
        })
        .collect();
    let OptimizerConfig::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
        ..
    } = cfg.optimizer
    else {
        panic!("adamw")
    };
    json!({
        "about": "crates/ringtmp-strategy/tests/gpt_parity.rs (RINGTMP_BLESS=1)",
        "vocab": data.classes, "seq": SEQ, "batch": BATCH, "width": 32, "heads": 2, "blocks": 2,
        "betas": [beta1, beta2], "eps": eps, "weight_decay": weight_decay, "clip": CLIP,
        "steps": steps,
    })
}

fn initial_weights(cfg: &TrainConfig, data: &Dataset, dir: &Path) -> Vec<u8> {
    let layers = ringtmp_strategy::layers_for(&cfg.model, data).unwrap();
    let stage = Stage::new(&layers, 0..layers.len(), cfg.seed, 1);
    checkpoint::write_params(dir, "init.safetensors", &stage, stage.params()).unwrap();
    std::fs::read(dir.join("init.safetensors")).unwrap()
}

fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["event"] == "step")
        .map(|e| e["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn a_small_gpt_trains_as_pytorch_trains_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (cfg, data) = setup(tmp.path(), &out);
    let inputs = golden().join("gpt_parity");
    let weights = initial_weights(&cfg, &data, tmp.path());
    let batches = serde_json::to_string(&batches(&cfg, &data)).unwrap() + "\n";
    if std::env::var_os("RINGTMP_BLESS").is_some() {
        std::fs::create_dir_all(&inputs).unwrap();
        std::fs::write(inputs.join("init.safetensors"), &weights).unwrap();
        std::fs::write(inputs.join("batches.json"), &batches).unwrap();
        eprintln!(
            "wrote {}: now run benches/reference/gpt_parity.py",
            inputs.display()
        );
        return;
    }
    assert!(
        std::fs::read(inputs.join("init.safetensors")).unwrap() == weights
            && std::fs::read_to_string(inputs.join("batches.json")).unwrap() == batches,
        "the committed PyTorch inputs are not this build's: re-bless (see the header)"
    );
    let torch: Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("gpt_torch.json")).unwrap())
            .unwrap();
    let want: Vec<f64> = torch["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(want.len(), STEPS as usize);
    // Clipping must have acted, or the test would not test it.
    assert!(
        torch["grad_norms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_f64().unwrap() > f64::from(CLIP)),
        "no step's gradient was clipped"
    );
    train_local(&cfg, &data, &mut |_: &Event| {}).unwrap();
    let got = losses(&out);
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs() / w.abs())
        .fold(0.0, f64::max);
    eprintln!("largest relative difference from PyTorch's losses over {STEPS} steps: {worst:.2e}");
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel <= 1e-4,
            "step {step}: ringtmp's loss {g} against PyTorch's {w} (relative {rel:.2e})\n\
             ringtmp {got:?}\nPyTorch {want:?}"
        );
    }
    assert!(got.last() < got.first(), "it learns: {got:?}");
}
