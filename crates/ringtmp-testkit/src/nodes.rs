//! One test body, many networks: [`run_nodes`] runs a closure per rank on real loopback TCP links
//! or on the seeded simulated network, over any topology, and collects the results in rank order.

use std::collections::{BTreeMap, BTreeSet};
use std::thread;

use ringtmp_transport::sim::{SimConfig, SimNetwork};
use ringtmp_transport::{Network, SentRecord, Transport, TransportConfig, bind_listener};

/// Which network the nodes of a test run on.
// (Built once per test and passed by reference: boxing the configuration would only add noise.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Backend {
    /// Authenticated TCP links on 127.0.0.1, one thread per node.
    Tcp,
    /// The simulated network with this configuration (seed, links, compute cost, faults).
    Sim(SimConfig),
}

impl Backend {
    /// The simulated network with defaults and `seed`.
    pub fn sim(seed: u64) -> Self {
        Self::Sim(SimConfig::new(seed))
    }

    /// A short name for test output.
    pub fn name(&self) -> String {
        match self {
            Self::Tcp => "tcp".into(),
            Self::Sim(c) => format!("sim(seed {})", c.seed),
        }
    }
}

/// Ring neighbours of every rank.
pub fn ring(n: u32) -> Vec<BTreeSet<u32>> {
    (0..n)
        .map(|r| {
            [(r + 1) % n, (r + n - 1) % n]
                .into_iter()
                .filter(|p| *p != r)
                .collect()
        })
        .collect()
}

/// The parameter server's star: every worker links to every server, and servers link to server
/// 0 (reports and checkpoint entries).
pub fn star(n: u32, servers: u32) -> Vec<BTreeSet<u32>> {
    (0..n)
        .map(|r| {
            if r == 0 {
                (1..n).collect()
            } else if r < servers {
                (servers..n).chain([0]).collect()
            } else {
                (0..servers).collect()
            }
        })
        .collect()
}

/// What [`run_nodes`] returns: each rank's result, and what the audited rank sent.
pub struct Ran<R> {
    /// Per rank, in rank order.
    pub results: Vec<R>,
    /// Every message the audited rank sent (empty without one).
    pub audit: Vec<SentRecord>,
    /// The simulated network's trace hash (equal for equal runs; 0 on TCP).
    pub trace: u64,
    /// How long the run took: virtual time in simulation, wall time on TCP.
    pub elapsed: std::time::Duration,
}

/// Runs `body(rank, net)` for every rank on `backend` with links along `neighbours`. The body
/// closes (or aborts) its network as a node would. With `audit`, that rank's sent messages are
/// recorded.
///
/// # Panics
/// If the links cannot be set up, or a body panics.
pub fn run_nodes<R: Send>(
    backend: &Backend,
    neighbours: Vec<BTreeSet<u32>>,
    audit: Option<u32>,
    body: impl Fn(u32, &mut dyn Transport) -> R + Sync,
) -> Ran<R> {
    match backend {
        Backend::Tcp => {
            let started = std::time::Instant::now();
            let nets = loopback(&neighbours);
            let body = &body;
            let (results, audits): (Vec<R>, Vec<Vec<SentRecord>>) = thread::scope(|scope| {
                let handles: Vec<_> = nets
                    .into_iter()
                    .enumerate()
                    .map(|(r, mut net)| {
                        scope.spawn(move || {
                            if audit == Some(r as u32) {
                                net.enable_audit();
                            }
                            let result = body(r as u32, &mut net);
                            (result, net.audit_log())
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .unzip()
            });
            Ran {
                results,
                audit: audits.into_iter().flatten().collect(),
                trace: 0,
                elapsed: started.elapsed(),
            }
        }
        Backend::Sim(cfg) => {
            let net = SimNetwork::new(cfg.clone(), neighbours);
            let ran = net.run(|mut node| {
                let rank = node.rank();
                if audit == Some(rank) {
                    node.enable_audit();
                }
                let result = body(rank, &mut node);
                let log = node.audit_log();
                (result, log)
            });
            let (results, audits): (Vec<R>, Vec<Vec<SentRecord>>) = ran.into_iter().unzip();
            Ran {
                results,
                audit: audits.into_iter().flatten().collect(),
                trace: net.trace_hash(),
                elapsed: net.elapsed(),
            }
        }
    }
}

/// Real TCP networks on 127.0.0.1 for every rank, connected along `neighbours`.
///
/// # Panics
/// If a listener cannot be bound or the links cannot be established.
pub fn loopback(neighbours: &[BTreeSet<u32>]) -> Vec<Network> {
    let listeners: Vec<_> = neighbours
        .iter()
        .map(|_| bind_listener("127.0.0.1:0").expect("a loopback listener"))
        .collect();
    let addresses: BTreeMap<u32, _> = listeners
        .iter()
        .enumerate()
        .map(|(r, l)| (r as u32, l.local_addr().expect("its address")))
        .collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .zip(neighbours.iter().cloned())
        .enumerate()
        .map(|(r, (listener, peers))| {
            let addresses = addresses.clone();
            thread::spawn(move || {
                Network::connect(
                    TransportConfig::new(1, r as u32, b"ringtmp test secret".to_vec()),
                    listener,
                    &addresses,
                    &peers,
                )
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .expect("connecting thread")
                .expect("loopback links")
        })
        .collect()
}
