//! `selftest`: checks a cluster's connectivity and measures its links, on the same runtime the
//! strategies use. Nodes form a ring; each node
//! 1. measures the round-trip time to its successor (`pings` ping/pong exchanges),
//! 2. sends `rounds` tensors of `size_bytes` to its successor while receiving its predecessor's,
//!    and checks every received value (a wrong byte anywhere fails the test), timing each round,
//! 3. passes a report around the ring so rank 0 can print every node's numbers.

use std::time::{Duration, Instant};

use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes, tensor_values};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};

/// What the selftest does.
#[derive(Clone, Copy, Debug)]
pub struct SelftestConfig {
    /// Bytes per tensor in the bandwidth rounds.
    pub size_bytes: usize,
    /// Bandwidth rounds.
    pub rounds: u32,
    /// Ping/pong exchanges.
    pub pings: u32,
    /// Longest wait for any one message.
    pub timeout: Duration,
}

/// One node's measurements.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeReport {
    /// Rank.
    pub rank: u32,
    /// Median round trip to the successor, microseconds.
    pub rtt_p50_us: f64,
    /// 99th-percentile round trip, microseconds.
    pub rtt_p99_us: f64,
    /// Median per-round throughput of its outgoing link, MB/s (10⁶ bytes).
    pub send_mb_per_s: f64,
}

/// Runs the selftest on this node. Returns every node's report on rank 0 and this node's own
/// report elsewhere.
pub fn run(
    net: &mut dyn Transport,
    world_size: u32,
    run_id: u64,
    cfg: SelftestConfig,
) -> Result<Vec<NodeReport>, TransportError> {
    let rank = net.rank();
    if world_size < 2 {
        return Ok(vec![NodeReport {
            rank,
            ..Default::default()
        }]);
    }
    let succ = (rank + 1) % world_size;
    let pred = (rank + world_size - 1) % world_size;

    // 1. Round trips. Each node pings its successor and answers its predecessor's pings as they
    // come (they may run ahead of or behind our own sequence), until it has both its own `pings`
    // answers and answered `pings` pings.
    let mut rtts = Vec::with_capacity(cfg.pings as usize);
    let mut answered = 0u32;
    // A predecessor that finished this phase already sends its first bandwidth tensor; keep it.
    let mut early: Vec<(u32, Message)> = Vec::new();
    let mut handle = |net: &mut dyn Transport,
                      answered: &mut u32,
                      awaited_pong: Option<u64>|
     -> Result<bool, TransportError> {
        match net.recv(cfg.timeout)? {
            (from, Message::Control(Control::Ping { seq })) if from == pred => {
                net.send(pred, Message::Control(Control::Pong { seq }))?;
                *answered += 1;
                Ok(false)
            }
            (from, Message::Control(Control::Pong { seq }))
                if from == succ && Some(seq) == awaited_pong =>
            {
                Ok(true)
            }
            (from, m @ Message::Tensor(..)) if from == pred => {
                early.push((from, m));
                Ok(false)
            }
            (from, other) => Err(unexpected(net, from, &other)),
        }
    };
    for seq in 0..u64::from(cfg.pings) {
        let sent = Instant::now();
        net.send(succ, Message::Control(Control::Ping { seq }))?;
        while !handle(net, &mut answered, Some(seq))? {}
        rtts.push(sent.elapsed().as_secs_f64() * 1e6);
    }
    while answered < cfg.pings {
        handle(net, &mut answered, None)?;
    }
    for (from, m) in early.into_iter().rev() {
        net.unread(from, m);
    }

    // 2. Bandwidth with content checks.
    let elements = cfg.size_bytes / 4;
    let mut rates = Vec::new();
    let mut received = Vec::new();
    for round in 0..cfg.rounds {
        let value = |r: u32| (r * 1000 + round) as f32;
        let header = TensorHeader {
            run_id,
            step: u64::from(round),
            micro_batch: 0,
            tag: TensorTag::Probe,
            dtype: Dtype::F32,
            shape: vec![elements as u32],
        };
        let payload = tensor_bytes(&vec![value(rank); elements], Dtype::F32);
        let started = Instant::now();
        net.send(succ, Message::Tensor(header, payload))?;
        match net.recv_from(pred, cfg.timeout)? {
            Message::Tensor(h, bytes) if h.run_id == run_id && h.step == u64::from(round) => {
                tensor_values(&bytes, h.dtype, &mut received);
                let expected = value(pred);
                if received.len() != elements || received.iter().any(|v| *v != expected) {
                    return Err(TransportError::Io {
                        context: format!(
                            "selftest round {round}: data from {} is corrupt",
                            net.peer_name(pred)
                        ),
                        source: std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "payload mismatch",
                        ),
                    });
                }
            }
            other => return Err(unexpected(net, pred, &other)),
        }
        rates.push(cfg.size_bytes as f64 / started.elapsed().as_secs_f64() / 1e6);
    }

    let own = NodeReport {
        rank,
        rtt_p50_us: percentile(&mut rtts, 0.5),
        rtt_p99_us: percentile(&mut rtts, 0.99),
        send_mb_per_s: percentile(&mut rates, 0.5),
    };

    // 3. The report travels once around the ring, each node appending its numbers.
    let encode = |reports: &[NodeReport]| -> Message {
        let values: Vec<f32> = reports
            .iter()
            .flat_map(|r| {
                [
                    r.rank as f32,
                    r.rtt_p50_us as f32,
                    r.rtt_p99_us as f32,
                    r.send_mb_per_s as f32,
                ]
            })
            .collect();
        let header = TensorHeader {
            run_id,
            step: u64::MAX,
            micro_batch: 0,
            tag: TensorTag::Probe,
            dtype: Dtype::F32,
            shape: vec![values.len() as u32],
        };
        Message::Tensor(header, tensor_bytes(&values, Dtype::F32))
    };
    let decode = |m: Message| -> Option<Vec<NodeReport>> {
        let Message::Tensor(h, bytes) = m else {
            return None;
        };
        let mut v = Vec::new();
        tensor_values(&bytes, h.dtype, &mut v);
        Some(
            v.chunks_exact(4)
                .map(|c| NodeReport {
                    rank: c[0] as u32,
                    rtt_p50_us: c[1].into(),
                    rtt_p99_us: c[2].into(),
                    send_mb_per_s: c[3].into(),
                })
                .collect(),
        )
    };
    if rank == 0 {
        net.send(succ, encode(&[own]))?;
        let report = net.recv_from(pred, cfg.timeout)?;
        decode(report).ok_or_else(|| unexpected_kind(net, pred))
    } else {
        let mut reports =
            decode(net.recv_from(pred, cfg.timeout)?).ok_or_else(|| unexpected_kind(net, pred))?;
        reports.push(own);
        net.send(succ, encode(&reports))?;
        Ok(vec![own])
    }
}

fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}

fn unexpected(net: &dyn Transport, from: u32, m: &Message) -> TransportError {
    let what = match m {
        Message::Control(c) => format!("{c:?}"),
        Message::Tensor(h, _) => format!("tensor {:?} step {}", h.tag, h.step),
    };
    TransportError::Io {
        context: format!(
            "selftest: unexpected message from {}: {what}",
            net.peer_name(from)
        ),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not part of the selftest protocol",
        ),
    }
}

fn unexpected_kind(net: &dyn Transport, from: u32) -> TransportError {
    unexpected(net, from, &Message::Control(Control::Goodbye))
}
