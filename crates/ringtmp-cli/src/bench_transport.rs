//! `ringtmp bench-transport`: what the transport costs over plain TCP, measured in one run on
//! loopback. Two in-process endpoints (threads) exchange
//! - large tensors (`--size-mib`, default 4) one way: plain `std::net::TcpStream` copy vs ringtmp
//!   links (framing, reader/writer tasks, accounting), with `--insecure-plaintext` and private
//!   (every record encrypted and authenticated, the default) with each of the two ciphers, on
//!   loopback and through an emulated card (`--emulated-mbit`, default 1000);
//! - small messages as ping/pong round trips: plain TCP vs ringtmp control frames, every kind;
//! - tensors between two pinned nodes (`--busy-tensors`; each endpoint and its I/O thread on one
//!   core): the one-way latency of an activation-sized tensor and of a small reply when "compute"
//!   keeps both cores busy, as a pinned ring node's does, and when they are otherwise idle.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use ringtmp_transport::secure::Cipher;
use ringtmp_transport::{Network, TransportConfig, bind_listener};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};

/// `ringtmp bench-transport` options.
#[derive(Args, Clone, Debug)]
pub struct BenchTransportArgs {
    /// MiB per tensor.
    #[arg(long, default_value_t = 4.0)]
    pub size_mib: f64,
    /// Tensors per repeat.
    #[arg(long, default_value_t = 50)]
    pub count: usize,
    /// Repeats (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Ping/pong round trips.
    #[arg(long, default_value_t = 5000)]
    pub pings: usize,
    /// Also measure through an emulated card of this many Mbit/s (0: loopback only).
    #[arg(long, default_value_t = 1000.0)]
    pub emulated_mbit: f64,
    /// Tensors of 256 KiB (an `mlp-deep` micro-batch's activation) sent to a busy node per
    /// repeat, each answered with one of 2.5 KiB (0: skip; needs two cores).
    #[arg(long, default_value_t = 400)]
    pub busy_tensors: usize,
}

/// How a measured link carries its bytes.
#[derive(Clone, Copy)]
enum Sealing {
    /// `--insecure-plaintext`.
    Plain,
    /// A private link sealed with this cipher.
    Private(Cipher),
}

impl Sealing {
    /// The kinds measured: plaintext, then both ciphers.
    const ALL: [Sealing; 3] = [
        Sealing::Plain,
        Sealing::Private(Cipher::AesGcm),
        Sealing::Private(Cipher::ChaChaPoly),
    ];

    /// The row's label, padded to one width; the default here is marked.
    fn label(self) -> String {
        let name = match self {
            Sealing::Plain => "ringtmp, --insecure-plaintext".to_string(),
            Sealing::Private(c) if c == Cipher::between_two_like_this() => {
                format!("ringtmp, {} (default)", c.name())
            }
            Sealing::Private(c) => format!("ringtmp, {}", c.name()),
        };
        format!("{name:<37}")
    }
}

/// Runs the benchmark and prints the comparison.
pub fn run(args: &BenchTransportArgs) -> Result<()> {
    let size = ((args.size_mib * 1024.0 * 1024.0) as usize / 4) * 4;
    let mut raw_rates = Vec::new();
    let mut pairs = Sealing::ALL
        .iter()
        .map(|&s| pair(s, None))
        .collect::<Result<Vec<_>>>()?;
    let mut rates = vec![Vec::new(); pairs.len()];
    // Interleaved, so drift on a shared machine falls on all of them alike.
    for _ in 0..args.repeats {
        raw_rates.push(raw_throughput(size, args.count)?);
        for ((a, b), rates) in pairs.iter_mut().zip(&mut rates) {
            rates.push(ringtmp_throughput(a, b, size, args.count)?);
        }
    }
    let raw = median(&mut raw_rates);
    println!(
        "throughput on loopback, {} × {:.1} MiB one way, median of {} (private links use \
         AES-256-GCM when both ends have AES instructions{}):",
        args.count,
        args.size_mib,
        args.repeats,
        if Cipher::aes_is_fast_here() {
            ", as this machine does"
        } else {
            "; this machine has none"
        }
    );
    println!("  {:<37} {:>8.0} MB/s", "plain TCP socket copy", raw / 1e6);
    for (sealing, rates) in Sealing::ALL.iter().zip(&mut rates) {
        let rate = median(rates);
        println!(
            "  {} {:>8.0} MB/s  ({:.0}% of plain TCP)",
            sealing.label(),
            rate / 1e6,
            100.0 * rate / raw
        );
    }
    let raw_rtt = raw_round_trips(args.pings)?;
    println!("round trip of a small message, {} pings:", args.pings);
    println!(
        "  {:<37} p50 {:>6.1} µs  p99 {:>6.1} µs",
        "plain TCP", raw_rtt.0, raw_rtt.1
    );
    for (sealing, (a, b)) in Sealing::ALL.iter().zip(&mut pairs) {
        let rtt = ringtmp_round_trips(a, b, args.pings)?;
        println!(
            "  {} p50 {:>6.1} µs  p99 {:>6.1} µs",
            sealing.label(),
            rtt.0,
            rtt.1
        );
    }
    for (a, b) in pairs {
        close(a, b);
    }
    if args.busy_tensors > 0 {
        busy_latencies(args)?;
    }
    if args.emulated_mbit > 0.0 {
        let bps = (args.emulated_mbit * 1e6) as u64;
        // Enough tensors for a second or so per repeat at the card's rate.
        let count = ((bps as f64 / 8.0 / size as f64) as usize).clamp(2, args.count);
        println!(
            "throughput through an emulated {} Mbit/s card ({:.0} MB/s), {count} × {:.1} MiB, \
             median of {}:",
            args.emulated_mbit,
            bps as f64 / 8e6,
            args.size_mib,
            args.repeats
        );
        let mut pairs = Sealing::ALL
            .iter()
            .map(|&s| pair(s, Some(bps)))
            .collect::<Result<Vec<_>>>()?;
        let mut rates = vec![Vec::new(); pairs.len()];
        for _ in 0..args.repeats {
            for ((a, b), rates) in pairs.iter_mut().zip(&mut rates) {
                rates.push(ringtmp_throughput(a, b, size, count)?);
            }
        }
        for (sealing, rates) in Sealing::ALL.iter().zip(&mut rates) {
            let rate = median(rates);
            println!(
                "  {} {:>8.1} MB/s  ({:.1}% of the card)",
                sealing.label(),
                rate / 1e6,
                100.0 * rate * 8.0 / bps as f64
            );
        }
        for (a, b) in pairs {
            close(a, b);
        }
    }
    Ok(())
}

/// The one-way latencies between two pinned endpoints whose cores their "compute" keeps busy,
/// and between the same two idle, interleaved over the repeats; prints mean, median and 90th
/// percentile of each.
fn busy_latencies(args: &BenchTransportArgs) -> Result<()> {
    if thread::available_parallelism().map_or(1, usize::from) < 2 {
        println!("tensors between two busy nodes: skipped (needs two cores)");
        return Ok(());
    }
    // [busy?][256 KiB, 2.5 KiB] latencies in µs, over all repeats.
    let mut all = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    for _ in 0..args.repeats {
        for busy in [false, true] {
            let (mut a, mut b) = pinned_pair()?;
            let [big, small] = pinned_exchange(&mut a, &mut b, args.busy_tensors, busy)?;
            close(a, b);
            all[usize::from(busy)][0].extend(big);
            all[usize::from(busy)][1].extend(small);
        }
    }
    println!(
        "one-way latency between two pinned nodes, each with its I/O thread on its core ({} × \
         256 KiB, each answered with 2.5 KiB, {} repeats; default link sealing):",
        args.busy_tensors, args.repeats
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (busy, [big, small]) in all.iter_mut().enumerate() {
        let label = if busy == 1 {
            "cores kept busy by compute"
        } else {
            "cores otherwise idle"
        };
        println!(
            "  {label:<27} 256 KiB mean {:>5.0} µs p50 {:>5.0} p90 {:>5.0};  2.5 KiB mean {:>5.0} \
             µs p50 {:>5.0} p90 {:>5.0}",
            mean(big),
            percentile(big, 0.5),
            percentile(big, 0.9),
            mean(small),
            percentile(small, 0.5),
            percentile(small, 0.9)
        );
    }
    Ok(())
}

/// Two connected endpoints, each made on a thread pinned to its own core (0 and 1), so that its
/// I/O thread is pinned there too.
fn pinned_pair() -> Result<(Network, Network)> {
    let secret = b"bench-transport-secret".to_vec();
    let (la, lb) = (bind_listener("127.0.0.1:0")?, bind_listener("127.0.0.1:0")?);
    let addresses = BTreeMap::from([(0, la.local_addr()?), (1, lb.local_addr()?)]);
    let endpoint = |rank: u32, listener| {
        let (secret, addresses) = (secret.clone(), addresses.clone());
        thread::spawn(move || -> Result<Network> {
            crate::node::pin_to_core(rank as usize)?;
            let cfg = TransportConfig::new(1, rank, secret);
            Ok(Network::connect(
                cfg,
                listener,
                &addresses,
                &BTreeSet::from([1 - rank]),
            )?)
        })
    };
    let (ha, hb) = (endpoint(0, la), endpoint(1, lb));
    let joined = |h: thread::JoinHandle<Result<Network>>| {
        h.join()
            .map_err(|_| anyhow::anyhow!("connect thread panicked"))?
    };
    Ok((joined(ha)?, joined(hb)?))
}

/// Endpoint 0 sends `count` tensors of 256 KiB, one every 2 ms, to endpoint 1, which answers each
/// with 2.5 KiB; both look at their inbox every 50 µs, pinned to their cores, and in between
/// "compute" (spin) when `busy`, else sleep. Returns the one-way latencies in µs: 256 KiB from
/// `send` to its taking at the other end, and the same for the replies.
fn pinned_exchange(
    a: &mut Network,
    b: &mut Network,
    count: usize,
    busy: bool,
) -> Result<[Vec<f64>; 2]> {
    const CHUNK: Duration = Duration::from_micros(50);
    const PERIOD: Duration = Duration::from_millis(2);
    let tensor = |seq: u64, bytes: usize| {
        let header = TensorHeader {
            run_id: 1,
            step: 0,
            micro_batch: seq,
            tag: TensorTag::Probe,
            dtype: Dtype::F32,
            shape: vec![(bytes / 4) as u32],
        };
        Message::Tensor(header, vec![7u8; bytes])
    };
    let spin = || {
        if !busy {
            return thread::sleep(CHUNK);
        }
        let t = Instant::now();
        while t.elapsed() < CHUNK {
            std::hint::spin_loop();
        }
    };
    let sent_big = std::sync::Mutex::new(vec![None::<Instant>; count]);
    let sent_small = std::sync::Mutex::new(vec![None::<Instant>; count]);
    let deadline = Instant::now() + Duration::from_secs(30) + PERIOD * count as u32;
    let took = |sent: &std::sync::Mutex<Vec<Option<Instant>>>, m: &Message| -> Result<f64> {
        let Message::Tensor(h, _) = m else {
            anyhow::bail!("unexpected message {m:?}");
        };
        let at = sent.lock().expect("no panics while held")[h.micro_batch as usize]
            .context("a tensor before its send")?;
        Ok(at.elapsed().as_secs_f64() * 1e6)
    };
    thread::scope(|s| -> Result<[Vec<f64>; 2]> {
        let answering = s.spawn(|| -> Result<Vec<f64>> {
            crate::node::pin_to_core(1)?;
            let mut big = Vec::with_capacity(count);
            while big.len() < count {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "pinned exchange: endpoint 1 timed out"
                );
                spin();
                while let Some((_, m)) = b.try_recv()? {
                    big.push(took(&sent_big, &m)?);
                    let seq = big.len() as u64 - 1;
                    sent_small.lock().expect("no panics while held")[seq as usize] =
                        Some(Instant::now());
                    b.send(0, tensor(seq, 2560))?;
                }
            }
            Ok(big)
        });
        // On a thread of its own, so that the caller's affinity stays as it was.
        let asking = s.spawn(|| -> Result<Vec<f64>> {
            crate::node::pin_to_core(0)?;
            let (mut small, mut next, mut sent) = (Vec::with_capacity(count), Instant::now(), 0);
            while small.len() < count {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "pinned exchange: endpoint 0 timed out"
                );
                spin();
                if sent < count && Instant::now() >= next {
                    sent_big.lock().expect("no panics while held")[sent] = Some(Instant::now());
                    a.send(1, tensor(sent as u64, 256 * 1024))?;
                    (sent, next) = (sent + 1, next + PERIOD);
                }
                while let Some((_, m)) = a.try_recv()? {
                    small.push(took(&sent_small, &m)?);
                }
            }
            Ok(small)
        });
        let joined = |h: thread::ScopedJoinHandle<'_, Result<Vec<f64>>>| {
            h.join()
                .map_err(|_| anyhow::anyhow!("an endpoint panicked"))?
        };
        let (small, big) = (joined(asking)?, joined(answering)?);
        Ok([big, small])
    })
}

fn close(mut a: Network, mut b: Network) {
    thread::scope(|s| {
        s.spawn(|| a.close());
        s.spawn(|| b.close());
    });
}

/// Two connected endpoints sealed as `sealing` says, with node 0's card at `bandwidth_bps`.
fn pair(sealing: Sealing, bandwidth_bps: Option<u64>) -> Result<(Network, Network)> {
    let secret = b"bench-transport-secret".to_vec();
    let (la, lb) = (bind_listener("127.0.0.1:0")?, bind_listener("127.0.0.1:0")?);
    let addresses = BTreeMap::from([(0, la.local_addr()?), (1, lb.local_addr()?)]);
    let (mut ca, mut cb) = (
        TransportConfig::new(1, 0, secret.clone()),
        TransportConfig::new(1, 1, secret),
    );
    let (encrypt, aes) = match sealing {
        Sealing::Plain => (false, false),
        Sealing::Private(cipher) => (true, cipher == Cipher::AesGcm),
    };
    (ca.encrypt, cb.encrypt) = (encrypt, encrypt);
    (ca.aes, cb.aes) = (aes, aes);
    ca.shaping.bandwidth_bps = bandwidth_bps;
    let addr_b = addresses.clone();
    let hb = thread::spawn(move || Network::connect(cb, lb, &addr_b, &BTreeSet::from([0])));
    let a = Network::connect(ca, la, &addresses, &BTreeSet::from([1]))?;
    let b = hb
        .join()
        .map_err(|_| anyhow::anyhow!("connect thread panicked"))??;
    Ok((a, b))
}

fn raw_throughput(size: usize, count: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; size];
        for _ in 0..count {
            s.read_exact(&mut buf)?;
        }
        s.write_all(&[1])
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let data = vec![7u8; size];
    let started = Instant::now();
    for _ in 0..count {
        s.write_all(&data)?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let took = started.elapsed();
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))??;
    Ok((size * count) as f64 / took.as_secs_f64())
}

fn ringtmp_throughput(a: &mut Network, b: &mut Network, size: usize, count: usize) -> Result<f64> {
    let header = TensorHeader {
        run_id: 1,
        step: 0,
        micro_batch: 0,
        tag: TensorTag::Probe,
        dtype: Dtype::F32,
        shape: vec![(size / 4) as u32],
    };
    // Tensors are built before the clock starts, as the plain-TCP baseline's buffer is.
    let messages: Vec<Message> = (0..count)
        .map(|_| Message::Tensor(header.clone(), vec![7u8; size]))
        .collect();
    let started = Instant::now();
    thread::scope(|s| -> Result<()> {
        let receiver = s.spawn(|| -> Result<()> {
            for _ in 0..count {
                b.recv_from(0, Duration::from_secs(30))?;
            }
            b.send(0, Message::Control(Control::Ping { seq: 0 }))?;
            Ok(())
        });
        for m in messages {
            a.send(1, m)?;
        }
        a.recv_from(1, Duration::from_secs(30))?;
        receiver
            .join()
            .map_err(|_| anyhow::anyhow!("receiver panicked"))?
    })?;
    Ok((size * count) as f64 / started.elapsed().as_secs_f64())
}

fn raw_round_trips(n: usize) -> Result<(f64, f64)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 32];
        for _ in 0..n {
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).context("connecting")?;
    s.set_nodelay(true)?;
    let mut buf = [0u8; 32];
    let mut rtts = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo panicked"))??;
    Ok((percentile(&mut rtts, 0.5), percentile(&mut rtts, 0.99)))
}

fn ringtmp_round_trips(a: &mut Network, b: &mut Network, n: usize) -> Result<(f64, f64)> {
    let mut rtts = Vec::with_capacity(n);
    thread::scope(|s| -> Result<()> {
        let echo = s.spawn(|| -> Result<()> {
            for _ in 0..n {
                if let Message::Control(Control::Ping { seq }) =
                    b.recv_from(0, Duration::from_secs(10))?
                {
                    b.send(0, Message::Control(Control::Pong { seq }))?;
                }
            }
            Ok(())
        });
        for seq in 0..n as u64 {
            let t = Instant::now();
            a.send(1, Message::Control(Control::Ping { seq }))?;
            a.recv_from(1, Duration::from_secs(10))?;
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
        echo.join().map_err(|_| anyhow::anyhow!("echo panicked"))?
    })?;
    Ok((percentile(&mut rtts, 0.5), percentile(&mut rtts, 0.99)))
}

fn median(v: &mut [f64]) -> f64 {
    percentile(v, 0.5)
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}
