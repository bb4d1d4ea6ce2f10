//! ringtmp's side of `benches/reference/pretrained_generate_speed.py`, measured the same way:
//! the model loaded once, a warm-up generation, then the best of 3 of encoding the prompt
//! (prefill) and of greedy decoding after it — so the two compare like for like (the CLI's
//! `generate` reports a cold first prefill, its mapped pages read for the first time).
//!
//! ```sh
//! python benches/reference/pretrained_generate_speed.py 2 128   # prints the prompt's ids
//! cargo run --release -p ringtmp-pretrained --example generate_speed -- \
//!     ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf 2 128 1,2,3…
//! ```
//! Arguments: the model (a `.gguf` file or a directory), threads, tokens to decode, the
//! prompt's ids (comma-separated), and optionally `--weights-dtype`'s value and
//! `--activations`' (`f32`, `int16`, `int8`).

use std::path::PathBuf;
use std::time::Instant;

use ringtmp_model::generate::{Chain, LocalChain};
use ringtmp_model::packed::Activations;
use ringtmp_pretrained::held::WeightsDtype;
use ringtmp_pretrained::model::Pretrained;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: generate_speed MODEL THREADS TOKENS IDS [WEIGHTS_DTYPE] [ACTIVATIONS]";
    let [path, threads, tokens, ids, rest @ ..] = &args[..] else {
        panic!("{usage}");
    };
    let path = PathBuf::from(path);
    let threads: usize = threads.parse().expect(usage);
    let tokens: usize = tokens.parse().expect(usage);
    let ids: Vec<u32> = ids
        .split(',')
        .map(|i| i.trim().parse().expect(usage))
        .collect();
    let dtype = rest
        .first()
        .map_or(WeightsDtype::File, |d| WeightsDtype::parse(d).expect(usage));
    let activations = rest.get(1).map_or_else(Activations::default_for_cpu, |a| {
        Activations::parse(a).expect(usage)
    });

    let model = Pretrained::open(&path).expect("the model opens");
    let layers = model.layers(ids.len() + tokens.max(8)).expect("its layers");
    let stage = model
        .inference_stage(&layers, 0..layers.len(), threads, dtype)
        .expect("its weights")
        .with_activations(activations);
    let mut chain = LocalChain::new(vec![stage]).expect("a chain");
    let greedy = |logits: &[f32]| {
        (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .expect("logits") as u32
    };
    let mut run = |decode: usize| {
        chain.reset().expect("reset");
        let start = Instant::now();
        let mut next = greedy(&chain.feed(&ids).expect("prefill"));
        let prefill = start.elapsed().as_secs_f64();
        let start = Instant::now();
        for _ in 1..decode {
            next = greedy(&chain.feed(&[next]).expect("a token"));
        }
        (prefill, (decode - 1) as f64 / start.elapsed().as_secs_f64())
    };
    run(8);
    let (mut prefill, mut rate) = (f64::INFINITY, 0.0f64);
    let runs: usize = std::env::var("RUNS").map_or(3, |r| r.parse().expect("RUNS"));
    for _ in 0..runs {
        let (p, r) = run(tokens);
        (prefill, rate) = (prefill.min(p), rate.max(r));
    }
    println!(
        "ringtmp ({threads} threads, {activations:?} activations): prompt of {} tokens in \
         {prefill:.3} s, then {rate:.1} tokens/s (best of 3)",
        ids.len()
    );
}
