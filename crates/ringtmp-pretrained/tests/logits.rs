//! Pretrained models run as ringtmp's chain of layers give `transformers`' logits: five tiny
//! random models of every family (`benches/reference/pretrained_golden.py`: Llama with
//! grouped-query attention and Llama 3's RoPE scaling, Llama with multi-query attention, linear
//! scaling and a tied head, Qwen 2 with its biases, Qwen 3 with its q/k norms and a head size
//! that is not the width over the heads, GPT-2 with its Conv1D weights), whole and split in two
//! stages that each read only their own layers; and the shared SmolLM2 GGUF file, whose logits,
//! chat prompt and greedy answer are `transformers`'.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use ringtmp_model::decode::Decoder;
use ringtmp_model::packed::Activations;
use ringtmp_model::{Layer, Stage};
use ringtmp_pretrained::model::Pretrained;
use ringtmp_pretrained::template::{ChatMessage, ChatTemplate};

/// Every tensor of a safetensors file, as f32 values.
fn tensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
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

/// A stage of `layers[range]` with the model's weights.
fn stage(model: &Pretrained, layers: &[Layer], range: std::ops::Range<usize>) -> Stage {
    model.stage(layers, range, 1).unwrap()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tiny_models_of_every_family_give_transformers_logits_whole_and_split() {
    for name in ["llama-gqa", "llama-tied", "qwen2", "qwen3", "gpt2"] {
        let dir = common::reference(&format!("pretrained/{name}"));
        let golden = tensors(&dir.join("golden.safetensors"));
        let (ids, want) = (&golden["input_ids"], &golden["logits"]);
        let model = Pretrained::open(&dir).unwrap();
        let seq = ids.len() / 2;
        let layers = model.layers(seq).unwrap();
        let n = layers.len();
        let mut whole = stage(&model, &layers, 0..n);
        let got = whole.infer(ids, 2).unwrap().to_vec();
        let err = worst(&got, want);
        println!("{name}: logits within {err:.2e} of transformers'");
        assert!(err < 1e-4, "{name}: {err}");
        // Two stages, the cut after the first block: each reads its own layers' tensors.
        let (mut first, mut second) = (stage(&model, &layers, 0..2), stage(&model, &layers, 2..n));
        let middle = first.infer(ids, 2).unwrap().to_vec();
        let split = second.infer(&middle, 2).unwrap();
        assert!(worst(split, want) < 1e-4, "{name} split");
    }
}

/// Positions decoded one at a time with the KV cache give the full forward's logits.
#[test]
fn decoding_a_pretrained_model_token_by_token_gives_its_forward() {
    for name in ["llama-gqa", "qwen3", "gpt2"] {
        let dir = common::reference(&format!("pretrained/{name}"));
        let golden = tensors(&dir.join("golden.safetensors"));
        let (ids, want) = (&golden["input_ids"], &golden["logits"]);
        let model = Pretrained::open(&dir).unwrap();
        let seq = ids.len() / 2;
        let layers = model.layers(seq).unwrap();
        let whole = stage(&model, &layers, 0..layers.len());
        let mut decoder = Decoder::new(&whole).unwrap();
        let vocab = model.config.vocab;
        for (t, id) in ids[..seq].iter().enumerate() {
            let logits = decoder.step(&whole, &[*id], 1).unwrap();
            let err = worst(logits, &want[t * vocab..(t + 1) * vocab]);
            assert!(err < 1e-4, "{name} position {t}: {err}");
        }
    }
}

#[test]
fn a_tensor_of_another_shape_is_refused_naming_it() {
    let dir = common::reference("pretrained/llama-gqa");
    let model = Pretrained::open(&dir).unwrap();
    // Layers of a model with other heads: the same tensors do not fit them.
    let mut spec = model.spec(12).unwrap();
    if let ringtmp_model::LayerSpec::LlamaBlock { hidden, .. } = &mut spec.layers[1] {
        *hidden = 48;
    }
    let layers = spec
        .build_for(
            &ringtmp_model::Shape::flat(12),
            &ringtmp_model::Shape(vec![12, model.config.vocab]),
        )
        .unwrap();
    let mut stage = Stage::new(&layers, 1..2, 0, 1);
    let err = model.load(&layers, 1..2, stage.params_mut()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("model.layers.0.mlp.gate_proj.weight") && text.contains("[48, 64]"),
        "{text}"
    );
    assert!(
        model
            .spec(65)
            .unwrap_err()
            .to_string()
            .contains("context is 64")
    );
}

/// The shared SmolLM2 file (Q4_1): the chat prompt rendered and tokenised as `transformers`
/// does, the logits at four of its positions within 5e-4 of `transformers`' (the same
/// dequantised weights in f32, summed in another order over 30 blocks), and greedy decoding
/// with the KV cache answering as `transformers` answers.
#[test]
fn smollm2_answers_the_capital_of_france_as_transformers_does() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let golden = tensors(&common::reference("pretrained/smollm2-golden.safetensors"));
    let model = Pretrained::open(&path).unwrap();
    let vocabulary = model.vocabulary().unwrap();
    let template = ChatTemplate::new(
        vocabulary.chat_template.as_deref().unwrap(),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    let prompt = template
        .render(
            &[ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            }],
            true,
            &serde_json::Map::new(),
        )
        .unwrap();
    let ids: Vec<f32> = vocabulary
        .tokenizer
        .encode(prompt.as_str(), false)
        .unwrap()
        .get_ids()
        .iter()
        .map(|&i| i as f32)
        .collect();
    assert_eq!(ids, golden["prompt_ids"], "the prompt's ids");
    let layers = model.layers(ids.len()).unwrap();
    let mut whole = stage(&model, &layers, 0..layers.len());
    let logits = whole.infer(&ids, 1).unwrap().to_vec();
    let vocab = model.config.vocab;
    let want = &golden["prompt_logits"];
    for (k, &row) in golden["logit_rows"].iter().enumerate() {
        let row = row as usize;
        let err = worst(
            &logits[row * vocab..(row + 1) * vocab],
            &want[k * vocab..(k + 1) * vocab],
        );
        println!("SmolLM2 position {row}: logits within {err:.2e} of transformers'");
        assert!(err < 5e-4, "position {row}: {err}");
    }
    // Greedy decoding with the KV cache, in a stage as long as the answer needs.
    let answer = &golden["answer_ids"];
    let layers = model.layers(ids.len() + answer.len()).unwrap();
    let whole = stage(&model, &layers, 0..layers.len());
    let mut decoder = Decoder::new(&whole).unwrap();
    let mut next = argmax(decoder.step(&whole, &ids, ids.len()).unwrap(), vocab);
    let mut got = Vec::new();
    while got.len() < answer.len() {
        got.push(next as f32);
        next = argmax(decoder.step(&whole, &[next as f32], 1).unwrap(), vocab);
    }
    let text = vocabulary
        .tokenizer
        .decode(&got.iter().map(|&i| i as u32).collect::<Vec<_>>(), false)
        .unwrap();
    println!("SmolLM2: {text:?}");
    assert_eq!(&got, answer, "{text:?}");
}

/// The last row's most likely token.
fn argmax(logits: &[f32], vocab: usize) -> usize {
    let last = &logits[logits.len() - vocab..];
    (0..vocab)
        .max_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap()
}

/// The logits of every position of `ids`, decoded in one step (the prompt's path: packed
/// products through the dequantising GEMM) and then position by position (the token path:
/// the matrix–vector kernels), from `stage`.
fn decoded<S: ringtmp_model::packed::DecodeStage>(
    stage: &S,
    ids: &[f32],
    vocab: usize,
) -> Vec<f32> {
    let mut decoder = Decoder::new(stage).unwrap();
    let mut all = decoder.step(stage, ids, ids.len()).unwrap().to_vec();
    assert_eq!(all.len(), ids.len() * vocab);
    decoder.reset();
    for id in ids {
        let row = decoder.step(stage, &[*id], 1).unwrap();
        all.extend_from_slice(row);
    }
    all
}

/// A stage of the whole model in f32 whose packable matrices hold their values rounded to
/// `format` (quantised, then dequantised): what a stage holding them packed computes with.
fn rounded(model: &Pretrained, layers: &[Layer], format: ringtmp_model::packed::Format) -> Stage {
    use ringtmp_model::packed::{PackedTensor, packable};
    let mut whole = stage(model, layers, 0..layers.len());
    let params = whole.params_mut();
    let mut at = 0;
    for layer in layers {
        for ((_, shape), pack) in layer.param_tensors().into_iter().zip(packable(layer)) {
            let len: usize = shape.iter().product();
            let values = &mut params[at..at + len];
            if pack && let Some(t) = PackedTensor::quantize(format, shape[0], shape[1], values) {
                t.dequantize_rows(0..shape[0], values);
            }
            at += len;
        }
    }
    whole
}

/// Weights held packed for generation give the logits of an f32 stage holding the same
/// values: the tiny models' f32 files held as the file stores them (f32) or as f32 give the f32
/// stage's logits; held as bf16 and q8_0 (converted on load), those of the f32 stage whose
/// matrices were rounded the same way — decoded in one step (the dequantising GEMM) and
/// position by position (the matrix–vector kernels), on two threads; bf16 holds under 60% of
/// f32's bytes (GPT-2, whose blocks stay f32, under 90%).
#[test]
fn held_weights_give_the_logits_of_the_values_they_hold() {
    use ringtmp_model::packed::Format;
    use ringtmp_pretrained::held::WeightsDtype;
    for name in ["llama-gqa", "llama-tied", "qwen2", "qwen3", "gpt2"] {
        let dir = common::reference(&format!("pretrained/{name}"));
        let golden = tensors(&dir.join("golden.safetensors"));
        let ids = &golden["input_ids"][..golden["input_ids"].len() / 2];
        let model = Pretrained::open(&dir).unwrap();
        let vocab = model.config.vocab;
        let layers = model.layers(ids.len()).unwrap();
        let n = layers.len();
        let exact = decoded(&stage(&model, &layers, 0..n), ids, vocab);
        for (dtype, want) in [
            (WeightsDtype::File, exact.clone()),
            (WeightsDtype::F32, exact.clone()),
            (
                WeightsDtype::Bf16,
                decoded(&rounded(&model, &layers, Format::Bf16), ids, vocab),
            ),
            (
                WeightsDtype::Q8_0,
                decoded(&rounded(&model, &layers, Format::Q8_0), ids, vocab),
            ),
        ] {
            let held = model.inference_stage(&layers, 0..n, 2, dtype).unwrap();
            let err = worst(&decoded(&held, ids, vocab), &want);
            let moved = worst(&want, &exact);
            println!(
                "{name} held as {dtype:?}: logits within {err:.2e} of its values' \
                 (rounding moved them {moved:.2e})"
            );
            assert!(err < 1e-4, "{name} {dtype:?}: {err}");
        }
        let bytes = |dtype| {
            model
                .inference_stage(&layers, 0..n, 1, dtype)
                .unwrap()
                .bytes()
        };
        let (f32_bytes, bf16) = (bytes(WeightsDtype::F32), bytes(WeightsDtype::Bf16));
        // GPT-2's blocks stay f32 (only its embedding and head are packed).
        let share = if name == "gpt2" { 9 } else { 6 };
        assert!(
            bf16 * 10 < f32_bytes * share,
            "{name}: bf16 {bf16} of f32 {f32_bytes}"
        );
    }
}

/// SmolLM2's Q4_1 and Q8_0 blocks held as the file stores them (97 MB against 651 MB in f32,
/// its tied head sharing the embedding's table): the logits of the chat prompt, decoded in one
/// step and position by position, within 2e-3 of the dequantised f32 stage's; and split in
/// three stages, the same logits.
#[test]
fn smollm2_held_as_its_file_stores_it_gives_the_dequantised_logits() {
    use ringtmp_pretrained::held::WeightsDtype;
    let Some(path) = common::smollm2() else {
        return;
    };
    let golden = tensors(&common::reference("pretrained/smollm2-golden.safetensors"));
    let ids = &golden["prompt_ids"][..12];
    let model = Pretrained::open(&path).unwrap();
    let vocab = model.config.vocab;
    let layers = model.layers(ids.len()).unwrap();
    let n = layers.len();
    let want = decoded(&stage(&model, &layers, 0..n), ids, vocab);
    let held = model
        .inference_stage(&layers, 0..n, 2, WeightsDtype::File)
        .unwrap();
    let bytes = held.bytes();
    assert!(
        (90e6..110e6).contains(&(bytes as f64)),
        "{bytes} bytes held"
    );
    let err = worst(&decoded(&held, ids, vocab), &want);
    println!("SmolLM2 held as stored ({bytes} bytes): logits within {err:.2e} of f32's");
    assert!(err < 2e-3, "{err}");
    let cuts = [0, 11, 21, n];
    let stages: Vec<_> = cuts
        .windows(2)
        .map(|c| {
            model
                .inference_stage(&layers, c[0]..c[1], 1, WeightsDtype::File)
                .unwrap()
        })
        .collect();
    let mut decoders: Vec<_> = stages.iter().map(|s| Decoder::new(s).unwrap()).collect();
    let mut x = ids.to_vec();
    for (s, d) in stages.iter().zip(&mut decoders) {
        x = d.step(s, &x, ids.len()).unwrap().to_vec();
    }
    assert!(
        worst(&x, &want[..ids.len() * vocab]) < 2e-3,
        "split in three"
    );
    // With the vector quantised to 16 bits for integer products: every position's most likely
    // token the f32 stage's, the logits within a thousandth of their range (a block holding
    // one of the model's outlying values quantises its small ones coarsely).
    let quantised = held.with_activations(Activations::Int16);
    let got = decoded(&quantised, ids, vocab);
    let err = worst(&got, &want);
    let spread = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let argmax = |row: &[f32]| {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap()
    };
    let agree = got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    println!(
        "SmolLM2 with 16-bit vectors: logits within {err:.2e} (up to {spread:.1}); most likely \
         token the same at {agree} of {} positions",
        2 * ids.len()
    );
    assert!(err < 1e-3 * spread, "{err} of {spread}");
    assert_eq!(agree, 2 * ids.len());
}

/// The tiny models written as GGUF files by the `gguf` package (`gguf_models_golden.py`), their
/// matrices in every quantisation type ringtmp reads — F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
/// quantised from the models' weights, Q4_K, Q5_K, Q6_K as random blocks in a Llama of width
/// 256 — under llama.cpp's names and conventions: their logits within 1e-4 of those
/// `transformers` gives for the values the blocks hold, dequantised to f32 and held as the file
/// stores them (decoded in one step and position by position), whole and split in two stages.
#[test]
fn gguf_files_in_every_quantisation_type_give_transformers_logits() {
    use ringtmp_pretrained::held::WeightsDtype;
    for name in [
        "llama-gqa",
        "llama-tied",
        "qwen2",
        "qwen3",
        "gpt2",
        "kquants",
    ] {
        let path = common::reference(&format!("gguf/models/{name}.gguf"));
        let golden = tensors(&common::reference(&format!(
            "gguf/models/{name}.golden.safetensors"
        )));
        let (ids, want) = (&golden["input_ids"], &golden["logits"]);
        let model = Pretrained::open(&path).unwrap();
        let (seq, vocab) = (ids.len() / 2, model.config.vocab);
        let layers = model.layers(seq).unwrap();
        let n = layers.len();
        let got = stage(&model, &layers, 0..n).infer(ids, 2).unwrap().to_vec();
        let err = worst(&got, want);
        println!("{name}.gguf: logits within {err:.2e} of transformers'");
        assert!(err < 1e-4, "{name}: {err}");
        let (mut first, mut second) = (stage(&model, &layers, 0..2), stage(&model, &layers, 2..n));
        let middle = first.infer(ids, 2).unwrap().to_vec();
        assert!(
            worst(second.infer(&middle, 2).unwrap(), want) < 1e-4,
            "{name} split"
        );
        let held = model
            .inference_stage(&layers, 0..n, 2, WeightsDtype::File)
            .unwrap();
        let first_row = &want[..seq * vocab];
        let twice = [first_row, first_row].concat();
        let err = worst(&decoded(&held, &ids[..seq], vocab), &twice);
        println!(
            "{name}.gguf held as stored ({} bytes): within {err:.2e}",
            held.bytes()
        );
        assert!(err < 1e-4, "{name} held: {err}");
        // The vector quantised for the integer products: to 16 bits, the logits within 1e-3
        // still; to 8 bits (llama.cpp's), each product moves by up to half a step of each of
        // its values, the logits by a few hundredths of their spread.
        let spread = twice.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (activations, bound) in [
            (Activations::Int16, 1e-3),
            (Activations::Int8, 0.03 * spread),
        ] {
            let quantised = held.clone().with_activations(activations);
            let err = worst(&decoded(&quantised, &ids[..seq], vocab), &twice);
            println!(
                "{name}.gguf with {activations:?} vectors: within {err:.2e} (logits up to {spread:.2})"
            );
            assert!(err < bound, "{name} {activations:?}: {err} of {spread}");
        }
    }
}
