//! Rendezvous: rank 0 listens at the rendezvous address and collects every node's peer-listening
//! address; when its settings depend on the nodes ([`Offer::Ask`]: the ring's plan from every
//! node's own profile), it asks every node and waits for all the answers; it then hands every
//! node the address table, a fresh run id and the run's settings (so nodes cannot disagree about
//! what they run). Every connection is authenticated with the run's shared secret; every wait is
//! bounded, and a failure on rank 0's side is told to every registered node.

use std::net::SocketAddr;
use std::time::Duration;

use ringtmp_transport::framed::ReadError;
use ringtmp_transport::handshake::handshake;
use ringtmp_transport::secure::FrameConnection;
use ringtmp_transport::{PeerName, TransportConfig, TransportError};
use ringtmp_wire::{Control, Message, NodeAddr};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout_at};

/// Run id used on rendezvous connections only (the real one is chosen by rank 0 and handed out).
const RENDEZVOUS_RUN: u64 = 0x7269_6e67_746d_7030;

/// What every node learns at rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// Run id for all peer links.
    pub run_id: u64,
    /// Every node's peer-listening address, indexed by rank.
    pub nodes: Vec<NodeAddr>,
    /// The run's settings as rank 0 has them (TOML).
    pub settings: String,
}

impl Table {
    /// The socket address of `rank`'s peer listener.
    pub fn addr(&self, rank: u32) -> Result<SocketAddr, TransportError> {
        let node = self
            .nodes
            .get(rank as usize)
            .ok_or(TransportError::NoLink(rank))?;
        node.addr.parse().map_err(|e| TransportError::Io {
            context: format!("address {:?} of rank {rank}", node.addr),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })
    }
}

/// Settings made from the nodes' answers; an `Err` is the reason every node is told.
pub type FromAnswers = Box<dyn FnOnce(Vec<Option<String>>) -> Result<String, String>>;

/// What rank 0 hands out at rendezvous.
pub enum Offer {
    /// The run's settings, ready.
    Settings(String),
    /// Ask every other node `request` first (issue 17.2: time the model on your hardware),
    /// then make the settings from the answers (indexed by rank; rank 0's is `None`).
    Ask {
        /// The request (JSON), sent to every registered node.
        request: String,
        /// Makes the settings from the answers.
        then: FromAnswers,
    },
}

/// Rank 0's side: listens on `bind`, waits for the `world_size - 1` other nodes to register
/// (within `wait`), asks them the offer's request if it has one (their answers within `wait`
/// again), and sends each the table. `own` is rank 0's peer address. When anything fails, the
/// registered nodes are told why (an abort) instead of waiting out their own timeouts.
pub fn serve(
    bind: &str,
    world_size: u32,
    own: SocketAddr,
    offer: Offer,
    secret: &[u8],
    wait: Duration,
) -> Result<Table, TransportError> {
    let runtime = runtime()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(bind).await.map_err(|e| TransportError::Bind { addr: bind.to_string(), source: e })?;
        tracing::info!("rendezvous: rank 0 listening on {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
        let mut cfg = TransportConfig::new(RENDEZVOUS_RUN, 0, secret.to_vec());
        cfg.connect_timeout = wait;
        let deadline = Instant::now() + wait;
        let mut nodes: Vec<Option<NodeAddr>> = vec![None; world_size as usize];
        nodes[0] = Some(NodeAddr { rank: 0, addr: own.to_string() });
        let mut streams: Vec<Registered> = Vec::new();
        let mut refused: Vec<String> = Vec::new();
        let mut pending = tokio::task::JoinSet::new();
        while nodes.iter().any(Option::is_none) {
            tokio::select! {
                accepted = timeout_at(deadline, listener.accept()) => {
                    let (stream, addr) = match accepted {
                        Err(_) => {
                            let missing: Vec<u32> = nodes.iter().enumerate().filter(|(_, n)| n.is_none()).map(|(r, _)| r as u32).collect();
                            let error = TransportError::RendezvousIncomplete { missing, waited: wait, refused };
                            // The nodes that did register would otherwise wait out their own
                            // timeout for a table that never comes: tell them why.
                            abort(streams, &error.to_string()).await;
                            return Err(error);
                        }
                        Ok(Err(e)) => return Err(TransportError::Io { context: "rendezvous accept".into(), source: e }),
                        Ok(Ok(x)) => x,
                    };
                    let cfg = cfg.clone();
                    pending.spawn(async move { register(stream, addr, cfg, world_size).await });
                }
                Some(done) = pending.join_next(), if !pending.is_empty() => match done {
                    Ok(Ok((node, stream))) => {
                        let slot = &mut nodes[node.rank as usize];
                        if slot.is_some() {
                            tracing::warn!("rendezvous: ignoring a second registration of rank {}", node.rank);
                        } else {
                            tracing::info!("rendezvous: rank {} listens on {}", node.rank, node.addr);
                            *slot = Some(node);
                            streams.push(stream);
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!("rendezvous: {e}");
                        if let TransportError::Handshake { peer, reason } = &e {
                            refused.push(format!("{peer}: {reason}"));
                        }
                    }
                    Err(e) => tracing::warn!("rendezvous: registration task failed: {e}"),
                },
            }
        }
        let settings = match offer {
            Offer::Settings(settings) => settings,
            Offer::Ask { request, then } => {
                let answers = match ask(&mut streams, &request, world_size, wait, &cfg).await {
                    Ok(answers) => answers,
                    Err(error) => {
                        abort(streams, &error.to_string()).await;
                        return Err(error);
                    }
                };
                match then(answers) {
                    Ok(settings) => settings,
                    Err(reason) => {
                        abort(streams, &reason).await;
                        return Err(TransportError::Aborted { origin: 0, reason });
                    }
                }
            }
        };
        let table = Table { run_id: rand::random(), nodes: nodes.into_iter().flatten().collect(), settings };
        let message = Message::Control(Control::Table { run_id: table.run_id, nodes: table.nodes.clone(), settings: table.settings.clone() });
        for (mut connection, peer) in streams {
            connection.send(&message)
                .await
                .map_err(|e| TransportError::PeerClosed { peer, reason: format!("sending the table failed: {e}") })?;
        }
        Ok(table)
    })
}

/// A registered node's connection.
type Registered = (FrameConnection, PeerName);

/// Tells every registered node why the rendezvous failed (best effort, a second each).
async fn abort(streams: Vec<Registered>, reason: &str) {
    let abort = Message::Control(Control::Abort {
        origin: 0,
        reason: reason.to_string(),
    });
    for (mut connection, _) in streams {
        let _ = tokio::time::timeout(Duration::from_secs(1), connection.send(&abort)).await;
    }
}

/// Sends `request` to every registered node and collects their answers (all within `wait`):
/// by rank, rank 0's `None`. A node that closes, sends anything else or is late fails the
/// rendezvous, named.
async fn ask(
    streams: &mut [Registered],
    request: &str,
    world_size: u32,
    wait: Duration,
    cfg: &TransportConfig,
) -> Result<Vec<Option<String>>, TransportError> {
    let message = Message::Control(Control::ProfileRequest {
        request: request.to_string(),
    });
    for (connection, peer) in streams.iter_mut() {
        connection
            .send(&message)
            .await
            .map_err(|e| TransportError::PeerClosed {
                peer: peer.clone(),
                reason: format!("sending the profile request failed: {e}"),
            })?;
    }
    tracing::info!(
        "rendezvous: asked {} node(s) to profile the model",
        streams.len()
    );
    // The nodes work at once; their answers wait in the sockets while earlier ones are read.
    let deadline = Instant::now() + wait;
    let mut answers = vec![None; world_size as usize];
    for (connection, peer) in streams.iter_mut() {
        let rank = peer.rank.unwrap_or(0);
        match timeout_at(deadline, connection.recv(&cfg.limits)).await {
            Ok(Ok((Message::Control(Control::Profile { rank: from, report }), _)))
                if from == rank =>
            {
                answers[rank as usize] = Some(report);
            }
            Ok(Ok((other, _))) => {
                return Err(TransportError::Handshake {
                    peer: peer.clone(),
                    reason: format!("expected its profile, got {}", describe(&other)),
                });
            }
            Ok(Err(ReadError::Decode(e))) => {
                return Err(TransportError::Decode {
                    peer: peer.clone(),
                    source: e,
                });
            }
            Ok(Err(_)) => {
                return Err(TransportError::PeerClosed {
                    peer: peer.clone(),
                    reason: "closed before sending its profile".into(),
                });
            }
            Err(_) => {
                return Err(TransportError::Timeout {
                    what: "its profile of the model (--no-node-profile plans from rank 0's)".into(),
                    from: peer.to_string(),
                    waited: wait,
                });
            }
        }
    }
    Ok(answers)
}

/// A message's kind, for errors.
fn describe(message: &Message) -> String {
    match message {
        Message::Control(c) => format!("{c:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap_or("?")
            .to_string(),
        Message::Tensor(h, _) => format!("a {:?} tensor", h.tag),
    }
}

async fn register(
    mut stream: TcpStream,
    addr: SocketAddr,
    cfg: TransportConfig,
    world_size: u32,
) -> Result<(NodeAddr, Registered), TransportError> {
    let (rank, session) = handshake(&mut stream, addr, &cfg, |r| r > 0 && r < world_size).await?;
    let peer = PeerName {
        rank: Some(rank),
        addr: Some(addr),
    };
    let mut connection = FrameConnection::new(stream, session);
    let message = tokio::time::timeout(cfg.handshake_timeout, connection.recv(&cfg.limits)).await;
    match message {
        Ok(Ok((Message::Control(Control::Register { node }), _))) if node.rank == rank => {
            Ok((node, (connection, peer)))
        }
        Ok(Ok(_)) => Err(TransportError::Handshake {
            peer,
            reason: "expected its registration".into(),
        }),
        Ok(Err(ReadError::Decode(e))) => Err(TransportError::Decode { peer, source: e }),
        Ok(Err(_)) => Err(TransportError::PeerClosed {
            peer,
            reason: "closed before registering".into(),
        }),
        Err(_) => Err(TransportError::Timeout {
            what: "registration".into(),
            from: peer.to_string(),
            waited: cfg.handshake_timeout,
        }),
    }
}

/// A non-zero rank's side: connects to rank 0 at `master` (retrying until `wait` runs out),
/// registers `own` as this node's peer address and waits for the table. When rank 0 asks for a
/// profile first, `answer` makes it (from the request's JSON); the wait for the table starts
/// again once it is sent.
pub fn join(
    master: &str,
    rank: u32,
    own: SocketAddr,
    secret: &[u8],
    wait: Duration,
    answer: &dyn Fn(&str) -> String,
) -> Result<Table, TransportError> {
    let runtime = runtime()?;
    runtime.block_on(async {
        let mut cfg = TransportConfig::new(RENDEZVOUS_RUN, rank, secret.to_vec());
        cfg.connect_timeout = wait;
        let deadline = Instant::now() + wait;
        let peer = PeerName {
            rank: Some(0),
            addr: None,
        };
        let mut last = String::from("no attempt");
        let (mut stream, addr) = loop {
            match timeout_at(deadline, TcpStream::connect(master)).await {
                Err(_) => {
                    return Err(TransportError::Connect {
                        peer,
                        waited: wait,
                        reason: format!("rendezvous at {master}: {last}"),
                    });
                }
                Ok(Ok(stream)) => {
                    let addr = stream.peer_addr().map_err(|e| TransportError::Io {
                        context: "rendezvous".into(),
                        source: e,
                    })?;
                    break (stream, addr);
                }
                Ok(Err(e)) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (_, session) = handshake(&mut stream, addr, &cfg, |r| r == 0).await?;
        let peer = PeerName {
            rank: Some(0),
            addr: Some(addr),
        };
        // Advertise an address others can reach: a wildcard listener is announced with the local
        // address of this connection to rank 0.
        let own = if own.ip().is_unspecified() {
            let local = stream.local_addr().map_err(|e| TransportError::Io {
                context: "rendezvous".into(),
                source: e,
            })?;
            SocketAddr::new(local.ip(), own.port())
        } else {
            own
        };
        let register = Message::Control(Control::Register {
            node: NodeAddr {
                rank,
                addr: own.to_string(),
            },
        });
        let mut connection = FrameConnection::new(stream, session);
        connection
            .send(&register)
            .await
            .map_err(|e| TransportError::PeerClosed {
                peer: peer.clone(),
                reason: e.to_string(),
            })?;
        // A little past our own deadline: when rank 0 gives up at the same moment, its reason
        // (an abort naming the missing ranks) arrives instead of a bare timeout.
        let mut table_deadline = deadline + Duration::from_secs(2);
        let mut answered = false;
        let reply = loop {
            let reply = timeout_at(table_deadline, connection.recv(&cfg.limits)).await;
            let Ok(Ok((Message::Control(Control::ProfileRequest { request }), _))) = &reply else {
                break reply;
            };
            if answered {
                return Err(TransportError::Handshake {
                    peer,
                    reason: "asked for a second profile".into(),
                });
            }
            answered = true;
            tracing::info!("rendezvous: rank 0 asked for this node's profile of the model");
            let report = answer(request);
            let message = Message::Control(Control::Profile { rank, report });
            connection
                .send(&message)
                .await
                .map_err(|e| TransportError::PeerClosed {
                    peer: peer.clone(),
                    reason: format!("sending this node's profile failed: {e}"),
                })?;
            // Rank 0 now waits for the slowest node's profile and plans: its own deadline for
            // the answers, and as long again for the table.
            table_deadline = Instant::now() + wait * 2 + Duration::from_secs(2);
        };
        match reply {
            Ok(Ok((
                Message::Control(Control::Table {
                    run_id,
                    nodes,
                    settings,
                }),
                _,
            ))) => Ok(Table {
                run_id,
                nodes,
                settings,
            }),
            Ok(Ok((Message::Control(Control::Abort { origin, reason }), _))) => {
                Err(TransportError::Aborted { origin, reason })
            }
            Ok(Ok(_)) => Err(TransportError::Handshake {
                peer,
                reason: "expected the address table".into(),
            }),
            Ok(Err(ReadError::Decode(e))) => Err(TransportError::Decode { peer, source: e }),
            Ok(Err(_)) => Err(TransportError::PeerClosed {
                peer,
                reason: "closed before sending the address table".into(),
            }),
            Err(_) => Err(TransportError::Timeout {
                what: "the address table".into(),
                from: peer.to_string(),
                waited: wait,
            }),
        }
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, TransportError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TransportError::Io {
            context: "starting the rendezvous runtime".into(),
            source: e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_request(_: &str) -> String {
        panic!("no profile was requested")
    }

    /// A rendezvous address on loopback with a port free right now.
    fn free_master() -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("127.0.0.1:{port}")
    }

    #[test]
    fn four_nodes_meet_and_agree_on_the_table() {
        let master = free_master();
        let own = |r: u32| -> SocketAddr { format!("127.0.0.1:{}", 5000 + r).parse().unwrap() };
        let m = master.clone();
        let host = std::thread::spawn(move || {
            serve(
                &m,
                4,
                own(0),
                Offer::Settings("job = \"selftest\"\n".into()),
                b"s",
                Duration::from_secs(10),
            )
        });
        let joiners: Vec<_> = (1..4)
            .map(|r| {
                let m = master.clone();
                std::thread::spawn(move || {
                    join(&m, r, own(r), b"s", Duration::from_secs(10), &no_request)
                })
            })
            .collect();
        let table = host.join().unwrap().unwrap();
        assert_eq!(
            table.nodes.iter().map(|n| n.rank).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        for j in joiners {
            assert_eq!(j.join().unwrap().unwrap(), table);
        }
        assert_eq!(table.addr(2).unwrap(), own(2));
    }

    #[test]
    fn wrong_secret_cannot_register_and_missing_nodes_time_out() {
        let master = free_master();
        let m = master.clone();
        let own: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let host = std::thread::spawn(move || {
            serve(
                &m,
                2,
                own,
                Offer::Settings(String::new()),
                b"right",
                Duration::from_millis(1500),
            )
        });
        let intruder = join(
            &master,
            1,
            own,
            b"wrong",
            Duration::from_secs(5),
            &no_request,
        )
        .unwrap_err()
        .to_string();
        assert!(intruder.contains("secret"), "{intruder}");
        let err = host.join().unwrap().unwrap_err().to_string();
        assert!(
            err.contains("registration") && err.contains("ranks [1]"),
            "{err}"
        );
        // Issue 10.6: rank 0's final error names the address refused and the likely cause.
        assert!(
            err.contains("127.0.0.1:") && err.contains("different RINGTMP_SECRET"),
            "{err}"
        );
    }

    // Issue 10.6: a rank that registered hears why the rendezvous failed instead of waiting out
    // its own timeout.
    #[test]
    fn r10_registered_ranks_hear_why_rendezvous_failed() {
        let master = free_master();
        let own: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let m = master.clone();
        let host = std::thread::spawn(move || {
            serve(
                &m,
                3,
                own,
                Offer::Settings(String::new()),
                b"right",
                Duration::from_millis(1500),
            )
        });
        let started = std::time::Instant::now();
        let m = master.clone();
        let good = std::thread::spawn(move || {
            join(&m, 1, own, b"right", Duration::from_secs(20), &no_request)
        });
        let _ = join(
            &master,
            2,
            own,
            b"wrong",
            Duration::from_secs(5),
            &no_request,
        );
        let err = good.join().unwrap().unwrap_err().to_string();
        assert!(
            err.contains("rank 0 aborted the run") && err.contains("ranks [2]"),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert!(host.join().unwrap().is_err());
    }

    // Issue 17.2: rank 0 asks every node first, and plans from their answers.
    #[test]
    fn rank_0_asks_every_node_and_makes_the_settings_from_the_answers() {
        let master = free_master();
        let own = |r: u32| -> SocketAddr { format!("127.0.0.1:{}", 5000 + r).parse().unwrap() };
        let m = master.clone();
        let host = std::thread::spawn(move || {
            let then: FromAnswers = Box::new(|answers| {
                Ok(answers
                    .iter()
                    .map(|a| a.clone().unwrap_or_else(|| "-".into()))
                    .collect::<Vec<_>>()
                    .join(","))
            });
            serve(
                &m,
                3,
                own(0),
                Offer::Ask {
                    request: "time it".into(),
                    then,
                },
                b"s",
                Duration::from_secs(10),
            )
        });
        let joiners: Vec<_> = (1..3)
            .map(|r| {
                let m = master.clone();
                std::thread::spawn(move || {
                    let answer = move |q: &str| format!("{q} on {r}");
                    join(&m, r, own(r), b"s", Duration::from_secs(10), &answer)
                })
            })
            .collect();
        let table = host.join().unwrap().unwrap();
        assert_eq!(table.settings, "-,time it on 1,time it on 2");
        for j in joiners {
            assert_eq!(j.join().unwrap().unwrap(), table);
        }
    }

    // A plan that fails on the answers, or a node that does not answer in time, ends the
    // rendezvous on every node with the reason, not a hang.
    #[test]
    fn a_failed_plan_or_a_silent_node_is_everyone_s_error() {
        let master = free_master();
        let own: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let m = master.clone();
        let host = std::thread::spawn(move || {
            let then: FromAnswers = Box::new(|_| Err("node 1 is too slow for any plan".into()));
            let offer = Offer::Ask {
                request: "q".into(),
                then,
            };
            serve(&m, 2, own, offer, b"s", Duration::from_secs(10))
        });
        let err = join(&master, 1, own, b"s", Duration::from_secs(10), &|_| {
            "a".into()
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("too slow for any plan"), "{err}");
        assert!(host.join().unwrap().is_err());

        let master = free_master();
        let m = master.clone();
        let started = std::time::Instant::now();
        let host = std::thread::spawn(move || {
            let then: FromAnswers = Box::new(|_| Ok(String::new()));
            let offer = Offer::Ask {
                request: "q".into(),
                then,
            };
            serve(&m, 2, own, offer, b"s", Duration::from_millis(1500))
        });
        let slow = |_: &str| {
            std::thread::sleep(Duration::from_secs(3));
            "late".to_string()
        };
        let node = join(&master, 1, own, b"s", Duration::from_millis(1500), &slow);
        let err = host.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("profile") && err.contains("rank 1"), "{err}");
        assert!(node.is_err());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }
}
