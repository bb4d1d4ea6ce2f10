//! Rendezvous: rank 0 listens at the rendezvous address and collects every node's peer-listening
//! address; when its settings depend on the nodes ([`Offer::Ask`]: the ring's plan from every
//! node's own profile), it asks every node and waits for all the answers; it then hands every
//! node the address table, a fresh run id and the run's settings (so nodes cannot disagree about
//! what they run), waits for every node to confirm it has them, and only then tells them all to
//! start. Every connection is authenticated with the run's shared secret; every wait is bounded,
//! and a failure on rank 0's side — or a node that never confirms its table — is told to every
//! registered node within seconds.
//!
//! What a stranger may cost rank 0 before it has proved the secret is bounded by
//! [`ringtmp_transport::admission`]: greetings in progress, their frames and deadline, failed
//! accepts retried, refusals counted. A node that proved the secret but cannot take part (its
//! rank is taken, it was started with another world size or a rank beyond it) is told why
//! ([`Control::Refused`]) and the others go on waiting for the right one.

use std::net::SocketAddr;
use std::time::Duration;

use ringtmp_transport::admission::{self, Admission, Refusals};
use ringtmp_transport::framed::ReadError;
use ringtmp_transport::handshake::handshake;
use ringtmp_transport::secure::FrameConnection;
use ringtmp_transport::{PeerName, TransportConfig, TransportError};
use ringtmp_wire::{Control, Limits, Message, NodeAddr};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout_at};

/// Run id used on rendezvous connections only (the real one is chosen by rank 0 and handed out).
const RENDEZVOUS_RUN: u64 = 0x7269_6e67_746d_7030;

/// Largest header of a message on an authenticated rendezvous connection: the run's settings
/// carry the model and the dataset's description (a table of thousands of columns, a list of
/// thousands of class names), which may pass the links' 64 KiB.
pub const MAX_SETTINGS_BYTES: u32 = 16 << 20;

/// Longest reason an abort or a refusal carries (it must always fit in a frame).
const MAX_REASON_CHARS: usize = 4_096;

/// Pause after a failed accept before the next.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

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
    /// Ask every other node `request` first (time the model on your hardware), then make the
    /// settings from the answers (indexed by rank; rank 0's is `None`).
    Ask {
        /// The request (JSON), sent to every registered node.
        request: String,
        /// Makes the settings from the answers.
        then: FromAnswers,
    },
}

/// The limits of an authenticated rendezvous connection.
fn rendezvous_limits(cfg: &TransportConfig) -> Limits {
    Limits {
        max_header_bytes: cfg.limits.max_header_bytes.max(MAX_SETTINGS_BYTES),
        ..cfg.limits
    }
}

/// Rank 0's side: listens on `bind`, waits for the `world_size - 1` other nodes to register
/// (within `wait`), asks them the offer's request if it has one (their answers within `wait`
/// again), sends each the table and starts the run once all have confirmed it. `own` is rank 0's
/// peer address. When anything fails, the registered nodes are told why (an abort) instead of
/// waiting out their own timeouts.
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
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|e| TransportError::Bind {
                addr: bind.to_string(),
                source: e,
            })?;
        tracing::info!(
            "rendezvous: rank 0 listening on {}",
            listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default()
        );
        let mut cfg = TransportConfig::new(RENDEZVOUS_RUN, 0, secret.to_vec());
        cfg.connect_timeout = wait;
        let mut registry = Registry::new(world_size, own);
        if let Err(error) = gather(&listener, &cfg, &mut registry, wait).await {
            // The nodes that did register would otherwise wait out their own timeout for a
            // table that never comes: tell them why.
            abort(registry.streams, &error.to_string()).await;
            return Err(error);
        }
        // Registration is over: later strangers find the port closed.
        drop(listener);
        let Registry {
            nodes, mut streams, ..
        } = registry;
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
        let table = Table {
            run_id: rand::random(),
            nodes: nodes.into_iter().flatten().collect(),
            settings,
        };
        hand_out(streams, &table, &cfg).await?;
        Ok(table)
    })
}

/// A registered node's connection.
type Registered = (FrameConnection, PeerName);

/// Who has registered so far.
struct Registry {
    world_size: u32,
    nodes: Vec<Option<NodeAddr>>,
    streams: Vec<Registered>,
    refused: Refusals,
}

impl Registry {
    fn new(world_size: u32, own: SocketAddr) -> Self {
        let mut nodes = vec![None; world_size as usize];
        nodes[0] = Some(NodeAddr {
            rank: 0,
            addr: own.to_string(),
        });
        Self {
            world_size,
            nodes,
            streams: Vec::new(),
            refused: Refusals::default(),
        }
    }

    fn missing(&self) -> Vec<u32> {
        (0..self.world_size)
            .filter(|r| self.nodes[*r as usize].is_none())
            .collect()
    }

    /// Takes a node that proved the secret and registered, unless its rank is taken: then it is
    /// told so and the real one is still awaited.
    async fn take(&mut self, node: NodeAddr, (mut connection, peer): Registered) {
        let slot = &mut self.nodes[node.rank as usize];
        if let Some(first) = slot {
            let reason = format!(
                "rank {} is already registered (from {}); every node needs its own --rank",
                node.rank, first.addr
            );
            tracing::warn!("rendezvous: refused {peer}: {reason}");
            refuse(&mut connection, &reason).await;
            self.refused.push(format!("{peer}: {reason}"));
            return;
        }
        tracing::info!("rendezvous: rank {} listens on {}", node.rank, node.addr);
        *slot = Some(node);
        self.streams.push((connection, peer));
    }
}

/// Accepts connections until every rank has registered or `wait` has passed.
async fn gather(
    listener: &TcpListener,
    cfg: &TransportConfig,
    registry: &mut Registry,
    wait: Duration,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + wait;
    let mut pending = Admission::default();
    let world_size = registry.world_size;
    while !registry.missing().is_empty() {
        tokio::select! {
            accepted = timeout_at(deadline, admission::accept(listener, ACCEPT_RETRY)) => {
                let Ok((stream, addr)) = accepted else {
                    return Err(TransportError::RendezvousIncomplete {
                        missing: registry.missing(),
                        waited: wait,
                        refused: registry.refused.clone(),
                    });
                };
                let cfg = cfg.clone();
                pending.admit(addr, register(stream, addr, cfg, world_size));
            }
            Some(done) = pending.next(), if !pending.is_empty() => match done {
                Ok(Ok((node, registered))) => registry.take(node, registered).await,
                Ok(Err(e)) => {
                    tracing::warn!("rendezvous: {e}");
                    registry.refused.push(e.to_string());
                }
                Err(e) => tracing::warn!("rendezvous: registration task failed: {e}"),
            },
        }
    }
    Ok(())
}

/// Sends every node the table, waits for each to confirm it, then tells them all to start. A
/// node that does not confirm (it closed, its record failed its check, it is silent) ends the
/// run on every node, named.
async fn hand_out(
    mut streams: Vec<Registered>,
    table: &Table,
    cfg: &TransportConfig,
) -> Result<(), TransportError> {
    let message = Message::Control(Control::Table {
        run_id: table.run_id,
        nodes: table.nodes.clone(),
        settings: table.settings.clone(),
    });
    let size = ringtmp_wire::encoded_len(&message);
    if size > MAX_SETTINGS_BYTES as usize {
        let reason = format!(
            "the run's settings take {size} bytes, more than the {MAX_SETTINGS_BYTES} a \
             rendezvous carries"
        );
        abort(streams, &reason).await;
        return Err(TransportError::Aborted { origin: 0, reason });
    }
    let mut failure = None;
    for (connection, peer) in &mut streams {
        if let Err(e) = connection.send(&message).await {
            failure = Some(TransportError::PeerClosed {
                peer: peer.clone(),
                reason: format!("sending the table failed: {e}"),
            });
            break;
        }
    }
    if failure.is_none() {
        let deadline = Instant::now() + cfg.handshake_timeout;
        let limits = rendezvous_limits(cfg);
        for (connection, peer) in &mut streams {
            match recv_within(
                connection,
                peer,
                deadline,
                &limits,
                "its receipt of the table",
            )
            .await
            {
                Ok(Message::Control(Control::TableReceived { rank }))
                    if Some(rank) == peer.rank => {}
                Ok(other) => {
                    failure = Some(TransportError::Handshake {
                        peer: peer.clone(),
                        reason: format!(
                            "expected its receipt of the table, got {}",
                            describe(&other)
                        ),
                    });
                }
                Err(e) => failure = Some(e),
            }
            if failure.is_some() {
                break;
            }
        }
    }
    if let Some(error) = failure {
        abort(streams, &format!("the run cannot start: {error}")).await;
        return Err(error);
    }
    let start = Message::Control(Control::Start);
    for (connection, peer) in &mut streams {
        connection
            .send(&start)
            .await
            .map_err(|e| TransportError::PeerClosed {
                peer: peer.clone(),
                reason: format!("sending the start failed: {e}"),
            })?;
    }
    Ok(())
}

/// The next message on an authenticated rendezvous connection, by `deadline`; every failure
/// says what was awaited and from whom.
async fn recv_within(
    connection: &mut FrameConnection,
    peer: &PeerName,
    deadline: Instant,
    limits: &Limits,
    what: &str,
) -> Result<Message, TransportError> {
    let waited = deadline.saturating_duration_since(Instant::now());
    match timeout_at(deadline, connection.recv(limits)).await {
        Ok(Ok((message, _))) => Ok(message),
        Ok(Err(failure)) => Err(read_failure(peer, failure, what)),
        Err(_) => Err(TransportError::Timeout {
            what: what.into(),
            from: peer.to_string(),
            waited,
        }),
    }
}

/// What a failed read on an authenticated connection means.
fn read_failure(peer: &PeerName, failure: ReadError, what: &str) -> TransportError {
    match failure {
        ReadError::Decode(e) => TransportError::Decode {
            peer: peer.clone(),
            source: e,
        },
        // A private connection's record failed its check: someone on the path changed it.
        ReadError::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => TransportError::Forged {
            peer: peer.clone(),
            reason: format!("{e} (while waiting for {what})"),
        },
        ReadError::Io(e) => TransportError::PeerClosed {
            peer: peer.clone(),
            reason: format!("{e} before sending {what}"),
        },
        ReadError::Closed => TransportError::PeerClosed {
            peer: peer.clone(),
            reason: format!("closed before sending {what}"),
        },
    }
}

/// Tells every registered node why the rendezvous failed (best effort, a second each).
async fn abort(streams: Vec<Registered>, reason: &str) {
    let abort = Message::Control(Control::Abort {
        origin: 0,
        reason: admission::clip(reason, MAX_REASON_CHARS),
    });
    for (mut connection, _) in streams {
        let _ = tokio::time::timeout(Duration::from_secs(1), connection.send(&abort)).await;
    }
}

/// Tells one node it is not taken into the run, and why (best effort, a second).
async fn refuse(connection: &mut FrameConnection, reason: &str) {
    let refused = Message::Control(Control::Refused {
        reason: admission::clip(reason, MAX_REASON_CHARS),
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), connection.send(&refused)).await;
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
    let limits = rendezvous_limits(cfg);
    let mut answers = vec![None; world_size as usize];
    for (connection, peer) in streams.iter_mut() {
        let rank = peer.rank.unwrap_or(0);
        let what = "its profile of the model (--no-node-profile plans from rank 0's)";
        match recv_within(connection, peer, deadline, &limits, what).await? {
            Message::Control(Control::Profile { rank: from, report }) if from == rank => {
                answers[rank as usize] = Some(report);
            }
            other => {
                return Err(TransportError::Handshake {
                    peer: peer.clone(),
                    reason: format!("expected its profile, got {}", describe(&other)),
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

/// One connection's registration: the greeting, then the node's address. A node that proved
/// the secret but was started for another run shape is told why before it is dropped.
async fn register(
    mut stream: TcpStream,
    addr: SocketAddr,
    cfg: TransportConfig,
    world_size: u32,
) -> Result<(NodeAddr, Registered), TransportError> {
    // Any rank but 0 may greet: one beyond the world is refused once it has proved the secret,
    // with a reason it can print.
    let (rank, session) = handshake(&mut stream, addr, &cfg, |r| r > 0).await?;
    let peer = PeerName {
        rank: Some(rank),
        addr: Some(addr),
    };
    let mut connection = FrameConnection::new(stream, session);
    let deadline = Instant::now() + cfg.handshake_timeout;
    let limits = rendezvous_limits(&cfg);
    let message = recv_within(
        &mut connection,
        &peer,
        deadline,
        &limits,
        "its registration",
    )
    .await?;
    let (node, theirs) = match message {
        Message::Control(Control::Register { node, world_size }) if node.rank == rank => {
            (node, world_size)
        }
        other => {
            return Err(TransportError::Handshake {
                peer,
                reason: format!("expected its registration, got {}", describe(&other)),
            });
        }
    };
    let wrong = if theirs != world_size {
        Some(format!(
            "it was started with --world-size {theirs}, rank 0 with {world_size}"
        ))
    } else if rank >= world_size {
        Some(format!(
            "it claims rank {rank}, beyond a world of {world_size} (ranks 0 to {})",
            world_size.saturating_sub(1)
        ))
    } else {
        None
    };
    if let Some(reason) = wrong {
        refuse(&mut connection, &reason).await;
        return Err(TransportError::Handshake { peer, reason });
    }
    Ok((node, (connection, peer)))
}

/// A non-zero rank's side: connects to rank 0 at `master` (retrying until `wait` runs out),
/// registers `own` as this node's peer address and waits for the table, confirms it and waits
/// for the start. When rank 0 asks for a profile first, `answer` makes it (from the request's
/// JSON); the wait for the table starts again once it is sent.
pub fn join(
    master: &str,
    rank: u32,
    world_size: u32,
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
        let listening = own;
        let (mut connection, peer, mut table) = loop {
            let (mut connection, peer, own) = connect(master, listening, &cfg, deadline).await?;
            let register = Message::Control(Control::Register {
                node: NodeAddr {
                    rank,
                    addr: own.to_string(),
                },
                world_size,
            });
            if let Err(e) = connection.send(&register).await {
                // Closed under the registration: the same cut as below, met while sending.
                if Instant::now() < deadline {
                    tracing::info!("rendezvous: registration cut short ({e}); again");
                    continue;
                }
                return Err(TransportError::PeerClosed {
                    peer: peer.clone(),
                    reason: e.to_string(),
                });
            }
            match await_table(&mut connection, &peer, rank, &cfg, deadline, answer).await {
                Ok(table) => break (connection, peer, table),
                // Closed before rank 0 said anything: it cut this greeting (its oldest) after
                // the handshake, before reading the registration — many nodes of one address
                // arriving at once, a local launcher's — so this node registers again.
                Err(TransportError::GreetingCut { reason, .. }) if Instant::now() < deadline => {
                    tracing::info!("rendezvous: registration cut short ({reason}); again");
                }
                Err(TransportError::GreetingCut { peer, reason }) => {
                    return Err(TransportError::PeerClosed { peer, reason });
                }
                Err(e) => return Err(e),
            }
        };
        if let Some(reached) = peer.addr {
            fill_wildcards(&mut table, reached.ip());
        }
        let received = Message::Control(Control::TableReceived { rank });
        connection
            .send(&received)
            .await
            .map_err(|e| TransportError::PeerClosed {
                peer: peer.clone(),
                reason: format!("confirming the table failed: {e}"),
            })?;
        // Rank 0 waits a handshake timeout for every node's receipt, then starts or aborts.
        let start_by = Instant::now() + cfg.handshake_timeout + Duration::from_secs(5);
        let limits = rendezvous_limits(&cfg);
        match recv_within(
            &mut connection,
            &peer,
            start_by,
            &limits,
            "the start of the run",
        )
        .await?
        {
            Message::Control(Control::Start) => Ok(table),
            other => Err(unexpected(&peer, other, "the start of the run")),
        }
    })
}

/// Connects to rank 0 and greets it, dialling again until `deadline` while the port is closed
/// or a greeting is cut short (rank 0 closes its oldest greetings under a flood of strangers).
/// Returns the connection, rank 0's name and the address this node advertises (a wildcard
/// listener is announced with the local address of this connection to rank 0).
async fn connect(
    master: &str,
    own: SocketAddr,
    cfg: &TransportConfig,
    deadline: Instant,
) -> Result<(FrameConnection, PeerName, SocketAddr), TransportError> {
    let mut last = String::from("no attempt");
    loop {
        let attempt = async {
            let mut stream = TcpStream::connect(master)
                .await
                .map_err(|e| e.to_string())?;
            let addr = stream.peer_addr().map_err(|e| e.to_string())?;
            let local = stream.local_addr().map_err(|e| e.to_string())?;
            match handshake(&mut stream, addr, cfg, |r| r == 0)
                .await
                .map_err(|e| e.dialled_as(0))
            {
                Ok((_, session)) => Ok(Ok((stream, addr, local, session))),
                Err(TransportError::GreetingCut { reason, .. }) => {
                    Err(format!("the greeting was cut short: {reason}"))
                }
                Err(e) => Ok(Err(e)),
            }
        };
        match timeout_at(deadline, attempt).await {
            Err(_) => {
                return Err(TransportError::Connect {
                    peer: PeerName {
                        rank: Some(0),
                        addr: None,
                    },
                    waited: cfg.connect_timeout,
                    reason: format!("rendezvous at {master}: {last}"),
                });
            }
            Ok(Ok(Ok((stream, addr, local, session)))) => {
                let peer = PeerName {
                    rank: Some(0),
                    addr: Some(addr),
                };
                let own = if own.ip().is_unspecified() {
                    SocketAddr::new(local.ip(), own.port())
                } else {
                    own
                };
                return Ok((FrameConnection::new(stream, session), peer, own));
            }
            Ok(Ok(Err(refusal))) => return Err(refusal),
            Ok(Err(reason)) => last = reason,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for rank 0's table, answering its profile request first if it sends one; a close
/// before rank 0 sent anything is a greeting cut short (the caller registers again).
async fn await_table(
    connection: &mut FrameConnection,
    peer: &PeerName,
    rank: u32,
    cfg: &TransportConfig,
    deadline: Instant,
    answer: &dyn Fn(&str) -> String,
) -> Result<Table, TransportError> {
    let limits = rendezvous_limits(cfg);
    // A little past our own deadline: when rank 0 gives up at the same moment, its reason (an
    // abort naming the missing ranks) arrives instead of a bare timeout.
    let mut table_deadline = deadline + Duration::from_secs(2);
    let mut answered = false;
    let mut heard = false;
    loop {
        let what = "the address table";
        let message = match recv_within(connection, peer, table_deadline, &limits, what).await {
            Ok(message) => message,
            Err(TransportError::PeerClosed { peer, reason }) if !heard => {
                return Err(TransportError::GreetingCut { peer, reason });
            }
            Err(e) => return Err(e),
        };
        heard = true;
        match message {
            Message::Control(Control::ProfileRequest { request }) => {
                if answered {
                    return Err(TransportError::Handshake {
                        peer: peer.clone(),
                        reason: "asked for a second profile".into(),
                    });
                }
                answered = true;
                tracing::info!("rendezvous: rank 0 asked for this node's profile of the model");
                let report = answer(&request);
                let message = Message::Control(Control::Profile { rank, report });
                connection
                    .send(&message)
                    .await
                    .map_err(|e| TransportError::PeerClosed {
                        peer: peer.clone(),
                        reason: format!("sending this node's profile failed: {e}"),
                    })?;
                // Rank 0 now waits for the slowest node's profile and plans: its own deadline
                // for the answers, and as long again for the table.
                table_deadline = Instant::now() + cfg.connect_timeout * 2 + Duration::from_secs(2);
            }
            Message::Control(Control::Table {
                run_id,
                nodes,
                settings,
            }) => {
                return Ok(Table {
                    run_id,
                    nodes,
                    settings,
                });
            }
            other => return Err(unexpected(peer, other, what)),
        }
    }
}

/// A node listening on every interface (`0.0.0.0`, `[::]`) that could not say which one its
/// peers reach it at is advertised as such; this node reaches rank 0 at `rank_0`, so rank 0's
/// wildcard entry becomes that address (the interface toward rank 0 is the one toward its
/// listener too). Connecting to a wildcard address would reach this machine, not rank 0's.
fn fill_wildcards(table: &mut Table, rank_0: std::net::IpAddr) {
    if let Some(node) = table.nodes.iter_mut().find(|n| n.rank == 0)
        && let Ok(addr) = node.addr.parse::<SocketAddr>()
        && addr.ip().is_unspecified()
    {
        node.addr = SocketAddr::new(rank_0, addr.port()).to_string();
    }
}

/// What rank 0 sent instead of `what`: its abort or refusal, or a protocol error.
fn unexpected(peer: &PeerName, message: Message, what: &str) -> TransportError {
    match message {
        Message::Control(Control::Abort { origin, reason }) => {
            TransportError::Aborted { origin, reason }
        }
        Message::Control(Control::Refused { reason }) => TransportError::RefusedBy {
            peer: peer.clone(),
            reason,
        },
        other => TransportError::Handshake {
            peer: peer.clone(),
            reason: format!("expected {what}, got {}", describe(&other)),
        },
    }
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
                    join(&m, r, 4, own(r), b"s", Duration::from_secs(10), &no_request)
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
            2,
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
        // Rank 0's final error names the address refused and the likely cause.
        assert!(
            err.contains("127.0.0.1:") && err.contains("different RINGTMP_SECRET"),
            "{err}"
        );
    }

    // A rank that registered hears why the rendezvous failed instead of waiting out
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
            join(
                &m,
                1,
                3,
                own,
                b"right",
                Duration::from_secs(20),
                &no_request,
            )
        });
        let _ = join(
            &master,
            2,
            3,
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

    // Rank 0 asks every node first, and plans from their answers.
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
                    join(&m, r, 3, own(r), b"s", Duration::from_secs(10), &answer)
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
        let err = join(&master, 1, 2, own, b"s", Duration::from_secs(10), &|_| {
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
        let node = join(&master, 1, 2, own, b"s", Duration::from_millis(1500), &slow);
        let err = host.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("profile") && err.contains("rank 1"), "{err}");
        assert!(node.is_err());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    /// Rank 0 of a world of `world` serving `settings` for `wait`, in a thread.
    fn host(
        master: &str,
        world: u32,
        settings: &str,
        wait: Duration,
    ) -> std::thread::JoinHandle<Result<Table, TransportError>> {
        let (m, settings) = (master.to_string(), settings.to_string());
        let own: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        std::thread::spawn(move || serve(&m, world, own, Offer::Settings(settings), b"s", wait))
    }

    fn joiner(
        master: &str,
        rank: u32,
        world: u32,
        wait: Duration,
    ) -> std::thread::JoinHandle<Result<Table, TransportError>> {
        let m = master.to_string();
        let own: SocketAddr = format!("127.0.0.1:{}", 5000 + rank).parse().unwrap();
        std::thread::spawn(move || join(&m, rank, world, own, b"s", wait, &no_request))
    }

    // A node that proved the secret but cannot take part is told why, and the run waits for the
    // right one: a rank already taken, another world size, a rank beyond the world.
    #[test]
    fn a_node_of_another_shape_is_told_why_and_the_run_goes_on() {
        let master = free_master();
        let rank_0 = host(&master, 3, "", Duration::from_secs(10));
        let first = joiner(&master, 1, 3, Duration::from_secs(10));
        // Let the first rank 1 register before its double tries.
        std::thread::sleep(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let double = join(
            &master,
            1,
            3,
            "127.0.0.1:6001".parse().unwrap(),
            b"s",
            Duration::from_secs(10),
            &no_request,
        )
        .unwrap_err();
        assert!(
            matches!(&double, TransportError::RefusedBy { .. })
                && double
                    .to_string()
                    .contains("rank 1 is already registered (from 127.0.0.1:5001)"),
            "{double}"
        );
        let bigger = join(
            &master,
            2,
            4,
            "127.0.0.1:6002".parse().unwrap(),
            b"s",
            Duration::from_secs(10),
            &no_request,
        )
        .unwrap_err()
        .to_string();
        assert!(bigger.contains("--world-size 4, rank 0 with 3"), "{bigger}");
        let beyond = join(
            &master,
            3,
            3,
            "127.0.0.1:6003".parse().unwrap(),
            b"s",
            Duration::from_secs(10),
            &no_request,
        )
        .unwrap_err()
        .to_string();
        assert!(beyond.contains("rank 3, beyond a world of 3"), "{beyond}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        let second = joiner(&master, 2, 3, Duration::from_secs(10));
        let table = rank_0.join().unwrap().unwrap();
        assert_eq!(first.join().unwrap().unwrap(), table);
        assert_eq!(second.join().unwrap().unwrap(), table);
    }

    /// Forwards one connection from `listener` to `target`, flipping the last byte of every
    /// chunk of more than 1,000 bytes from the target: the table's record (the greeting's are
    /// under 100 bytes each), its authentication tag altered.
    fn tampering_proxy(listener: std::net::TcpListener, target: String) {
        use std::io::{Read, Write};
        std::thread::spawn(move || {
            let (mut client, _) = listener.accept().unwrap();
            // Rank 0 may not listen yet: dial until it does (bounded).
            let until = std::time::Instant::now() + Duration::from_secs(10);
            let mut server = loop {
                match std::net::TcpStream::connect(&target) {
                    Ok(s) => break s,
                    Err(e) if std::time::Instant::now() > until => panic!("rank 0: {e}"),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            let (mut c_read, mut s_write) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut s_write);
            });
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = match server.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if n > 1_000 {
                    buf[n - 1] ^= 0x01;
                }
                if client.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        });
    }

    // A table altered on its way to one node: that node names the tampering, and rank 0 and
    // every other node hear within seconds which node could not take its table, instead of
    // waiting out their connect timeouts for it.
    #[test]
    fn a_table_tampered_with_on_the_way_ends_the_rendezvous_on_every_node() {
        let master = free_master();
        let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let via_proxy = proxy.local_addr().unwrap().to_string();
        tampering_proxy(proxy, master.clone());
        let started = std::time::Instant::now();
        let rank_0 = host(&master, 3, &"x".repeat(4_000), Duration::from_secs(20));
        let honest = joiner(&master, 2, 3, Duration::from_secs(20));
        let tampered = joiner(&via_proxy, 1, 3, Duration::from_secs(20));
        let tampered = tampered.join().unwrap().unwrap_err();
        assert!(
            matches!(tampered, TransportError::Forged { .. }),
            "the altered record is named: {tampered}"
        );
        let honest = honest.join().unwrap().unwrap_err().to_string();
        assert!(
            honest.contains("rank 0 aborted the run") && honest.contains("rank 1"),
            "{honest}"
        );
        let rank_0 = rank_0.join().unwrap().unwrap_err().to_string();
        assert!(rank_0.contains("rank 1"), "{rank_0}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    // However many strangers knock, rank 0's error, and the abort it sends, stay short: a
    // count and the last few reasons.
    #[test]
    fn refusals_are_counted_not_listed() {
        use std::io::Write;
        let master = free_master();
        let rank_0 = host(&master, 3, "", Duration::from_secs(4));
        let registered = joiner(&master, 1, 3, Duration::from_secs(20));
        // Rank 0 listens once its thread has started: strangers knock until 300 got in (a
        // knock before it listens is refused by the kernel and does not count), for at most 3 s.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let mut knocked = 0;
        while knocked < 300 && std::time::Instant::now() < deadline {
            match std::net::TcpStream::connect(&master) {
                Ok(mut junk) => {
                    let _ = junk.write_all(b"GET / HTTP/1.1\r\n\r\n");
                    knocked += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        assert!(knocked > 0, "rank 0 never listened");
        let err = rank_0.join().unwrap().unwrap_err().to_string();
        assert!(
            err.contains("connection(s) refused") && err.contains("ranks [2]"),
            "{err}"
        );
        assert!(err.len() < 2_000, "{} bytes: {err}", err.len());
        let told = registered.join().unwrap().unwrap_err().to_string();
        assert!(
            told.contains("rank 0 aborted the run") && told.contains("ranks [2]"),
            "{told}"
        );
    }
}
