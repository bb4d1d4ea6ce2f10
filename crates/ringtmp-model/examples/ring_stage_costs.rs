//! What a ring stage's step costs outside the ring, for comparing with a ring node's measured
//! compute: `mlp-deep` on two nodes is cut after layer 9 (flatten, 784→1024 and three
//! 1024→1024 layers with their ReLUs | four 1024→1024 layers with ReLUs and the 10-way output),
//! 64 rows, SGD with momentum 0.8, one thread. Each mode alternates its variants within one
//! process, so that a noisy machine slows them alike.
//!
//! ```sh
//! taskset -c 1 cargo run --release -p ringtmp-model --example ring_stage_costs -- MODE [STEPS]
//! ```
//! - `stages`: the whole model's step against the two stages' steps, in turn (their sum over the
//!   whole's is what cutting the model costs by itself).
//! - `stash`: the second stage with four micro-batches in flight, without and with weight
//!   stashing (a new weight version per step, as an async ring node keeps them), in turn.
//! - `gaps`: the second stage's step, in blocks of four steps followed by 3 ms of sleep against
//!   blocks without (a ring node idles between micro-batches; does the next step pay for it?).
//! - `contend`: the second stage's step while a second thread runs the first stage's steps,
//!   against while that thread sleeps, in blocks of 20 steps (run without `taskset`: the two
//!   threads then take a core each, as two pinned ring nodes do).
//! - `pipeline`: the two stages as an async ring of two runs them, in one process — a thread each
//!   (run without `taskset`), the first keeping three micro-batches in flight, activations and
//!   input gradients passed through channels, weight stashing on — against each stage's step
//!   alone on one thread, in alternating rounds. No sockets, sealing, I/O threads or processes:
//!   where a ring node's compute exceeds its stage's alone and this mode's does not, the extra
//!   is in what the mode leaves out; where this mode's does too, it is in two stages computing
//!   at once.
//!
//! - `cut [STEPS] [SPLIT]`: `pipeline`'s two stages against the same with the second stage's
//!   first layer cut inside after SPLIT of its outputs (default 320), its head joining the
//!   first stage (`ringtmp_model::layers::cut_linear`), in alternating rounds: what a finer cut
//!   than whole layers would give the pair.
//!
//! - `parts [STEPS] [SPLIT]`: layer 9 cut after SPLIT outputs (default 320), its head and its
//!   tail each a stage of one layer, against plain linear layers of the same shapes (1024 →
//!   SPLIT, 1024 → 1024 − SPLIT) and the whole 1024 → 1024 layer, in alternating rounds: what
//!   the parts' gathers and copies cost beside the GEMMs, with nothing else in cache's way.
//!
//! Prints ms per step for each variant and their ratio.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ringtmp_model::{Layer, ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage};

const ROWS: usize = 64;
const CUT: usize = 9;
const WARMUP: u64 = 20;

/// A stage of `layers[range]` with its optimizer.
struct Run {
    stage: Stage,
    optimizer: Optimizer,
    x: Vec<f32>,
    dy: Vec<f32>,
}

impl Run {
    fn new(layers: &[Layer], range: std::ops::Range<usize>, input_grad: bool) -> Self {
        let (first, last) = (&layers[range.start], &layers[range.end - 1]);
        let mut stage = Stage::new(layers, range, 1, 1);
        stage.set_input_grad(input_grad);
        let config = OptimizerConfig::Sgd {
            momentum: 0.8,
            weight_decay: 0.0,
        };
        let optimizer = Optimizer::new(config, stage.params().len());
        let x = (0..ROWS * first.input.numel())
            .map(|i| (i % 17) as f32 * 0.01)
            .collect();
        let dy = vec![1e-4; ROWS * last.output.numel()];
        Self {
            stage,
            optimizer,
            x,
            dy,
        }
    }

    fn forward(&mut self, id: u64) {
        let pass = Pass {
            train: true,
            seed: 1,
            step: 0,
            row_offset: 0,
        };
        self.stage
            .forward(id, &self.x, ROWS, &pass)
            .expect("forward");
    }

    fn backward(&mut self, id: u64) {
        self.stage
            .backward_and_step(id, &self.dy, &mut self.optimizer, 1e-4, &mut || {})
            .expect("backward");
    }

    /// Forward, backward and step of one micro-batch, in seconds.
    fn step(&mut self, id: u64) -> f64 {
        let started = Instant::now();
        self.forward(id);
        self.backward(id);
        started.elapsed().as_secs_f64()
    }
}

/// Mean ms per step of each variant, and the second's over the first's.
fn report(names: [&str; 2], sums: [f64; 2], counts: [usize; 2]) {
    let ms = |k: usize| sums[k] / counts[k].max(1) as f64 * 1e3;
    println!(
        "{}: {:.3} ms a step, {}: {:.3} ms a step, ratio {:.3}",
        names[0],
        ms(0),
        names[1],
        ms(1),
        ms(1) / ms(0)
    );
}

#[expect(
    clippy::too_many_lines,
    reason = "a measurement script: each stage's cost measured and printed in turn"
)]
fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "stages".into());
    let steps: u64 = args.next().map_or(400, |s| s.parse().expect("STEPS"));
    let layers = ModelSpec::preset("mlp-deep", 10)
        .expect("preset")
        .build(&Shape::flat(784), 10)
        .expect("layers");
    let n = layers.len();
    match mode.as_str() {
        "stages" => {
            let mut whole = Run::new(&layers, 0..n, false);
            let mut first = Run::new(&layers, 0..CUT, false);
            let mut second = Run::new(&layers, CUT..n, true);
            let mut sums = [0.0; 3];
            for id in 0..WARMUP + steps {
                let t = [whole.step(id), first.step(id), second.step(id)];
                if id >= WARMUP {
                    sums.iter_mut().zip(t).for_each(|(s, t)| *s += t);
                }
            }
            let ms = |s: f64| s / steps as f64 * 1e3;
            println!(
                "whole: {:.3} ms a step; first stage {:.3}, second {:.3}, together {:.3} \
                 ({:.3} of the whole)",
                ms(sums[0]),
                ms(sums[1]),
                ms(sums[2]),
                ms(sums[1] + sums[2]),
                (sums[1] + sums[2]) / sums[0]
            );
        }
        "stash" => {
            let window = 4;
            let mut runs = [
                Run::new(&layers, CUT..n, true),
                Run::new(&layers, CUT..n, true),
            ];
            runs[1].stage.set_weight_stashing(true);
            let (mut sums, mut counts) = ([0.0; 2], [0; 2]);
            for k in 0..steps + window - 1 {
                for (v, run) in runs.iter_mut().enumerate() {
                    let started = Instant::now();
                    if k < steps {
                        run.forward(k);
                    }
                    if k + 1 >= window {
                        run.backward(k + 1 - window);
                    }
                    if k >= WARMUP {
                        sums[v] += started.elapsed().as_secs_f64();
                        counts[v] += 1;
                    }
                }
            }
            report(["plain", "stashing"], sums, counts);
        }
        "gaps" => {
            let mut run = Run::new(&layers, CUT..n, true);
            let (mut sums, mut counts) = ([0.0; 2], [0; 2]);
            for id in 0..WARMUP + steps {
                let gappy = (id / 4) % 2;
                let t = run.step(id);
                if id >= WARMUP {
                    sums[gappy as usize] += t;
                    counts[gappy as usize] += 1;
                }
                if gappy == 1 {
                    std::thread::sleep(Duration::from_millis(3));
                }
            }
            report(["no gaps", "3 ms gaps"], sums, counts);
        }
        "contend" => {
            let busy = Arc::new(AtomicBool::new(false));
            let stop = Arc::new(AtomicBool::new(false));
            let other = {
                let (busy, stop) = (Arc::clone(&busy), Arc::clone(&stop));
                let mut first = Run::new(&layers, 0..CUT, false);
                std::thread::spawn(move || {
                    let mut id = 0;
                    while !stop.load(Ordering::Relaxed) {
                        if busy.load(Ordering::Relaxed) {
                            first.step(id);
                            id += 1;
                        } else {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                })
            };
            let mut second = Run::new(&layers, CUT..n, true);
            let (mut sums, mut counts) = ([0.0; 2], [0; 2]);
            for id in 0..WARMUP + steps {
                let on = (id / 20) % 2;
                busy.store(on == 1, Ordering::Relaxed);
                let t = second.step(id);
                // The first steps of a block run while the other thread changes over.
                if id >= WARMUP && id % 20 >= 3 {
                    sums[on as usize] += t;
                    counts[on as usize] += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            other.join().expect("the other stage's thread");
            report(["other core idle", "other core busy"], sums, counts);
        }
        "pipeline" => {
            for round in 1..=3 {
                let mut alone = [
                    Run::new(&layers, 0..CUT, false),
                    Run::new(&layers, CUT..n, true),
                ];
                let mut sums = [0.0; 2];
                for run in &mut alone {
                    run.stage.set_weight_stashing(true);
                }
                for id in 0..WARMUP + steps {
                    for (k, run) in alone.iter_mut().enumerate() {
                        let t = run.step(id);
                        if id >= WARMUP {
                            sums[k] += t;
                        }
                    }
                }
                let alone_ms = sums.map(|s| s / steps as f64 * 1e3);
                let (computed, wall) = pipeline(&layers, CUT, steps);
                let piped_ms = computed.map(|s| s / steps as f64 * 1e3);
                println!(
                    "round {round}: alone {:.3} + {:.3} ms a step; in the pipeline {:.3} + {:.3} \
                     ({:.3}x, {:.3}x); pipeline {:.3} ms a micro-batch, {:.2}x the two alone in \
                     turn",
                    alone_ms[0],
                    alone_ms[1],
                    piped_ms[0],
                    piped_ms[1],
                    piped_ms[0] / alone_ms[0],
                    piped_ms[1] / alone_ms[1],
                    wall / steps as f64 * 1e3,
                    (alone_ms[0] + alone_ms[1]) / (wall / steps as f64 * 1e3)
                );
            }
        }
        "cut" => {
            // The first layer of the second stage cut after `split` of its outputs: the head
            // joins the first stage, the tail starts the second.
            let split: usize = args.next().map_or(320, |s| s.parse().expect("SPLIT"));
            let cut_layers = ringtmp_model::layers::cut_linear(&layers, CUT, split).expect("cut");
            for round in 1..=3 {
                let (whole_computed, whole_wall) = pipeline(&layers, CUT, steps);
                let (cut_computed, cut_wall) = pipeline(&cut_layers, CUT + 1, steps);
                let ms = |s: f64| s / steps as f64 * 1e3;
                println!(
                    "round {round}: whole-layer cut {:.3} + {:.3} ms a step, {:.3} ms a \
                     micro-batch; cut inside layer {CUT} after {split} outputs {:.3} + {:.3} ms, \
                     {:.3} ms a micro-batch: {:.3}x",
                    ms(whole_computed[0]),
                    ms(whole_computed[1]),
                    ms(whole_wall),
                    ms(cut_computed[0]),
                    ms(cut_computed[1]),
                    ms(cut_wall),
                    whole_wall / cut_wall
                );
            }
        }
        "parts" => {
            let split: usize = args.next().map_or(320, |s| s.parse().expect("SPLIT"));
            let cut_layers = ringtmp_model::layers::cut_linear(&layers, CUT, split).expect("cut");
            // A model of one linear layer 1024 → `out` (its own output the classes).
            let plain = |out: usize| {
                let spec = format!("name = \"plain\"\n[[layer]]\ntype = \"linear\"\nout = {out}\n");
                ModelSpec::from_toml(&spec, "plain")
                    .expect("spec")
                    .build(&Shape::flat(1024), out)
                    .expect("layers")
            };
            let (whole, head_plain, tail_plain) = (plain(1024), plain(split), plain(1024 - split));
            let mut runs = [
                Run::new(&whole, 0..1, true),
                Run::new(&cut_layers, CUT..CUT + 1, true),
                Run::new(&head_plain, 0..1, true),
                Run::new(&cut_layers, CUT + 1..CUT + 2, true),
                Run::new(&tail_plain, 0..1, true),
            ];
            for round in 1..=3 {
                let mut sums = [0.0; 5];
                for (run, sum) in runs.iter_mut().zip(&mut sums) {
                    for id in 0..WARMUP + steps {
                        let t = run.step(id);
                        if id >= WARMUP {
                            *sum += t;
                        }
                    }
                }
                let ms = |k: usize| sums[k] / steps as f64 * 1e3;
                let share = |rows: usize| ms(0) * rows as f64 / 1024.0;
                println!(
                    "round {round}: whole layer {:.3} ms a step; head {:.3} ({:.2}x a plain \
                     1024→{split}, {:.2}x its share of the whole); tail {:.3} ({:.2}x a plain \
                     1024→{}, {:.2}x its share)",
                    ms(0),
                    ms(1),
                    ms(1) / ms(2),
                    ms(1) / share(split),
                    ms(3),
                    ms(3) / ms(4),
                    1024 - split,
                    ms(3) / share(1024 - split)
                );
            }
        }
        other => {
            panic!("unknown mode {other}: stages, stash, gaps, contend, pipeline, cut or parts")
        }
    }
}

/// A training pass of mini-batch 0.
fn pass() -> Pass {
    Pass {
        train: true,
        seed: 1,
        step: 0,
        row_offset: 0,
    }
}

/// Two stages on a thread each, as an async ring of two: the first keeps `WINDOW` micro-batches
/// in flight and steps on each returning input gradient, the second runs forward, then backward
/// and step, sending its input gradient before its weight gradients. Returns each stage's
/// compute seconds (the copies into messages included, as a node's encoding is) over the `steps`
/// after the warm-up, and the wall seconds those took.
fn pipeline(layers: &[Layer], cut: usize, steps: u64) -> ([f64; 2], f64) {
    const WINDOW: u64 = 3;
    let total = WARMUP + steps;
    let (to_second, from_first) = std::sync::mpsc::channel::<(u64, Vec<f32>)>();
    let (to_first, from_second) = std::sync::mpsc::channel::<(u64, Vec<f32>)>();
    std::thread::scope(|scope| {
        let second = scope.spawn(move || {
            let mut run = Run::new(layers, cut..layers.len(), true);
            run.stage.set_weight_stashing(true);
            let mut seconds = 0.0;
            while let Ok((id, x)) = from_first.recv() {
                let started = Instant::now();
                run.stage.forward(id, &x, ROWS, &pass()).expect("forward");
                let mut sent = None;
                run.stage
                    .backward_sending(
                        id,
                        &run.dy,
                        Some((&mut run.optimizer, 1e-4)),
                        &mut || {},
                        &mut |dx| sent = Some(dx.to_vec()),
                    )
                    .expect("backward");
                if id >= WARMUP {
                    seconds += started.elapsed().as_secs_f64();
                }
                let dx = sent.expect("the second stage makes an input gradient");
                if to_first.send((id, dx)).is_err() {
                    break;
                }
            }
            seconds
        });
        let mut run = Run::new(layers, 0..cut, false);
        run.stage.set_weight_stashing(true);
        let mut seconds = 0.0;
        let mut timed_from = Instant::now();
        let backward = |run: &mut Run, seconds: &mut f64| {
            let (id, dy) = from_second.recv().expect("the second stage's gradient");
            let started = Instant::now();
            run.stage
                .backward_and_step(id, &dy, &mut run.optimizer, 1e-4, &mut || {})
                .expect("backward");
            if id >= WARMUP {
                *seconds += started.elapsed().as_secs_f64();
            }
        };
        for id in 0..total {
            if id >= WINDOW {
                backward(&mut run, &mut seconds);
            }
            if id == WARMUP {
                timed_from = Instant::now();
            }
            let started = Instant::now();
            let output = run
                .stage
                .forward(id, &run.x, ROWS, &pass())
                .expect("forward");
            let message = (id, output.to_vec());
            if id >= WARMUP {
                seconds += started.elapsed().as_secs_f64();
            }
            to_second.send(message).expect("the second stage");
        }
        for _ in 0..WINDOW.min(total) {
            backward(&mut run, &mut seconds);
        }
        let wall = timed_from.elapsed().as_secs_f64();
        drop(to_second);
        let other = second.join().expect("the second stage's thread");
        ([seconds, other], wall)
    })
}
