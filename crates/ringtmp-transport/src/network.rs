//! A node's links to its neighbours and the blocking API the node's compute uses.
//!
//! Links are established along the topology the strategy asks for: of each neighbour pair, the
//! higher rank dials and the lower rank accepts. Connections that fail the handshake are logged
//! and dropped without disturbing the run (a stranger cannot stop it); the wait for expected peers
//! is bounded by `connect_timeout`.
//!
//! Per link, three tasks run on the transport's own tokio runtime:
//! - the *reader* decodes frames into the node's inbox, swallowing heartbeats;
//! - the *writer* drains the link's send queue (applying shaping) and sends a heartbeat every
//!   `heartbeat_interval`;
//! - the *watchdog* reports the peer dead when no byte has arrived for `peer_timeout` (inactivity,
//!   not frame duration, so a large frame on a slow link is not mistaken for silence).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ringtmp_wire::{Control, Message};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout};

use crate::config::TransportConfig;
use crate::error::{PeerName, TransportError};
use crate::framed::{FrameSink, ReadError, read_frame_pooled, write_spent_frame};
use crate::handshake::handshake;
use crate::pool::BufferPool;
use crate::secure::Session;
use crate::transport::LinkStats;

/// Queue depth per link; a full queue is back-pressure on the sender.
const SEND_QUEUE: usize = 64;
/// Inbox depth (all links together).
const INBOX: usize = 256;

#[derive(Default)]
struct Counters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    messages_sent: AtomicU64,
    messages_received: AtomicU64,
    send_wait_ns: AtomicU64,
    recv_wait_ns: AtomicU64,
}

struct Outgoing {
    message: Message,
    enqueued: Instant,
}

enum Inbound {
    Message(u32, Message),
    Goodbye(u32),
    Failed(TransportError),
}

struct Link {
    peer: PeerName,
    queue: mpsc::Sender<Outgoing>,
    counters: Arc<Counters>,
    tasks: Vec<JoinHandle<()>>,
    said_goodbye: bool,
}

/// What an audited node sent: enough to check that nothing forbidden left it (see
/// [`Network::enable_audit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentRecord {
    /// Destination rank.
    pub to: u32,
    /// `None` for control messages; the tag of a tensor.
    pub tag: Option<ringtmp_wire::TensorTag>,
    /// The tensor's shape (empty for control messages).
    pub shape: Vec<u32>,
    /// The tensor's payload bytes (empty for control messages).
    pub payload: Vec<u8>,
}

impl SentRecord {
    pub(crate) fn of(to: u32, message: &Message) -> Self {
        match message {
            Message::Control(_) => Self {
                to,
                tag: None,
                shape: Vec::new(),
                payload: Vec::new(),
            },
            Message::Tensor(h, p) => Self {
                to,
                tag: Some(h.tag),
                shape: h.shape.clone(),
                payload: p.clone(),
            },
        }
    }
}

/// A node's established links.
pub struct Network {
    audit: Option<std::sync::Mutex<Vec<SentRecord>>>,
    runtime: tokio::runtime::Runtime,
    cfg: TransportConfig,
    links: BTreeMap<u32, Link>,
    inbox: mpsc::Receiver<Inbound>,
    pending: VecDeque<(u32, Message)>,
    goodbyes: BTreeSet<u32>,
    buffers: BufferPool,
    clock: Arc<crate::transport::WallClock>,
    steps: Option<crate::progress::StepWatch>,
}

/// A receive's end: the caller's deadline, or the step bound's when that comes first.
struct Deadline {
    at: Instant,
    /// Whether the step bound ends the wait.
    stall: bool,
}

/// Binds a listener on `addr` (use port 0 for any free port) and logs what was bound.
pub fn bind_listener(addr: &str) -> Result<std::net::TcpListener, TransportError> {
    let listener = std::net::TcpListener::bind(addr).map_err(|e| TransportError::Bind {
        addr: addr.to_string(),
        source: e,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::Io {
            context: format!("configuring {addr}"),
            source: e,
        })?;
    if let Ok(local) = listener.local_addr() {
        tracing::info!("listening for peers on {local}");
    }
    Ok(listener)
}

impl Network {
    /// Connects to every neighbour: dials those with a lower rank (at `addresses[rank]`) and
    /// accepts those with a higher rank on `listener`, each through the authenticated handshake.
    pub fn connect(
        cfg: TransportConfig,
        listener: std::net::TcpListener,
        addresses: &BTreeMap<u32, SocketAddr>,
        neighbours: &BTreeSet<u32>,
    ) -> Result<Self, TransportError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ringtmp-io")
            .enable_all()
            .build()
            .map_err(|e| TransportError::Io {
                context: "starting the I/O runtime".into(),
                source: e,
            })?;
        let (inbox_tx, mut inbox) = mpsc::channel(INBOX);
        let buffers = BufferPool::default();
        let nic = {
            let _guard = runtime.enter();
            Arc::new(crate::shaper::SharedNic::new())
        };
        let mut up = LinksUp {
            cfg: &cfg,
            links: BTreeMap::new(),
            inbox_tx,
            buffers: buffers.clone(),
            nic,
            early: VecDeque::new(),
            goodbyes: BTreeSet::new(),
            failures: Vec::new(),
        };
        let established = runtime.block_on(establish(
            &mut up, &mut inbox, listener, addresses, neighbours,
        ));
        let LinksUp {
            links,
            inbox_tx,
            early,
            goodbyes,
            failures,
            ..
        } = up;
        // A link that failed while others were still coming up is reported by the first
        // receive that needs it, as any later failure is.
        for failure in failures {
            let _ = inbox_tx.try_send(Inbound::Failed(failure));
        }
        let network = Self {
            audit: None,
            runtime,
            cfg,
            links,
            inbox,
            pending: early,
            goodbyes,
            buffers,
            clock: Arc::new(crate::transport::WallClock::new()),
            steps: None,
        };
        match established {
            Ok(()) => Ok(network),
            Err(error) => {
                // The peers already linked would otherwise wait out their own timeouts for a
                // run this node has left: tell them why.
                let (origin, reason) = match &error {
                    TransportError::Aborted { origin, reason } => (*origin, reason.clone()),
                    other => (network.cfg.rank, other.to_string()),
                };
                network.abort_from(origin, &reason);
                Err(error)
            }
        }
    }

    /// The pool this node's links take received payloads from and return sent ones to: take a
    /// buffer to encode a large tensor into, and give a received payload back once it is read.
    pub fn buffers(&self) -> &BufferPool {
        &self.buffers
    }

    /// Starts recording every message this node sends (for tests that audit what leaves a node,
    /// e.g. that the ring's master never sends labels or raw inputs). Costs a copy per message.
    pub fn enable_audit(&mut self) {
        self.audit = Some(std::sync::Mutex::new(Vec::new()));
    }

    /// The messages sent since [`Network::enable_audit`].
    pub fn audit_log(&self) -> Vec<SentRecord> {
        self.audit
            .as_ref()
            .and_then(|a| a.lock().ok().map(|l| l.clone()))
            .unwrap_or_default()
    }

    /// This node's rank.
    pub fn rank(&self) -> u32 {
        self.cfg.rank
    }

    /// Ranks this node has links to.
    pub fn peers(&self) -> impl Iterator<Item = u32> + '_ {
        self.links.keys().copied()
    }

    /// How a peer is named in errors.
    pub fn peer_name(&self, rank: u32) -> PeerName {
        self.links
            .get(&rank)
            .map(|l| l.peer.clone())
            .unwrap_or(PeerName {
                rank: Some(rank),
                addr: None,
            })
    }

    /// Queues `message` for `to`, waiting at most `send_timeout` for room in the link's queue.
    pub fn send(&self, to: u32, message: Message) -> Result<(), TransportError> {
        let link = self.links.get(&to).ok_or(TransportError::NoLink(to))?;
        if let Some(audit) = &self.audit
            && let Ok(mut log) = audit.lock()
        {
            log.push(SentRecord::of(to, &message));
        }
        let started = Instant::now();
        let outgoing = Outgoing {
            message,
            enqueued: started,
        };
        let sent = self
            .runtime
            .block_on(async { timeout(self.cfg.send_timeout, link.queue.send(outgoing)).await });
        link.counters
            .send_wait_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(TransportError::PeerClosed {
                peer: link.peer.clone(),
                reason: "its link has shut down".into(),
            }),
            Err(_) => Err(TransportError::Timeout {
                what: "room in the send queue".into(),
                from: link.peer.to_string(),
                waited: self.cfg.send_timeout,
            }),
        }
    }

    /// The next message from any peer, waiting at most `wait`.
    pub fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(m);
        }
        let deadline = self.deadline(wait);
        self.next_inbound(&deadline, None)
    }

    /// Arms the run-wide bound on waiting without a step ([`crate::progress`]).
    pub fn watch_steps(&mut self, bound: crate::progress::StepBound) {
        self.steps = Some(crate::progress::StepWatch::new(bound));
    }

    /// A step of the run completed (see [`Network::watch_steps`]).
    pub fn step_done(&mut self) {
        let now = crate::transport::Clock::now(&*self.clock);
        if let Some(steps) = &mut self.steps {
            steps.step_done(now);
        }
    }

    /// When a receive that may wait `wait` from now must end.
    fn deadline(&self, wait: Duration) -> Deadline {
        let now = Instant::now();
        match self.steps.as_ref().and_then(|s| s.limit()) {
            Some(limit) if limit < wait => Deadline {
                at: now + limit,
                stall: true,
            },
            _ => Deadline {
                at: now + wait,
                stall: false,
            },
        }
    }

    /// A message that has already arrived, without waiting (`Ok(None)` when there is none).
    /// Failures and aborts are reported exactly as by [`Network::recv`].
    pub fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(Some(m));
        }
        match self.inbox.try_recv() {
            Ok(inbound) => self.interpret(inbound),
            Err(_) => Ok(None),
        }
    }

    /// What an inbound event means for a caller that did not wait for a particular peer.
    fn interpret(&mut self, inbound: Inbound) -> Result<Option<(u32, Message)>, TransportError> {
        match inbound {
            Inbound::Message(from, Message::Control(Control::Abort { origin, reason })) => {
                self.broadcast_except(
                    from,
                    Control::Abort {
                        origin,
                        reason: reason.clone(),
                    },
                );
                Err(TransportError::Aborted { origin, reason })
            }
            Inbound::Message(from, m) => Ok(Some((from, m))),
            Inbound::Goodbye(r) => {
                self.goodbyes.insert(r);
                Ok(None)
            }
            Inbound::Failed(e) => Err(TransportError::WhileWaiting {
                waiting_for: "messages from any peer".into(),
                cause: Box::new(e),
            }),
        }
    }

    /// Puts a message back so the next `recv`/`recv_from` returns it first (for a protocol phase
    /// that received a message belonging to the next phase).
    pub fn unread(&mut self, from: u32, message: Message) {
        self.pending.push_front((from, message));
    }

    /// The next message from `from` (others are kept for later), waiting at most `wait`.
    pub fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        if let Some(i) = self.pending.iter().position(|(r, _)| *r == from) {
            return Ok(self.pending.remove(i).expect("index from position").1);
        }
        if !self.links.contains_key(&from) {
            return Err(TransportError::NoLink(from));
        }
        let deadline = self.deadline(wait);
        loop {
            let (r, m) = self.next_inbound(&deadline, Some(from))?;
            if r == from {
                return Ok(m);
            }
            self.pending.push_back((r, m));
        }
    }

    fn next_inbound(
        &mut self,
        deadline: &Deadline,
        awaited: Option<u32>,
    ) -> Result<(u32, Message), TransportError> {
        let waiting_since = Instant::now();
        let waiting_for = |net: &Self| match awaited {
            Some(r) => format!("a message from {}", net.peer_name(r)),
            None => format!(
                "a message from any of ranks {:?}",
                net.links.keys().collect::<Vec<_>>()
            ),
        };
        loop {
            let started = Instant::now();
            let left = deadline.at.saturating_duration_since(started);
            let got = self
                .runtime
                .block_on(async { timeout(left, self.inbox.recv()).await });
            if let Some(link) = awaited.and_then(|r| self.links.get(&r)) {
                link.counters
                    .recv_wait_ns
                    .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            match got {
                Err(_) if deadline.stall => {
                    let now = crate::transport::Clock::now(&*self.clock);
                    let steps = self.steps.as_ref();
                    return Err(TransportError::NoProgress {
                        rank: self.cfg.rank,
                        since_step: steps.map_or(Duration::ZERO, |s| s.since_last_step(now)),
                        waited: waiting_since.elapsed(),
                        waiting_for: waiting_for(self),
                        why: steps.map_or_else(String::new, |s| s.explain()),
                    });
                }
                Err(_) => {
                    return Err(TransportError::Timeout {
                        what: "a message".into(),
                        from: match awaited {
                            Some(r) => self.peer_name(r).to_string(),
                            None => {
                                format!("any of ranks {:?}", self.links.keys().collect::<Vec<_>>())
                            }
                        },
                        waited: left,
                    });
                }
                Ok(None) => {
                    return Err(TransportError::PeerClosed {
                        peer: PeerName {
                            rank: awaited,
                            addr: None,
                        },
                        reason: "all links are closed".into(),
                    });
                }
                Ok(Some(Inbound::Goodbye(r))) => {
                    self.goodbyes.insert(r);
                    if awaited == Some(r) {
                        return Err(TransportError::PeerClosed {
                            peer: self.peer_name(r),
                            reason: "it finished and said goodbye".into(),
                        });
                    }
                }
                Ok(Some(Inbound::Failed(e))) => {
                    let waiting_for = match awaited {
                        Some(r) => format!("a message from {}", self.peer_name(r)),
                        None => "a message from any peer".into(),
                    };
                    return Err(TransportError::WhileWaiting {
                        waiting_for,
                        cause: Box::new(e),
                    });
                }
                Ok(Some(Inbound::Message(
                    from,
                    Message::Control(Control::Abort { origin, reason }),
                ))) => {
                    // Pass it on so the whole run stops, not just our neighbourhood.
                    self.broadcast_except(
                        from,
                        Control::Abort {
                            origin,
                            reason: reason.clone(),
                        },
                    );
                    // Said with what this node was waiting for: after a stall, every node's
                    // report then names its own wait.
                    return Err(TransportError::WhileWaiting {
                        waiting_for: format!(
                            "{}, for {:.1} s",
                            waiting_for(self),
                            waiting_since.elapsed().as_secs_f64()
                        ),
                        cause: Box::new(TransportError::Aborted { origin, reason }),
                    });
                }
                Ok(Some(Inbound::Message(from, m))) => return Ok((from, m)),
            }
        }
    }

    /// Tells every peer that this node is giving up (best effort, bounded), so they stop too.
    pub fn abort(&self, reason: &str) {
        self.abort_from(self.cfg.rank, reason);
    }

    /// [`Network::abort`] passing on another node's abort (`origin` is the node that failed).
    fn abort_from(&self, origin: u32, reason: &str) {
        // Per link, the count of written frames at which the abort is on the wire: those written
        // so far, those queued before it, and itself.
        let written_at: Vec<u64> = self
            .links
            .values()
            .map(|l| {
                let queued = (SEND_QUEUE - l.queue.capacity()) as u64;
                l.counters.messages_sent.load(Ordering::Relaxed) + queued + 1
            })
            .collect();
        self.broadcast_except(
            u32::MAX,
            Control::Abort {
                origin,
                reason: reason.to_string(),
            },
        );
        // Give the writers a moment to put the frames on the wire before the process exits.
        // Taken from the queue is not enough: a writer still encrypting or flushing the abort
        // when the process ended left the peer a closed connection instead of the reason (the
        // peer then named this node, not the one that failed).
        self.runtime.block_on(async {
            let flush = async {
                for (link, target) in self.links.values().zip(&written_at) {
                    while link.counters.messages_sent.load(Ordering::Relaxed) < *target
                        && !link.queue.is_closed()
                    {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            };
            let _ = timeout(Duration::from_millis(500), flush).await;
        });
    }

    fn broadcast_except(&self, skip: u32, control: Control) {
        for (rank, link) in &self.links {
            if *rank != skip {
                let _ = link.queue.try_send(Outgoing {
                    message: Message::Control(control.clone()),
                    enqueued: Instant::now(),
                });
            }
        }
    }

    /// Traffic and waiting per link.
    pub fn stats(&self) -> Vec<LinkStats> {
        self.links
            .iter()
            .map(|(rank, l)| {
                let c = &l.counters;
                LinkStats {
                    peer: *rank,
                    bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
                    bytes_received: c.bytes_received.load(Ordering::Relaxed),
                    messages_sent: c.messages_sent.load(Ordering::Relaxed),
                    messages_received: c.messages_received.load(Ordering::Relaxed),
                    send_wait: Duration::from_nanos(c.send_wait_ns.load(Ordering::Relaxed)),
                    recv_wait: Duration::from_nanos(c.recv_wait_ns.load(Ordering::Relaxed)),
                }
            })
            .collect()
    }

    /// Orderly shutdown: says goodbye on every link and waits (bounded by `peer_timeout`) for
    /// every peer's goodbye, so no side mistakes the end of the run for a failure.
    pub fn close(&mut self) -> Result<(), TransportError> {
        for link in self.links.values_mut() {
            let _ = link.queue.try_send(Outgoing {
                message: Message::Control(Control::Goodbye),
                enqueued: Instant::now(),
            });
            link.said_goodbye = true;
        }
        let deadline = Instant::now() + self.cfg.peer_timeout;
        while self.goodbyes.len() < self.links.len() {
            match self.runtime.block_on(async {
                timeout(
                    deadline.saturating_duration_since(Instant::now()),
                    self.inbox.recv(),
                )
                .await
            }) {
                Ok(Some(Inbound::Goodbye(r))) => {
                    self.goodbyes.insert(r);
                }
                Ok(Some(Inbound::Message(..))) => {}
                Ok(Some(Inbound::Failed(e))) => {
                    tracing::debug!("during shutdown: {e}");
                    break;
                }
                Ok(None) | Err(_) => break,
            }
        }
        let tasks: Vec<JoinHandle<()>> = self
            .links
            .values_mut()
            .flat_map(|l| l.tasks.drain(..))
            .collect();
        self.runtime.block_on(async {
            let _ = timeout(Duration::from_secs(2), async {
                for t in tasks {
                    let _ = t.await;
                }
            })
            .await;
        });
        Ok(())
    }
}

impl crate::transport::Transport for Network {
    fn rank(&self) -> u32 {
        Network::rank(self)
    }

    fn peers(&self) -> Vec<u32> {
        Network::peers(self).collect()
    }

    fn peer_name(&self, rank: u32) -> PeerName {
        Network::peer_name(self, rank)
    }

    fn send(&self, to: u32, message: Message) -> Result<(), TransportError> {
        Network::send(self, to, message)
    }

    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        Network::recv(self, wait)
    }

    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        Network::try_recv(self)
    }

    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        Network::recv_from(self, from, wait)
    }

    fn unread(&mut self, from: u32, message: Message) {
        Network::unread(self, from, message)
    }

    fn buffers(&self) -> &BufferPool {
        Network::buffers(self)
    }

    fn stats(&self) -> Vec<LinkStats> {
        Network::stats(self)
    }

    fn abort(&self, reason: &str) {
        Network::abort(self, reason)
    }

    fn close(&mut self) -> Result<(), TransportError> {
        Network::close(self)
    }

    fn clock(&self) -> Arc<dyn crate::transport::Clock> {
        self.clock.clone()
    }

    fn watch_steps(&mut self, bound: crate::progress::StepBound) {
        Network::watch_steps(self, bound)
    }

    fn step_done(&mut self) {
        Network::step_done(self)
    }
}

/// The links of a node whose other links are still coming up: each starts (reader, writer,
/// heartbeats, watchdog) as soon as its greeting completes, so a neighbour linked early hears
/// heartbeats while this node waits for the rest, and hears an abort if this node gives up.
struct LinksUp<'a> {
    cfg: &'a TransportConfig,
    links: BTreeMap<u32, Link>,
    inbox_tx: mpsc::Sender<Inbound>,
    buffers: BufferPool,
    nic: Arc<crate::shaper::SharedNic>,
    /// Messages that arrived on early links, for the first receives.
    early: VecDeque<(u32, Message)>,
    goodbyes: BTreeSet<u32>,
    /// Early links that failed, reported once the node runs (a strategy that survives dead
    /// peers decides about them, not the start-up).
    failures: Vec<TransportError>,
}

impl LinksUp<'_> {
    fn start(&mut self, rank: u32, (stream, addr, session): Established) {
        let link = start_link(
            self.cfg,
            (rank, addr),
            stream,
            session,
            self.inbox_tx.clone(),
            &self.buffers,
            &self.nic,
        );
        self.links.insert(rank, link);
    }

    /// An event of an early link: an abort ends the start-up, the rest is kept for later.
    fn note(&mut self, inbound: Inbound) -> Result<(), TransportError> {
        match inbound {
            Inbound::Message(_, Message::Control(Control::Abort { origin, reason })) => {
                Err(TransportError::Aborted { origin, reason })
            }
            Inbound::Message(from, message) => {
                self.early.push_back((from, message));
                Ok(())
            }
            Inbound::Goodbye(rank) => {
                self.goodbyes.insert(rank);
                Ok(())
            }
            Inbound::Failed(e) => {
                self.failures.push(e);
                Ok(())
            }
        }
    }
}

/// A connection whose greeting completed: the stream, the peer's address, the session.
type Established = (TcpStream, SocketAddr, Option<Session>);

async fn establish(
    up: &mut LinksUp<'_>,
    inbox: &mut mpsc::Receiver<Inbound>,
    listener: std::net::TcpListener,
    addresses: &BTreeMap<u32, SocketAddr>,
    neighbours: &BTreeSet<u32>,
) -> Result<(), TransportError> {
    let cfg = up.cfg;
    let listener = TcpListener::from_std(listener).map_err(|e| TransportError::Io {
        context: "listener".into(),
        source: e,
    })?;
    let to_dial: Vec<u32> = neighbours
        .iter()
        .copied()
        .filter(|r| *r < cfg.rank)
        .collect();
    let to_accept: BTreeSet<u32> = neighbours
        .iter()
        .copied()
        .filter(|r| *r > cfg.rank)
        .collect();
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(u32, Established)>();

    let dial = {
        let done_tx = done_tx.clone();
        async move {
            for rank in to_dial {
                let addr = *addresses.get(&rank).ok_or(TransportError::NoLink(rank))?;
                let link = dial_one(cfg, rank, addr, deadline).await?;
                let _ = done_tx.send((rank, link));
            }
            Ok::<_, TransportError>(())
        }
    };
    let accept = accept_all(cfg, &listener, to_accept, deadline, done_tx);
    let work = async { tokio::try_join!(dial, accept).map(|_| ()) };
    tokio::pin!(work);
    loop {
        tokio::select! {
            finished = &mut work => {
                finished?;
                while let Ok((rank, link)) = done_rx.try_recv() {
                    up.start(rank, link);
                }
                return Ok(());
            }
            Some((rank, link)) = done_rx.recv() => up.start(rank, link),
            Some(inbound) = inbox.recv() => up.note(inbound)?,
        }
    }
}

/// Accepts the neighbours of higher rank on `listener`, each through the greeting, until all
/// are linked or `deadline`; strangers and refused greetings are counted and named in the
/// error if the wait runs out.
async fn accept_all(
    cfg: &TransportConfig,
    listener: &TcpListener,
    to_accept: BTreeSet<u32>,
    deadline: tokio::time::Instant,
    done: mpsc::UnboundedSender<(u32, Established)>,
) -> Result<(), TransportError> {
    let mut linked = BTreeSet::new();
    let mut refused = crate::admission::Refusals::default();
    // Greetings run concurrently, so a stranger that connects and stalls cannot hold up the real
    // peers behind it; how many run at once is bounded (see `admission`).
    let mut pending = crate::admission::Admission::default();
    while linked.len() < to_accept.len() {
        tokio::select! {
            accepted = tokio::time::timeout_at(
                deadline,
                crate::admission::accept(listener, ACCEPT_RETRY),
            ) => {
                let Ok((mut stream, addr)) = accepted else {
                    let missing: Vec<u32> =
                        to_accept.iter().filter(|r| !linked.contains(*r)).copied().collect();
                    return Err(TransportError::LinksIncomplete {
                        missing,
                        waited: cfg.connect_timeout,
                        refused,
                    });
                };
                let _ = stream.set_nodelay(true);
                let (cfg, expected) = (cfg.clone(), to_accept.clone());
                pending.admit(addr, async move {
                    handshake(&mut stream, addr, &cfg, |r| expected.contains(&r))
                        .await
                        .map(|(rank, session)| (rank, (stream, addr, session)))
                });
            }
            Some(finished) = pending.next(), if !pending.is_empty() => match finished {
                Ok(Ok((rank, link))) => {
                    if linked.insert(rank) {
                        let _ = done.send((rank, link));
                    } else {
                        let reason = format!("a second connection claiming rank {rank} from {}", link.1);
                        tracing::warn!("refused {reason}");
                        refused.push(reason);
                    }
                }
                // A stranger, or a peer with the wrong secret, version or run: log it and keep
                // waiting for the real one.
                Ok(Err(e)) => {
                    tracing::warn!("{e}");
                    refused.push(e.to_string());
                }
                Err(e) => tracing::warn!("handshake task failed: {e}"),
            },
        }
    }
    Ok(())
}

/// Pause after a failed accept before the next (see `admission::accept`).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

async fn dial_one(
    cfg: &TransportConfig,
    rank: u32,
    addr: SocketAddr,
    deadline: tokio::time::Instant,
) -> Result<(TcpStream, SocketAddr, Option<Session>), TransportError> {
    let peer = PeerName {
        rank: Some(rank),
        addr: Some(addr),
    };
    let mut last = String::from("no attempt");
    loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Err(_) => break,
            Ok(Ok(mut stream)) => {
                let _ = stream.set_nodelay(true);
                // A refusal by the node we dialled is fatal: it is the peer we need. A greeting
                // cut short before either side found fault is dialled again (its listener may
                // have closed it to make room under a flood of strangers).
                match handshake(&mut stream, addr, cfg, |r| r == rank)
                    .await
                    .map_err(|e| e.dialled_as(rank))
                {
                    Ok((_, session)) => return Ok((stream, addr, session)),
                    Err(TransportError::GreetingCut { reason, .. }) => {
                        last = format!("the greeting was cut short: {reason}");
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(Err(e)) => last = e.to_string(),
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(TransportError::Connect {
        peer,
        waited: cfg.connect_timeout,
        reason: last,
    })
}

fn start_link(
    cfg: &TransportConfig,
    (rank, addr): (u32, SocketAddr),
    stream: TcpStream,
    session: Option<Session>,
    inbox: mpsc::Sender<Inbound>,
    buffers: &BufferPool,
    nic: &Arc<crate::shaper::SharedNic>,
) -> Link {
    let peer = PeerName {
        rank: Some(rank),
        addr: Some(addr),
    };
    let counters = Arc::new(Counters::default());
    let (queue, outgoing) = mpsc::channel(SEND_QUEUE);
    let (read_half, write_half) = stream.into_split();
    let epoch = Instant::now();
    let last_byte = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(AtomicBool::new(false));
    let peer_said_goodbye = Arc::new(AtomicBool::new(false));
    // Liveness counts the bytes that arrive, sealed or not.
    let activity = Activity {
        inner: read_half,
        epoch,
        last_byte: last_byte.clone(),
    };
    let ends = LinkEnds {
        peer: peer.clone(),
        counters: counters.clone(),
        inbox: inbox.clone(),
        buffers: buffers.clone(),
        peer_said_goodbye,
    };
    let (reader, writer) = match session {
        Some(session) => (
            tokio::spawn(reader(
                crate::secure::SecureReader::new(activity, session.clone()),
                ends.clone(),
                cfg.limits,
                finished.clone(),
            )),
            tokio::spawn(writer(
                crate::secure::SecureWriter::new(write_half, session),
                ends,
                cfg.clone(),
                outgoing,
                nic.clone(),
            )),
        ),
        None => (
            tokio::spawn(reader(activity, ends.clone(), cfg.limits, finished.clone())),
            tokio::spawn(writer(write_half, ends, cfg.clone(), outgoing, nic.clone())),
        ),
    };
    let watchdog = tokio::spawn(watchdog(
        peer.clone(),
        cfg.peer_timeout,
        epoch,
        last_byte,
        finished,
        reader.abort_handle(),
        inbox,
    ));
    Link {
        peer,
        queue,
        counters,
        tasks: vec![reader, writer, watchdog],
        said_goodbye: false,
    }
}

/// What a link's reader and writer share: whom the link goes to, its counters, the node's inbox
/// and buffer pool.
#[derive(Clone)]
struct LinkEnds {
    peer: PeerName,
    counters: Arc<Counters>,
    inbox: mpsc::Sender<Inbound>,
    buffers: BufferPool,
    /// Set by the reader when the peer's goodbye arrives: the writer's failures after it are
    /// the peer having gone, as it said it would, not a fault.
    peer_said_goodbye: Arc<AtomicBool>,
}

async fn reader<R: AsyncRead + Unpin>(
    mut stream: R,
    ends: LinkEnds,
    limits: ringtmp_wire::Limits,
    finished: Arc<AtomicBool>,
) {
    let LinkEnds {
        peer,
        counters,
        inbox,
        buffers,
        peer_said_goodbye,
    } = ends;
    let rank = peer.rank.unwrap_or(u32::MAX);
    let mut buf = Vec::new();
    let failure = loop {
        match read_frame_pooled(&mut stream, &mut buf, &limits, &buffers).await {
            Ok((message, bytes)) => {
                counters
                    .bytes_received
                    .fetch_add(bytes as u64, Ordering::Relaxed);
                match message {
                    Message::Control(Control::Heartbeat { .. }) => {}
                    Message::Control(Control::Goodbye) => {
                        peer_said_goodbye.store(true, Ordering::Release);
                        finished.store(true, Ordering::Relaxed);
                        let _ = inbox.send(Inbound::Goodbye(rank)).await;
                        return;
                    }
                    message => {
                        counters.messages_received.fetch_add(1, Ordering::Relaxed);
                        if inbox.send(Inbound::Message(rank, message)).await.is_err() {
                            return;
                        }
                    }
                }
            }
            Err(ReadError::Closed) => {
                break TransportError::PeerClosed {
                    peer: peer.clone(),
                    reason: "connection closed without a goodbye".into(),
                };
            }
            Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                // The private link's check failed: nothing of that record was used.
                break TransportError::Forged {
                    peer: peer.clone(),
                    reason: e.to_string(),
                };
            }
            Err(ReadError::Io(e)) => {
                break TransportError::PeerClosed {
                    peer: peer.clone(),
                    reason: e.to_string(),
                };
            }
            Err(ReadError::Decode(e)) => {
                break TransportError::Decode {
                    peer: peer.clone(),
                    source: e,
                };
            }
        }
    };
    finished.store(true, Ordering::Relaxed);
    let _ = inbox.send(Inbound::Failed(failure)).await;
}

async fn writer<W: FrameSink>(
    mut stream: W,
    ends: LinkEnds,
    cfg: TransportConfig,
    mut outgoing: mpsc::Receiver<Outgoing>,
    nic: Arc<crate::shaper::SharedNic>,
) {
    use tokio::io::AsyncWriteExt;
    let LinkEnds {
        peer,
        counters,
        inbox,
        buffers,
        peer_said_goodbye,
    } = ends;
    let mut scratch = Vec::new();
    let mut heartbeat = tokio::time::interval(cfg.heartbeat_interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        let (mut message, enqueued, counted) = tokio::select! {
            next = outgoing.recv() => match next {
                Some(o) => (o.message, o.enqueued, true),
                None => break,
            },
            _ = heartbeat.tick() => {
                seq += 1;
                (Message::Control(Control::Heartbeat { seq }), Instant::now(), false)
            }
        };
        if !cfg.shaping.latency.is_zero() {
            emulated_wait(tokio::time::Instant::from_std(
                enqueued + cfg.shaping.latency,
            ))
            .await;
        }
        let goodbye = matches!(message, Message::Control(Control::Goodbye));
        let written = match cfg.shaping.bandwidth_bps {
            // The frame leaves through the node's emulated card, shared with its other links,
            // packet by packet (see `write_paced`).
            Some(bps) => {
                write_frame_paced(&mut stream, &mut message, &mut scratch, &nic, bps).await
            }
            None => write_spent_frame(&mut stream, &mut message, &mut scratch).await,
        };
        // A private link holds the frame's last record until flushed.
        let written = match written {
            Ok(n) => stream.flush().await.map(|()| n),
            Err(e) => Err(e),
        };
        match written {
            Ok(n) => {
                counters.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
                if counted {
                    counters.messages_sent.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                // A peer that said goodbye and closed makes our next write (a heartbeat, say)
                // fail, possibly before our reader has read its goodbye: give the reader a
                // moment. Seen with slow (emulated) nodes ending a parameter-server run.
                let deadline = Instant::now() + GOODBYE_GRACE;
                while !peer_said_goodbye.load(Ordering::Acquire) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                if !peer_said_goodbye.load(Ordering::Acquire) {
                    let _ = inbox
                        .send(Inbound::Failed(TransportError::PeerClosed {
                            peer,
                            reason: format!("sending failed: {e}"),
                        }))
                        .await;
                }
                return;
            }
        }
        if goodbye {
            let _ = stream.shutdown().await;
            return;
        }
        if let Message::Tensor(_, payload) = message {
            buffers.give(payload);
        }
    }
}

/// How long a writer whose send failed waits for the peer's goodbye to be read before it
/// reports the failure.
const GOODBYE_GRACE: Duration = Duration::from_millis(500);

/// What the emulated card sends at a time: each piece reserves the card when it asks and goes
/// to the socket when its last bit would have left. One full record of a private link (64 KiB
/// less its tag), so a piece is never cut into a record and a sliver.
const PACING_CHUNK: usize = crate::secure::MAX_PLAIN;

/// [`write_spent_frame`] through the emulated card `nic` at `bits_per_second`, in pieces of
/// [`PACING_CHUNK`]. A frame released whole when its last bit would have left made a 32 MB model
/// at 100 Mbit/s arrive as 2.6 s of silence and then everything: the receiver's watchdog called
/// a busy peer dead, and a small message on another link waited for the whole frame, where a
/// real card's fair queue interleaves flows packet by packet.
async fn write_frame_paced<W: FrameSink>(
    stream: &mut W,
    message: &mut Message,
    scratch: &mut Vec<u8>,
    nic: &crate::shaper::SharedNic,
    bits_per_second: u64,
) -> std::io::Result<usize> {
    use tokio::io::AsyncWriteExt;
    scratch.clear();
    let mut no_payload = [];
    let payload: &mut [u8] = match message {
        Message::Tensor(header, payload) => {
            ringtmp_wire::encode_tensor_prefix(header, payload.len() as u64, scratch);
            payload
        }
        Message::Control(_) => {
            ringtmp_wire::encode(message, scratch);
            &mut no_payload
        }
    };
    let total = scratch.len() + payload.len();
    // Each piece is released when its last bit would have left the card, and flushed, so a
    // private link's writer does not gather it with the next pieces.
    for piece in scratch.chunks(PACING_CHUNK) {
        emulated_wait(nic.reserve(piece.len(), bits_per_second)).await;
        stream.write_all(piece).await?;
        stream.flush().await?;
    }
    for piece in payload.chunks_mut(PACING_CHUNK) {
        emulated_wait(nic.reserve(piece.len(), bits_per_second)).await;
        stream.write_spent(piece).await?;
        stream.flush().await?;
    }
    Ok(total)
}

/// Waits until `deadline` as well as a millisecond timer can. Tokio's timers wake about a
/// millisecond tick after their deadline, so every emulated wait overshot, twice a message (its
/// latency, then its pieces on the card): a 2 ms link measured 8.36 ms of round trip instead of
/// about 4.1, and pipelines of small micro-batches ran a third slower than the simulator
/// predicted (docs/benchmarks/logs/log-07.md). A wait shorter than a tick is not slept (the
/// card's ledger still counts the time, so the rate holds over any longer interval), and a
/// longer one aims a tick early: `ringtmp selftest --nodes 2 --bandwidth-mbit 100
/// --latency-ms 2` now measures 4.23 ms (5 ms: 10.30 ms), at the same 12.4 MB/s.
async fn emulated_wait(deadline: tokio::time::Instant) {
    const TICK: Duration = Duration::from_millis(1);
    let now = tokio::time::Instant::now();
    if deadline.saturating_duration_since(now) > TICK {
        sleep_until(deadline - TICK).await;
    }
}

async fn watchdog(
    peer: PeerName,
    limit: Duration,
    epoch: Instant,
    last_byte: Arc<AtomicU64>,
    finished: Arc<AtomicBool>,
    reader: tokio::task::AbortHandle,
    inbox: mpsc::Sender<Inbound>,
) {
    let tick = (limit / 4).max(Duration::from_millis(10));
    let mut awake = Instant::now();
    // Silence is counted from the later of the peer's last byte and this node's last wake-up
    // after a freeze: a node that was itself stopped (SIGSTOP, a suspended VM, a swap storm)
    // for longer than the limit has heard nothing because it listened to nothing, and the
    // peer's bytes queued meanwhile are read at once once it runs again.
    let mut listening_since = awake;
    loop {
        tokio::time::sleep(tick).await;
        if finished.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        if now.duration_since(awake) > limit {
            tracing::warn!(
                "this node did not run for {:.1} s (stopped or starved); giving {} a fresh {:?} \
                 before presuming it dead",
                now.duration_since(awake).as_secs_f64(),
                peer,
                limit
            );
            listening_since = now;
        }
        awake = now;
        let last = epoch + Duration::from_nanos(last_byte.load(Ordering::Relaxed));
        let silent = now.duration_since(last.max(listening_since));
        if silent > limit {
            reader.abort();
            let _ = inbox
                .send(Inbound::Failed(TransportError::PeerSilent {
                    peer,
                    silent_for: silent,
                }))
                .await;
            return;
        }
    }
}

/// A reader that records when it last received a byte, for the watchdog.
struct Activity<R> {
    inner: R,
    epoch: Instant,
    last_byte: Arc<AtomicU64>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Activity<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let now = self.epoch.elapsed().as_nanos() as u64;
            self.last_byte.store(now, Ordering::Relaxed);
        }
        poll
    }
}
