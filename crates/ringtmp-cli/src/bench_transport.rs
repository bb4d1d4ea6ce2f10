//! `ringtmp bench-transport`: what the transport costs over plain TCP, measured in one run on
//! loopback. Two in-process endpoints (threads) exchange
//! - large tensors (`--size-mib`, default 4) one way: plain `std::net::TcpStream` copy vs ringtmp
//!   links (framing, reader/writer tasks, accounting), with `--insecure-plaintext` and private
//!   (every record encrypted and authenticated, the default) with each of the two ciphers, on
//!   loopback and through an emulated card (`--emulated-mbit`, default 1000);
//! - small messages as ping/pong round trips: plain TCP vs ringtmp control frames, every kind.

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
