//! The simulator: every strategy's own code runs on the simulated network with
//! compute priced by a cost model; in phantom mode (sizes only) it must take exactly the
//! virtual time and move exactly the bytes it does when it computes for real — the invariant
//! that lets `ringtmp simulate` run clusters too large to compute.

use std::time::Duration;

use ringtmp_strategy::Job;
use ringtmp_strategy::collective::mixing::Topology;
use ringtmp_strategy::param_server::consistency::Consistency;
use ringtmp_strategy::ring::run::schedule::Schedule;
use ringtmp_strategy::simulate::{CostModel, Simulated, priced, simulate};
use ringtmp_testkit::fixtures::{deep_mlp, digits, train_config};
use ringtmp_testkit::jobs::{adpsgd_job, allreduce_job, dpsgd_job, ps_job, ring_job};

/// A made-up machine: fixed costs, so that virtual time is a pure function of the work.
fn costs(layers: usize) -> CostModel {
    CostModel {
        machine: "test".into(),
        model: "deep-test".into(),
        rows: 16,
        threads: 1,
        forward_seconds_per_row: (0..layers).map(|i| 1e-6 * (1 + i % 3) as f64).collect(),
        backward_seconds_per_row: (0..layers).map(|i| 2e-6 * (1 + i % 3) as f64).collect(),
        input_grad_seconds_per_row: Vec::new(),
        update_seconds_per_param: 1e-9,
        elementwise_seconds_per_value: 5e-10,
    }
}

fn run(job: &Job, world: u32, phantom: bool, layers: usize) -> Simulated {
    run_priced(job, world, phantom, costs(layers))
}

fn run_priced(job: &Job, world: u32, phantom: bool, costs: CostModel) -> Simulated {
    let mut sim = priced(7, costs, phantom);
    sim.bandwidth_bps = Some(100_000_000);
    sim.latency = Duration::from_millis(2);
    sim.time_limit = Duration::from_secs(600);
    // Elide every tensor but the logits (evaluation chunks of 250 rows × 10): activations
    // (32 × 96 and more) and models travel as sizes.
    sim.phantom_inline_values = 2500;
    simulate(job, world, &digits(), sim).unwrap_or_else(|e| panic!("{}: {e}", job.name()))
}

fn bytes(s: &ringtmp_metrics::Summary) -> u64 {
    s.per_node.iter().map(|n| n.bytes_sent).sum()
}

#[test]
fn phantom_runs_take_the_time_and_bytes_of_computing_runs_for_every_strategy() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let spec = deep_mlp(4, 96);
    // flatten, 4 × (linear, relu), linear.
    let layers = 10;
    let cfg = |name: &str| train_config(spec.clone(), 32, 12, &tmp.path().join(name));
    let jobs: Vec<(&str, Job, u32)> = vec![
        (
            "ring async",
            Job::Ring(ring_job(
                &cfg("ra"),
                &data,
                &[0, 3, 6, layers],
                Schedule::Async,
                1,
            )),
            3,
        ),
        (
            "ring 1f1b",
            Job::Ring(ring_job(
                &cfg("r1"),
                &data,
                &[0, 4, layers],
                Schedule::OneFOneB,
                4,
            )),
            2,
        ),
        (
            "rings of rings",
            {
                let mut ring = ring_job(&cfg("rr"), &data, &[0, 4, layers], Schedule::OneFOneB, 4);
                ring.spec = ringtmp_strategy::RunSpec::new(cfg("rr"), &data, 64).unwrap();
                ring.replicas = 2;
                Job::Ring(ring)
            },
            4,
        ),
        (
            "ps bsp",
            Job::Ps(ps_job(&cfg("pb"), &data, 1, 4, Consistency::Bsp)),
            5,
        ),
        (
            "ps ssp",
            Job::Ps(ps_job(
                &cfg("ps"),
                &data,
                2,
                2,
                Consistency::Ssp { staleness: 2 },
            )),
            4,
        ),
        (
            "allreduce",
            Job::AllReduce(allreduce_job(&cfg("ar"), &data, 4, 4096, true)),
            4,
        ),
        (
            "dpsgd",
            Job::Dpsgd(dpsgd_job(&cfg("dp"), &data, 4, Topology::Ring)),
            4,
        ),
        ("adpsgd", Job::Adpsgd(adpsgd_job(&cfg("ad"), &data, 4)), 4),
    ];
    for (name, job, world) in &jobs {
        let real = run(job, *world, false, layers);
        let phantom = run(job, *world, true, layers);
        let (r, p) = (&real.summary, &phantom.summary);
        eprintln!(
            "{name}: computing {:.4} s, phantom {:.4} s of virtual time; {} vs {} bytes",
            real.virtual_seconds,
            phantom.virtual_seconds,
            bytes(r),
            bytes(p)
        );
        assert!(real.virtual_seconds > 0.0, "{name}");
        let rel = (real.virtual_seconds - phantom.virtual_seconds).abs() / real.virtual_seconds;
        assert!(rel < 1e-4, "{name}: virtual time differs by {rel:e}");
        assert_eq!(r.steps, p.steps, "{name}");
        assert_eq!(r.samples, p.samples, "{name}");
        // Under a virtual clock no message carries a reading of the simulator's process.
        assert_eq!(bytes(r), bytes(p), "{name}: bytes");
        for (a, b) in r.per_node.iter().zip(&p.per_node) {
            let diff = (a.compute_seconds - b.compute_seconds).abs();
            assert!(diff < 1e-6, "{name}: rank {} compute {diff}", a.rank);
        }
    }
}

// A ring stage's split backward is priced as it runs: its input gradient leaves once
// the layers' input gradients are priced, and its linear layers' weight gradients are priced
// after the send. Splitting the price moves when the gradient leaves, not how much compute
// there is: every node's compute is the same (but the master's, whose first layer's unread input
// gradient is no longer charged once the shares are known), and the master waits less for
// gradients than when
// the whole backward is priced before the send (a cost model without the input gradients'
// share, as those written before it was measured). Computing and phantom runs alike.
#[test]
fn a_ring_stage_prices_its_weight_gradients_after_its_input_gradient_leaves() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let layers = 10;
    let cfg = train_config(deep_mlp(4, 96), 32, 12, &tmp.path().join("split"));
    let job = Job::Ring(ring_job(
        &cfg,
        &data,
        &[0, 3, 6, layers],
        Schedule::Async,
        1,
    ));
    let whole = costs(layers);
    let mut split = costs(layers);
    // A quarter of each layer's backward comes before its input gradient.
    split.input_grad_seconds_per_row = whole
        .backward_seconds_per_row
        .iter()
        .map(|s| s / 4.0)
        .collect();
    for phantom in [false, true] {
        let before = run_priced(&job, 3, phantom, whole.clone()).summary;
        let after = run_priced(&job, 3, phantom, split.clone()).summary;
        assert_eq!((before.steps, bytes(&before)), (after.steps, bytes(&after)));
        for (a, b) in before.per_node.iter().zip(&after.per_node) {
            // The master's first linear layer (layer 1) makes no input gradient (no one reads
            // it): with the shares known it is charged its weight gradient only — a quarter of
            // its backward less, 1 µs a row, over 12 steps of 32 rows. The rest is unchanged.
            let expected = if a.rank == 0 {
                whole.backward_seconds_per_row[1] / 4.0 * (32 * 12) as f64
            } else {
                0.0
            };
            let diff = a.compute_seconds - b.compute_seconds;
            assert!(
                (diff - expected).abs() < 1e-9,
                "phantom {phantom}: rank {} compute differs by {diff}, expected {expected}",
                a.rank
            );
        }
        let waits = |s: &ringtmp_metrics::Summary| s.per_node[0].wait_gradient_seconds;
        eprintln!(
            "phantom {phantom}: the master waited {:.6} s for gradients with the whole backward \
             before the send, {:.6} s with the split",
            waits(&before),
            waits(&after)
        );
        assert!(waits(&after) < waits(&before), "phantom {phantom}");
    }
}

/// Busy threads, one per core, spinning until dropped: a loaded machine.
struct CpuHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (0..cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The simulation reads no wall clock: with the same seed and cost model, a run on a machine
/// whose every core is busy gives the simulated figures of a run on an idle one, bit for bit.
#[test]
fn a_loaded_machine_simulates_the_same_run_as_an_idle_one() {
    let data = digits();
    let tmp = tempfile::tempdir().unwrap();
    let spec = deep_mlp(4, 96);
    let layers = 10;
    let cfg = |name: &str| train_config(spec.clone(), 32, 12, &tmp.path().join(name));
    let jobs: Vec<(&str, Job, u32)> = vec![
        (
            "ring async",
            Job::Ring(ring_job(
                &cfg("ra"),
                &data,
                &[0, 3, 6, layers],
                Schedule::Async,
                1,
            )),
            3,
        ),
        (
            "ps bsp",
            Job::Ps(ps_job(&cfg("pb"), &data, 1, 4, Consistency::Bsp)),
            5,
        ),
        (
            "allreduce",
            Job::AllReduce(allreduce_job(&cfg("ar"), &data, 4, 4096, true)),
            4,
        ),
        ("adpsgd", Job::Adpsgd(adpsgd_job(&cfg("ad"), &data, 4)), 4),
    ];
    for (name, job, world) in &jobs {
        let idle = run(job, *world, false, layers);
        let loaded = {
            let _hog = CpuHog::start();
            run(job, *world, false, layers)
        };
        let (a, b) = (&idle.summary, &loaded.summary);
        assert_eq!(
            idle.virtual_seconds.to_bits(),
            loaded.virtual_seconds.to_bits(),
            "{name}: {} s idle, {} s loaded",
            idle.virtual_seconds,
            loaded.virtual_seconds
        );
        assert_eq!(a.samples_per_second, b.samples_per_second, "{name}");
        assert_eq!(a.train_seconds, b.train_seconds, "{name}");
        for (x, y) in a.per_node.iter().zip(&b.per_node) {
            assert_eq!(x.bytes_sent, y.bytes_sent, "{name}: rank {}", x.rank);
            assert_eq!(
                x.compute_seconds, y.compute_seconds,
                "{name}: rank {}",
                x.rank
            );
        }
    }
}
