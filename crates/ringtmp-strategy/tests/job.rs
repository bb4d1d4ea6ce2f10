//! Jobs come from `job.json` or from rank 0 over the network, so every node checks one before
//! using it: impossible values are clear errors, never a panic or a division by zero.

use std::path::Path;

use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_strategy::{Defaulted, Job, Origin, TrainConfig};
use ringtmp_testkit::fixtures::{CONV_MODEL, digits, model};
use ringtmp_testkit::jobs::{ps_job, ring_job};

fn config() -> TrainConfig {
    TrainConfig {
        seed: 1,
        max_steps: Some(10),
        ..ringtmp_testkit::fixtures::train_config(
            model(CONV_MODEL, "ring-test"),
            24,
            10,
            Path::new(""),
        )
    }
}

/// `job` through JSON (as `job.json` and the network carry it), then validated for `world`.
fn check(job: &Job, world: u32) -> Result<(), String> {
    let text = serde_json::to_string(job).unwrap();
    let back: Job = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    assert_eq!(&back, job, "a job survives its JSON");
    back.validate(world).map_err(|e| e.to_string())
}

#[test]
fn a_planned_job_is_valid_and_survives_its_json() {
    let data = digits();
    let ring = Job::Ring(ring_job(&config(), &data, &[0, 4, 10], Schedule::Gpipe, 4));
    assert_eq!(check(&ring, 2), Ok(()));
    assert!(check(&ring, 3).unwrap_err().contains("planned for 2 nodes"));
    let ps = Job::Ps(ps_job(&config(), &data, 1, 3, Consistency::Asp));
    assert_eq!(check(&ps, 4), Ok(()));
}

/// A way to spoil a ring job.
type Corruption = Box<dyn Fn(&mut ringtmp_strategy::ring::run::driver::RingJob)>;

#[test]
fn impossible_ring_jobs_are_refused_with_the_reason() {
    let data = digits();
    let base = ring_job(&config(), &data, &[0, 4, 10], Schedule::Gpipe, 4);
    let cases: Vec<(&str, Corruption)> = vec![
        ("micro-batches", Box::new(|j| j.micro_batches = 0)),
        (
            "zero steps per epoch",
            Box::new(|j| j.spec.steps_per_epoch = 0),
        ),
        (
            "recv-timeout",
            Box::new(|j| j.spec.config.recv_timeout_secs = -1.0),
        ),
        (
            "recv-timeout",
            Box::new(|j| j.spec.config.recv_timeout_secs = f64::INFINITY),
        ),
        ("covers layers 0..9", Box::new(|j| j.partition[1].end = 9)),
        (
            "stage 1 holds layers 5..10",
            Box::new(|j| j.partition[1].start = 5),
        ),
        ("node speeds", Box::new(|j| j.node_speeds = vec![1.0])),
        ("node speeds", Box::new(|j| j.node_speeds[1] = 0.0)),
        (
            "steps but the schedule spans",
            Box::new(|j| j.spec.total_steps = 10_000),
        ),
        (
            "resumes at step",
            Box::new(|j| {
                j.spec.resume_from = Some(ringtmp_strategy::ResumePoint {
                    dir: "x".into(),
                    step: 1_000,
                })
            }),
        ),
        ("batch-size", Box::new(|j| j.spec.config.batch_size = 0)),
    ];
    for (needle, corrupt) in cases {
        let mut job = base.clone();
        corrupt(&mut job);
        let err = Job::Ring(job).validate(2).unwrap_err();
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
}

#[test]
fn impossible_parameter_server_jobs_are_refused() {
    let data = digits();
    let base = ps_job(&config(), &data, 1, 3, Consistency::Bsp);
    let mut none = base.clone();
    none.workers = 0;
    none.servers = 4;
    assert!(
        Job::Ps(none)
            .validate(4)
            .unwrap_err()
            .to_string()
            .contains("0 worker")
    );
    let mut slow = base.clone();
    slow.node_speeds = vec![1.0, f64::NAN, 1.0, 1.0];
    assert!(
        Job::Ps(slow)
            .validate(4)
            .unwrap_err()
            .to_string()
            .contains("node speeds")
    );
}

#[test]
fn garbage_is_a_parse_error_not_a_panic() {
    for text in [
        "{}",
        r#"{"strategy": "ring"}"#,
        r#"{"strategy": "gossip"}"#,
        r#"{"strategy": "ps", "servers": -1}"#,
        "[1, 2, 3]",
    ] {
        assert!(serde_json::from_str::<Job>(text).is_err(), "{text}");
    }
}

/// With the schedule left to the strategy, the stale consistency models decay the
/// rate (cosine) so the last epoch's model is not the noisy one; BSP and a user's choice keep
/// theirs.
#[test]
fn stale_parameter_servers_default_to_a_decaying_rate() {
    use ringtmp_model::LrSchedule;
    use ringtmp_strategy::param_server::plan::PsOptions;
    let data = digits();
    let plan = |consistency: &str, default_schedule: bool| {
        let base = config();
        let cfg = TrainConfig {
            schedule: of(base.schedule.clone().into_inner(), default_schedule),
            ..base
        };
        let options = ringtmp_strategy::StrategyOptions {
            ps: PsOptions {
                consistency: Some(consistency.parse().unwrap()),
                ..Default::default()
            },
            ..Default::default()
        };
        let cluster = ringtmp_strategy::Cluster::local(4);
        match Job::plan(
            "ps",
            cfg,
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap()
        {
            Job::Ps(job) => job.spec.schedule.clone().into_inner(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(plan("dssp:1:4", true), LrSchedule::Cosine);
    assert_eq!(plan("asp", true), LrSchedule::Cosine);
    assert_eq!(plan("bsp", true), LrSchedule::Constant);
    assert_eq!(
        plan("asp", false),
        LrSchedule::Constant,
        "the user's choice"
    );
}

/// `--train-samples` is one budget for strategies whose steps differ in size: each
/// plans whole steps that cover it (by less than one of its steps over), and its learning-rate
/// schedule spans exactly the steps it takes.
#[test]
fn a_sample_budget_is_the_same_for_every_strategy() {
    let data = digits();
    let budget = 1_000u64;
    for strategy in ["local", "ring", "ps", "allreduce", "dpsgd", "adpsgd"] {
        let cfg = TrainConfig {
            max_steps: None,
            train_samples: Some(budget),
            ..config()
        };
        let cluster = ringtmp_strategy::Cluster::local(if strategy == "local" { 1 } else { 4 });
        let job = Job::plan(
            strategy,
            cfg,
            &Default::default(),
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap();
        let spec = job.spec();
        let global_batch = match strategy {
            "local" | "ring" => 24,
            "ps" => 3 * 24,
            _ => 4 * 24,
        };
        let covered = spec.total_steps * global_batch;
        assert!(
            covered >= budget && covered < budget + global_batch,
            "{strategy}: {} steps of {global_batch}",
            spec.total_steps
        );
        assert_eq!(spec.schedule_steps, spec.total_steps, "{strategy}");
    }
}

/// Defaults tuned for one node's batch scale to a step that averages W batches
/// (`batch_scaling`): SGD's rate linearly, Adam's and AdamW's with the square root, the warm-up
/// over the same examples in W times fewer steps; a user's rate and warm-up stay as given, and a
/// one-batch strategy changes nothing.
#[test]
fn defaults_scale_with_the_batches_a_step_averages() {
    use ringtmp_model::OptimizerConfig;
    let data = digits();
    let adamw = OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
        decay_embeddings: false,
    };
    let plan = |strategy: &str, optimizer: OptimizerConfig, defaults: bool| {
        let cfg = TrainConfig {
            lr: of(0.001, defaults),
            warmup_steps: of(10, defaults),
            optimizer,
            threads_from_machine: false,
            ..config()
        };
        let nodes = if strategy == "local" { 1 } else { 4 };
        let job = Job::plan(
            strategy,
            cfg,
            &Default::default(),
            &ringtmp_strategy::Cluster::local(nodes),
            &data,
            &mut Default::default(),
        )
        .unwrap();
        (*job.spec().lr, *job.spec().warmup_steps)
    };
    let sgd = config().optimizer;
    for strategy in ["allreduce", "dpsgd", "adpsgd"] {
        let (lr, warmup) = plan(strategy, adamw.clone(), true);
        assert!(
            (lr - 0.002).abs() < 1e-7,
            "{strategy}: √4 × 0.001, got {lr}"
        );
        assert_eq!(warmup, 3, "{strategy}: 10 steps of one batch in steps of 4");
        let (lr, _) = plan(strategy, sgd.clone(), true);
        assert!((lr - 0.004).abs() < 1e-7, "{strategy}: 4 × 0.001, got {lr}");
        assert_eq!(
            plan(strategy, adamw.clone(), false),
            (0.001, 10),
            "{strategy}"
        );
    }
    // The parameter server's 4 nodes are 3 workers and a server: BSP scales as above, the
    // stale models give Adam the one-node rate ÷ W.
    let (lr, warmup) = plan("ps", adamw.clone(), true);
    assert!((lr - 0.001 * 3f32.sqrt()).abs() < 1e-7, "ps: {lr}");
    assert_eq!(warmup, 4);
    let options = ringtmp_strategy::StrategyOptions {
        ps: ringtmp_strategy::param_server::plan::PsOptions {
            consistency: Some("asp".parse().unwrap()),
            ..Default::default()
        },
        ..Default::default()
    };
    let stale = TrainConfig {
        lr: Defaulted::default_value(0.001),
        optimizer: adamw.clone(),
        ..config()
    };
    let job = Job::plan(
        "ps",
        stale,
        &options,
        &ringtmp_strategy::Cluster::local(4),
        &data,
        &mut Default::default(),
    )
    .unwrap();
    assert!(
        (*job.spec().lr - 0.001 / 3.0).abs() < 1e-9,
        "asp: {}",
        job.spec().lr
    );
    assert_eq!(plan("local", adamw, true), (0.001, 10));
}

/// The async ring lowers SGD's default momentum (staleness adds its own); the
/// flushed schedules and a user's choice keep theirs.
#[test]
fn the_async_ring_defaults_to_less_momentum() {
    use ringtmp_model::OptimizerConfig;
    use ringtmp_strategy::ring::plan::{ASYNC_MOMENTUM, RingOptions};
    use ringtmp_strategy::ring::run::schedule::Schedule;
    let data = digits();
    let momentum = |schedule: Schedule, default_momentum: bool| {
        let cfg = TrainConfig {
            momentum: if default_momentum {
                Origin::Default
            } else {
                Origin::Given
            },
            optimizer: OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            ..config()
        };
        let options = ringtmp_strategy::StrategyOptions {
            ring: RingOptions {
                schedule: Some(schedule),
                ..Default::default()
            },
            ..Default::default()
        };
        let cluster = ringtmp_strategy::Cluster::local(2);
        match Job::plan(
            "ring",
            cfg,
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap()
        {
            Job::Ring(job) => match job.spec.optimizer {
                OptimizerConfig::Sgd { momentum, .. } => momentum,
                _ => panic!("sgd"),
            },
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(momentum(Schedule::Async, true), ASYNC_MOMENTUM);
    assert_eq!(momentum(Schedule::Async, false), 0.9, "the user's choice");
    assert_eq!(momentum(Schedule::OneFOneB, true), 0.9);
}

/// The stale parameter-server models lower SGD's default momentum to what keeps 30%
/// of synchronous SGD's stability margin under a delay of W − 1 updates (0.9 made the cnn
/// diverge under asp and dssp, 0.7 and 0.5 still did at 100 Mbit/s); BSP and a user's choice
/// keep theirs.
#[test]
fn stale_parameter_servers_default_to_less_momentum() {
    use ringtmp_model::OptimizerConfig;
    use ringtmp_strategy::param_server::plan::{PsOptions, stale_momentum};
    let data = digits();
    let momentum = |consistency: &str, nodes: u32, default_momentum: bool| {
        let cfg = TrainConfig {
            momentum: if default_momentum {
                Origin::Default
            } else {
                Origin::Given
            },
            optimizer: OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            ..config()
        };
        let options = ringtmp_strategy::StrategyOptions {
            ps: PsOptions {
                consistency: Some(consistency.parse().unwrap()),
                ..Default::default()
            },
            ..Default::default()
        };
        let cluster = ringtmp_strategy::Cluster::local(nodes);
        match Job::plan(
            "ps",
            cfg,
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap()
        {
            Job::Ps(job) => match job.spec.optimizer {
                OptimizerConfig::Sgd { momentum, .. } => momentum,
                _ => panic!("sgd"),
            },
            other => panic!("{other:?}"),
        }
    };
    for consistency in ["asp", "ssp:3", "dssp:1:4"] {
        assert!(
            (momentum(consistency, 4, true) - 0.3).abs() < 1e-6,
            "{consistency}"
        );
        assert!(
            (momentum(consistency, 3, true) - 0.4).abs() < 1e-6,
            "{consistency}"
        );
        assert!(
            (momentum(consistency, 9, true) - 0.2).abs() < 1e-6,
            "{consistency}"
        );
        assert_eq!(momentum(consistency, 4, false), 0.9, "the user's choice");
    }
    assert_eq!(momentum("bsp", 4, true), 0.9);
    // A model measured to want its own (the mlp preset) keeps it; the user's choice still wins.
    let own = |default_momentum: bool, user: f32| {
        let mut cfg = TrainConfig {
            momentum: if default_momentum {
                Origin::Default
            } else {
                Origin::Given
            },
            optimizer: OptimizerConfig::Sgd {
                momentum: user,
                weight_decay: 0.0,
            },
            ..config()
        };
        cfg.model.stale_momentum = Some(0.8);
        let options = ringtmp_strategy::StrategyOptions {
            ps: PsOptions {
                consistency: Some("asp".parse().unwrap()),
                ..Default::default()
            },
            ..Default::default()
        };
        let cluster = ringtmp_strategy::Cluster::local(4);
        match Job::plan(
            "ps",
            cfg,
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap()
        {
            Job::Ps(job) => match job.spec.optimizer {
                OptimizerConfig::Sgd { momentum, .. } => momentum,
                _ => panic!("sgd"),
            },
            other => panic!("{other:?}"),
        }
    };
    assert!((own(true, 0.9) - 0.8).abs() < 1e-6);
    assert!((own(false, 0.5) - 0.5).abs() < 1e-6);
    assert_eq!(
        ringtmp_model::ModelSpec::preset("mlp", 10)
            .unwrap()
            .stale_momentum,
        Some(0.9)
    );
    assert_eq!(
        ringtmp_model::ModelSpec::preset("cnn", 10)
            .unwrap()
            .stale_momentum,
        None
    );
    assert!(
        (stale_momentum(1) - 0.9).abs() < 1e-6,
        "no delay: SGD's own"
    );
    assert!((stale_momentum(64) - 0.2).abs() < 1e-6);
}

/// The stability margin behind the stale default, against the roots of the characteristic
/// polynomial `z^(τ+1) − (1+μ)z^τ + μz^(τ−1) + a` (computed with numpy; the margin is the
/// largest stable `a` times W over synchronous heavy-ball's 3.8).
#[test]
fn the_delayed_momentum_margin_matches_the_characteristic_roots() {
    use ringtmp_strategy::param_server::plan::delayed_margin;
    for (momentum, delay, workers, expected) in [
        (0.9, 0, 1, 1.0),
        (0.5, 2, 3, 0.2217),
        (0.7, 2, 3, 0.1273),
        (0.3, 1, 2, 0.3684),
        (0.5, 7, 8, 0.2016),
        (0.6, 7, 8, 0.1563),
    ] {
        let got = delayed_margin(momentum, delay, workers);
        assert!(
            (got - expected).abs() < 0.003,
            "μ {momentum}, delay {delay}, {workers} workers: {got} against {expected}"
        );
    }
}

/// The local launcher's nodes share this machine's cores. On one core every stage's
/// compute and every link's CPU queue for it, so more nodes only add link work: the plan takes
/// fewer nodes than given (and says so in `idle_nodes`), unless told to use all.
#[test]
fn nodes_sharing_one_core_are_planned_onto_fewer_of_them() {
    use ringtmp_strategy::ring::plan::RingOptions;
    let data = digits();
    let plan = |use_all_nodes: bool| {
        let mut cluster = ringtmp_strategy::Cluster::local(4);
        cluster.cores = 1;
        cluster.shared_machine = Some(ringtmp_strategy::SharedMachine {
            cores: 1,
            private_links: true,
        });
        let options = ringtmp_strategy::StrategyOptions {
            ring: RingOptions {
                use_all_nodes: Some(use_all_nodes),
                ..Default::default()
            },
            ..Default::default()
        };
        match Job::plan(
            "ring",
            config(),
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        )
        .unwrap()
        {
            Job::Ring(job) => job,
            other => panic!("{other:?}"),
        }
    };
    let fewer = plan(false);
    assert!(fewer.partition.len() < 4, "{:?}", fewer.partition);
    assert_eq!(fewer.idle_nodes as usize, 4 - fewer.partition.len());
    assert_eq!(check(&Job::Ring(fewer), 4), Ok(()));
    let all = plan(true);
    assert_eq!(all.partition.len(), 4, "{:?}", all.partition);
    assert_eq!(all.idle_nodes, 0);
}

/// Cuts inside layers given by the user are stage boundaries (`--cut-inside L:S`): one more
/// stage than cuts, or a usage error naming the count; a restart's kept cuts (its first
/// attempt's, on a ring maybe shrunk by a lost node) are made in any case, boundaries where
/// they fit.
#[test]
fn given_cuts_are_boundaries_and_kept_ones_fit_a_shrunk_ring() {
    use ringtmp_strategy::ring::plan::partition::CutInside;
    use ringtmp_strategy::ring::plan::{CutInsideChoice, RingOptions};
    let data = digits();
    // The test model's linear layers 4 (96 → 48) and 7 (48 → 32).
    let two = vec![
        CutInside {
            layer: 4,
            split: 20,
        },
        CutInside {
            layer: 7,
            split: 12,
        },
    ];
    let plan = |choice: CutInsideChoice, nodes: u32| {
        let options = ringtmp_strategy::StrategyOptions {
            ring: RingOptions {
                schedule: Some(Schedule::OneFOneB),
                cut_inside: Some(choice),
                ..Default::default()
            },
            ..Default::default()
        };
        let cluster = ringtmp_strategy::Cluster::local(nodes);
        match Job::plan(
            "ring",
            config(),
            &options,
            &cluster,
            &data,
            &mut Default::default(),
        ) {
            Ok(Job::Ring(job)) => Ok(job),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.to_string()),
        }
    };
    let one = plan(CutInsideChoice::At(two[1..].to_vec()), 2).unwrap();
    assert_eq!(one.cuts_inside, two[1..]);
    // The head of layer 7 is the cut model's layer 7: a stage ends after it.
    assert_eq!(one.partition[0].end, 8, "{:?}", one.partition);
    let err = plan(CutInsideChoice::At(two.clone()), 2).unwrap_err();
    assert!(err.contains("2 cut(s) need 3 stages"), "{err}");
    let both = plan(CutInsideChoice::At(two.clone()), 3).unwrap();
    let ends: Vec<usize> = both.partition.iter().map(|s| s.end).collect();
    assert_eq!(
        ends,
        [5, 9, 12],
        "heads of layers 4 and 7 end stages 0 and 1"
    );
    let kept = plan(CutInsideChoice::Kept(two.clone()), 2).unwrap();
    assert_eq!(kept.cuts_inside, two);
    assert_eq!(kept.partition.len(), 2);
    assert_eq!(kept.layers().unwrap().len(), 12);
    // With the head on the master (the last linear layer, 9, and what follows): the head's
    // layers move by one a cut, and the job validates.
    let options = ringtmp_strategy::StrategyOptions {
        ring: RingOptions {
            schedule: Some(Schedule::OneFOneB),
            cut_inside: Some(CutInsideChoice::At(two[1..].to_vec())),
            master_holds_head: Some(true),
            ..Default::default()
        },
        ..Default::default()
    };
    let cluster = ringtmp_strategy::Cluster::local(2);
    let job = Job::plan(
        "ring",
        config(),
        &options,
        &cluster,
        &data,
        &mut Default::default(),
    )
    .unwrap();
    assert_eq!(check(&job, 2), Ok(()));
    let Job::Ring(ring) = job else {
        panic!("a ring job")
    };
    let head = ring.head.expect("the head on the master");
    assert_eq!((head.start, head.end), (10, 11));
    assert_eq!(ring.partition.last().unwrap().end, 10);
}

/// The strategies' list names each strategy as its job type does (`Strategy::NAME`), which is
/// the name `job.json` is tagged with and `--strategy` takes.
#[test]
fn every_listed_strategy_is_named_as_its_job_names_itself() {
    assert_eq!(Job::LISTED_NAMES, Job::NAMES);
    let clipping: Vec<&str> = Job::NAMES
        .iter()
        .copied()
        .filter(|n| Job::clips(n))
        .collect();
    // Every strategy clips: exactly where a step's gradient is shared (local, ring, all-reduce,
    // BSP), each worker its own where none is (the stale parameter server, the gossips).
    assert_eq!(clipping, Job::NAMES);
    for name in Job::NAMES {
        let options = ringtmp_strategy::StrategyOptions::default();
        let workers = Job::workers(name, &options, 4).unwrap();
        let expected = match *name {
            "local" => 1,
            "ring" => 1,
            "ps" => 3,
            _ => 4,
        };
        assert_eq!(workers, expected, "{name}");
    }
}

/// `value`, a default or the user's.
fn of<T>(value: T, default: bool) -> Defaulted<T> {
    if default {
        Defaulted::default_value(value)
    } else {
        Defaulted::given(value)
    }
}
