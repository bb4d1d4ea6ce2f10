//! A server's rules as a table of cases: inputs in order, and what each one makes the server
//! send (or the error it ends with), without a network.

use super::*;
use crate::driver::PsJob;
use ringtmp_contract::{Defaulted, Origin, RunSpec, TrainConfig};
use ringtmp_model::{LrSchedule, ModelSpec, OptimizerConfig};
use ringtmp_wire::Dtype;
use ringtmp_wire::{Control, Message};

const MLP: &str = r#"
name = "ps-table"
[[layer]]
type = "flatten"
[[layer]]
type = "linear"
out = 4
[[layer]]
type = "relu"
[[layer]]
type = "linear"
out = 10
"#;

/// `servers` servers and 2 workers (ranks `servers`, `servers + 1`) under `consistency`, 4
/// iterations of the digits at a worker batch of 4, SGD, no checkpoints.
fn job(servers: usize, consistency: Consistency, clip: Option<f32>, drop_dead: bool) -> PsJob {
    let data = ringtmp_data::load("digits", None).expect("the bundled digits load");
    let cfg = TrainConfig {
        model: ModelSpec::from_toml(MLP, "ps-table").expect("a valid model"),
        wire_dtype: Dtype::F32,
        dataset: "digits".into(),
        data_dir: None,
        epochs: 1,
        batch_size: 8,
        lr: Defaulted::given(0.1),
        momentum: Origin::Given,
        schedule: Defaulted::given(LrSchedule::Constant),
        warmup_steps: Defaulted::given(0),
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        },
        threads: 1,
        threads_from_machine: false,
        seed: 3,
        target_accuracy: 0.5,
        eval_every: 0,
        out: std::env::temp_dir().join("ringtmp-ps-table"),
        checkpoint_every: 0,
        keep_checkpoints: None,
        resume: None,
        max_steps: Some(4),
        train_samples: None,
        min_samples: None,
        keep_best: false,
        early_stop: None,
        recv_timeout_secs: 30.0,
        stall_timeout_secs: None,
        clip_grad_norm: clip,
        text: None,
        source: None,
        init_from: None,
    };
    let mut spec = RunSpec::new(cfg, &data, 8).expect("the run fits the data");
    spec.config.batch_size = 4;
    PsJob {
        spec,
        servers,
        workers: 2,
        consistency,
        node_speeds: Vec::new(),
        drop_dead_workers: drop_dead,
    }
}

/// One step of a case.
enum Step {
    /// Worker `w` pulls for its iteration `clock`.
    Pull(usize, u64),
    /// Worker `w` pushes its gradient (all `g`) of `unit`.
    Push(usize, u64, f32),
    /// Worker `w` finishes.
    Finished(usize),
    /// Worker `w`'s link is lost.
    Lost(usize),
    /// Another server's input.
    Raw(Input),
}

/// What came out, short: `shard w0 c1 u2`, `to 1 Grant`, `recycle`, `step`, `tolerated`,
/// `fatal`, or `error: …`.
fn show(output: &Output) -> String {
    match output {
        Output::Shard {
            worker,
            clock,
            unit,
        } => format!("shard w{worker} c{clock} u{unit}"),
        Output::Send { to, message } => match message {
            Message::Control(Control::Strategy { kind, .. }) => format!("to {to} {kind}"),
            Message::Control(Control::Checkpoint { step, .. }) => {
                format!("to {to} Checkpoint {step}")
            }
            other => format!("to {to} {other:?}"),
        },
        Output::Recycle(_) => "recycle".into(),
        Output::StepDone => "step".into(),
    }
}

/// Runs `steps` on server `s` of `job`; per step, what it sent (joined by `, `).
fn run(job: &PsJob, s: usize, steps: Vec<Step>) -> (Vec<String>, Server<'_>) {
    let mut server = Server::new(job, s).expect("the server opens");
    let shard = server.params().len();
    let rank = |w: usize| (job.servers + w) as u32;
    let mut seen = Vec::new();
    for (t, step) in steps.into_iter().enumerate() {
        let now = t as f64;
        let mut out = Vec::new();
        let mut decision = None;
        let result = match step {
            Step::Pull(w, clock) => server.handle(
                Input::Pull {
                    from: rank(w),
                    clock,
                },
                now,
                &mut out,
            ),
            Step::Push(w, unit, g) => server.handle(
                Input::Push {
                    from: rank(w),
                    header: TensorHeader {
                        run_id: 0,
                        step: 0,
                        micro_batch: unit,
                        tag: TensorTag::ParamGrads,
                        dtype: Dtype::F32,
                        shape: vec![shard as u32],
                    },
                    bytes: std::iter::repeat_n(g.to_le_bytes(), shard)
                        .flatten()
                        .collect(),
                },
                now,
                &mut out,
            ),
            Step::Finished(w) => server.handle(Input::Finished { from: rank(w) }, now, &mut out),
            Step::Lost(w) => server
                .lost(rank(w), "closed".into(), now, &mut out)
                .map(|lost| decision = Some(format!("{lost:?}").to_lowercase())),
            Step::Raw(input) => server.handle(input, now, &mut out),
        };
        let mut line: Vec<String> = out.iter().map(show).collect();
        line.extend(decision);
        if let Err(e) = result {
            line.push(format!("error: {e}"));
        }
        seen.push(line.join(", "));
    }
    (seen, server)
}

/// Checks every case's lines; an expected line ending in `…` matches any line it begins.
fn check(name: &str, seen: &[String], expected: &[&str]) {
    assert_eq!(seen.len(), expected.len(), "{name}: {seen:#?}");
    for (t, (s, e)) in seen.iter().zip(expected).enumerate() {
        let ok = match e.strip_suffix('…') {
            Some(prefix) => s.starts_with(prefix),
            None => s == e,
        };
        assert!(
            ok,
            "{name}, step {t}: got {s:?}, expected {e:?}\nall: {seen:#?}"
        );
    }
}

#[test]
fn bsp_answers_an_iteration_once_every_live_worker_pushed() {
    let job = job(1, Consistency::Bsp, None, false);
    let (seen, server) = run(
        &job,
        0,
        vec![
            Step::Pull(0, 0),
            Step::Pull(1, 0),
            Step::Push(0, 0, 1.0),
            // The next iteration's pull waits for the iteration's mean.
            Step::Pull(0, 1),
            Step::Push(1, 1, 3.0),
            Step::Pull(1, 1),
        ],
    );
    check(
        "bsp",
        &seen,
        &[
            "shard w0 c0 u0",
            "shard w1 c0 u1",
            "",
            "",
            "recycle, recycle, step, shard w0 c1 u2",
            "shard w1 c1 u3",
        ],
    );
    // One SGD step of the mean gradient 2 at rate 0.1, from the seeded start.
    let start = Server::new(&job, 0).expect("opens").params().to_vec();
    for (after, before) in server.params().iter().zip(&start) {
        assert!((after - (before - 0.2)).abs() < 1e-6, "{after} vs {before}");
    }
}

#[test]
fn bsp_ends_on_a_lost_worker_unless_told_to_drop_it() {
    let job = job(1, Consistency::Bsp, None, false);
    let (seen, _) = run(&job, 0, vec![Step::Pull(0, 0), Step::Lost(1)]);
    check("bsp, no dropping", &seen, &["shard w0 c0 u0", "fatal"]);

    let job = self::job(1, Consistency::Bsp, None, true);
    let (seen, server) = run(
        &job,
        0,
        vec![
            Step::Pull(0, 0),
            Step::Pull(1, 0),
            Step::Push(0, 0, 1.0),
            Step::Pull(0, 1),
            // Worker 1 dies before pushing: the iteration is complete without it.
            Step::Lost(1),
            // What it sent before its death was noticed is ignored.
            Step::Push(1, 1, 5.0),
            Step::Lost(1),
        ],
    );
    check(
        "bsp, dropping",
        &seen,
        &[
            "shard w0 c0 u0",
            "shard w1 c0 u1",
            "",
            "",
            "recycle, step, shard w0 c1 u2, tolerated",
            "recycle",
            "tolerated",
        ],
    );
    assert_eq!(server.outcome().dropped.len(), 1);
}

#[test]
fn clipped_bsp_holds_its_answers_until_every_servers_share_of_the_norm_is_in() {
    let job = job(2, Consistency::Bsp, Some(1.0), false);
    let share = |from, iteration| {
        Step::Raw(Input::GradNorm {
            from,
            iteration,
            squared: 4.0,
        })
    };
    let (seen, _) = run(
        &job,
        1,
        vec![
            Step::Pull(0, 0),
            Step::Pull(1, 0),
            Step::Push(0, 0, 1.0),
            Step::Push(1, 1, 1.0),
            // Complete, waiting for server 0's share: pulls are held.
            Step::Pull(0, 1),
            share(0, 0),
            // A share of an iteration already applied is refused.
            share(0, 0),
        ],
    );
    check(
        "clipped bsp on server 1",
        &seen,
        &[
            "shard w0 c0 u0",
            "shard w1 c0 u0",
            "",
            "recycle, recycle, to 0 GradNorm",
            "",
            "shard w0 c1 u0",
            "error: server rank 0's share of the gradient norm for iteration 0 …",
        ],
    );
}

#[test]
fn asynchronous_pushes_are_applied_as_they_come_and_server_zero_grants_the_others() {
    let job = job(2, Consistency::Ssp { staleness: 1 }, None, false);
    let (seen, server) = run(
        &job,
        0,
        vec![
            Step::Pull(0, 0),
            Step::Push(0, 0, 2.0),
            Step::Pull(0, 1),
            Step::Push(0, 1, 2.0),
            Step::Finished(0),
            // A finished worker may leave as it likes; a live one under ASP is dropped.
            Step::Lost(0),
            Step::Lost(1),
        ],
    );
    check(
        "ssp on server 0",
        &seen,
        &[
            "shard w0 c0 u0, to 1 Grant",
            "recycle",
            "shard w0 c1 u1, to 1 Grant",
            "recycle, step",
            "",
            "tolerated",
            "tolerated",
        ],
    );
    assert!(!server.serving(), "every worker finished or dropped");
}

#[test]
fn inputs_outside_the_protocol_are_errors_naming_the_sender() {
    let job = job(2, Consistency::Bsp, None, false);
    let (seen, _) = run(
        &job,
        1,
        vec![
            // Pulling ahead of one's pushes.
            Step::Pull(0, 1),
            // A grant from a worker, a checkpoint entry at server 1, a report from server 0
            // at server 1, a share of the norm where nothing is clipped.
            Step::Raw(Input::Grant {
                from: 2,
                worker: 0,
                unit: 0,
                settled: 0,
            }),
            Step::Raw(Input::Checkpoint {
                from: 0,
                step: 1,
                files: vec![],
            }),
            Step::Raw(Input::Report {
                from: 0,
                nodes: vec![],
            }),
            Step::Raw(Input::GradNorm {
                from: 0,
                iteration: 0,
                squared: 1.0,
            }),
            // A worker's report is kept.
            Step::Raw(Input::Report {
                from: 3,
                nodes: vec!["{}".into()],
            }),
        ],
    );
    check(
        "errors on server 1",
        &seen,
        &[
            "error: server 1: worker rank 2 pulls for iteration 1 after pushing 0",
            "error: server 1: unexpected Grant from rank 2",
            "error: server 1: unexpected Checkpoint from server rank 0",
            "error: server 1: unexpected Report from server rank 0",
            "error: server 1: unexpected GradNorm from server rank 0",
            "",
        ],
    );
    let (seen, _) = run(
        &job,
        0,
        vec![
            Step::Pull(0, 0),
            Step::Raw(Input::Push {
                from: 2,
                header: TensorHeader {
                    run_id: 0,
                    step: 0,
                    micro_batch: 0,
                    tag: TensorTag::ParamGrads,
                    dtype: Dtype::F32,
                    shape: vec![3],
                },
                bytes: vec![0; 12],
            }),
        ],
    );
    check(
        "a gradient of the wrong size",
        &seen,
        &[
            "shard w0 c0 u0",
            "error: server 0: gradient of 3 values from rank 2, shard has …",
        ],
    );
}
