//! An in-memory network on a seeded virtual clock: the same [`Transport`] the strategies use on
//! sockets, for protocol tests that replay exactly and for simulating clusters larger than this
//! machine.
//!
//! Each node runs its ordinary blocking code as a coroutine (a stack of its own, not a thread:
//! all of them on the caller's thread, so a simulation's size is bounded by memory, not by the
//! kernel's threads). One node at a time holds the *baton* and runs; it gives the baton up only
//! when it waits (a receive with nothing to receive, accounted compute, the end of its run), and
//! the scheduler then hands it to the node with the earliest thing to do in virtual time, ties
//! broken by rank. Which node runs next is a function of the virtual clock and the seed alone,
//! so a run is a pure function of its inputs and a failing seed replays (`RINGTMP_SEED`). A
//! node's stack is made when it first runs and given to the next one when it ends, so a ring
//! that leaves most of its nodes idle holds the stacks of the nodes it uses.
//!
//! The model:
//! - A node's network card (one egress budget per node) is shared fairly by the links that have
//!   bytes queued, each link a FIFO (`sim_card`; as the emulated card on real links
//!   shares it in pieces); a message arrives when the card has sent it plus the link's latency
//!   and a seeded jitter; messages on one link keep their order (as TCP does), messages on
//!   different links may overtake each other.
//! - Compute takes virtual time only as a node accounts for it ([`Clock::computed`]): a fixed cost
//!   per call, the measured time, or nothing ([`ComputeCost`]), divided by the node's speed.
//! - Faults at chosen virtual times: a node that dies (its neighbours see the connection close),
//!   a node that stalls (its neighbours see it fall silent after `peer_timeout`), a link that adds
//!   delay for a while.
//! - Every wait has a timeout in virtual time; the run as a whole is bounded by `time_limit`.
//!
//! Invariants (tested below): per-link FIFO order; a message never arrives before it was sent
//! plus the link's latency; the trace of a seed is the same on every run.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ringtmp_wire::{Control, Message};

use crate::error::{PeerName, TransportError};
use crate::pool::BufferPool;
use crate::transport::LinkStats;
use crate::transport::{Clock, Transport};

/// How much virtual time compute takes.
#[derive(Clone, Debug)]
pub enum ComputeCost {
    /// None: only the network takes time.
    Zero,
    /// This much per accounted call (deterministic).
    Fixed(Duration),
    /// The time it took on this machine (realistic, not reproducible).
    Measured,
    /// What a cost model says the work recorded since the last accounted call
    /// ([`ringtmp_meter::take`]) takes (deterministic; works in phantom mode, where nothing is
    /// computed to measure).
    Priced(Arc<dyn Pricing>),
}

impl PartialEq for ComputeCost {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Zero, Self::Zero) | (Self::Measured, Self::Measured) => true,
            (Self::Fixed(a), Self::Fixed(b)) => a == b,
            (Self::Priced(a), Self::Priced(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// A cost model: the virtual time some recorded work takes on a node of speed 1.
pub trait Pricing: Send + Sync + std::fmt::Debug {
    /// What `work` costs.
    fn price(&self, work: &ringtmp_meter::Work) -> Duration;
}

/// Something that goes wrong at a chosen virtual time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// The node's process ends without a goodbye at `at`.
    Die {
        /// The node.
        rank: u32,
        /// When.
        at: Duration,
    },
    /// The node stops doing anything at `at` (a frozen process, `kill -STOP`).
    Stall {
        /// The node.
        rank: u32,
        /// When.
        at: Duration,
    },
    /// The node dies (or, with `stall`, freezes) `after` the message `trigger` describes is
    /// sent: a fault placed at a point of a protocol rather than at a time. With `after` zero
    /// and the node the trigger's sender, that message leaves and nothing the node sends after
    /// it does (a process killed between two writes).
    OnSend {
        /// The node.
        rank: u32,
        /// Freeze instead of dying.
        stall: bool,
        /// The message.
        trigger: SendTrigger,
        /// How long after it was sent.
        after: Duration,
    },
    /// Messages sent from `from` to `to` in `[start, end)` take `extra` longer.
    Delay {
        /// Sender.
        from: u32,
        /// Receiver.
        to: u32,
        /// From this virtual time…
        start: Duration,
        /// …until this one.
        end: Duration,
        /// Added latency.
        extra: Duration,
    },
}

/// The `nth` message (from 1) that `from` sends (to `to`, when given) whose
/// [`Message::describe`] starts with `what`: `"Replicate"`, `"Params tensor"`, …
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SendTrigger {
    /// Sender.
    pub from: u32,
    /// Receiver, or any.
    pub to: Option<u32>,
    /// How its description starts.
    pub what: &'static str,
    /// Which of the matching messages.
    pub nth: u32,
}

/// A simulated cluster: links, compute cost, faults and the seed.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seed of every random choice (jitter).
    pub seed: u64,
    /// One-way latency of every link.
    pub latency: Duration,
    /// Up to this much extra latency per message, drawn from the seed.
    pub jitter: Duration,
    /// Egress bandwidth of every node, bits per second (`None`: infinite).
    pub bandwidth_bps: Option<u64>,
    /// Per-node egress bandwidth overrides.
    pub node_bandwidth_bps: BTreeMap<u32, u64>,
    /// Per-node speed (1 = this machine; 0.25 = four times slower); compute cost is divided by it.
    pub node_speed: BTreeMap<u32, f64>,
    /// What compute costs in virtual time.
    pub compute: ComputeCost,
    /// Each accounted compute takes its cost times a seeded factor drawn uniformly from
    /// [1 − j, 1 + j] (0: exactly its cost). Real compute varies; without it, identical
    /// nodes stay in lockstep forever, which real ones do not.
    pub compute_jitter: f64,
    /// Silence after which a node's neighbours declare it dead.
    pub peer_timeout: Duration,
    /// Faults to inject.
    pub faults: Vec<Fault>,
    /// No node runs past this virtual time: one that would is ended with an error.
    pub time_limit: Duration,
    /// Runs every node's thread in phantom mode (`ringtmp_meter`): sizes only, no arithmetic;
    /// use with [`ComputeCost::Priced`].
    pub phantom: bool,
    /// In phantom mode, tensors up to this many values keep them (`ringtmp_meter::elides`).
    pub phantom_inline_values: usize,
}

impl SimConfig {
    /// 1 ms links, no jitter, infinite bandwidth, 1 ms per compute call, 5 s peer timeout, one
    /// virtual hour at most.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            latency: Duration::from_millis(1),
            jitter: Duration::ZERO,
            bandwidth_bps: None,
            node_bandwidth_bps: BTreeMap::new(),
            node_speed: BTreeMap::new(),
            compute: ComputeCost::Fixed(Duration::from_millis(1)),
            compute_jitter: 0.0,
            peer_timeout: Duration::from_secs(5),
            faults: Vec::new(),
            time_limit: Duration::from_secs(3600),
            phantom: false,
            phantom_inline_values: ringtmp_meter::DEFAULT_INLINE_VALUES,
        }
    }
}

/// The seed of a simulation test: `RINGTMP_SEED` when set (to replay a failure), else `default`.
/// Printed, so a failing test's output says how to replay it.
pub fn test_seed(default: u64) -> u64 {
    let seed = std::env::var("RINGTMP_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default);
    eprintln!("simulation seed {seed} (replay with RINGTMP_SEED={seed})");
    seed
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Runnable at its current time (also: not yet started).
    Ready,
    /// Holds the baton.
    Running,
    /// Waiting for an event until a deadline.
    Blocked { deadline: Duration },
    /// Accounting compute until a time.
    Sleeping { until: Duration },
    /// Ended its run (closed or dropped).
    Finished,
    /// Killed by a fault or the time limit.
    Dead,
    /// Frozen by a fault.
    Stalled,
}

enum Event {
    Message(u32, Message),
    Goodbye(u32),
    Failed(TransportError),
}

struct State {
    cfg: SimConfig,
    neighbours: Vec<BTreeSet<u32>>,
    now: Vec<Duration>,
    status: Vec<Status>,
    /// Events per node, by (arrival time, sequence number).
    inbox: Vec<BTreeMap<(Duration, u64), Event>>,
    seq: u64,
    /// Every node's card (egress shared by its links).
    cards: Vec<crate::sim_card::Card>,
    /// Messages still on a card: their link, arrival as scheduled, and latency after the card.
    flights: BTreeMap<u64, (u32, u32, Duration, Duration)>,
    link_last: BTreeMap<(u32, u32), Duration>,
    running: Option<u32>,
    rng: u64,
    stats: Vec<BTreeMap<u32, LinkStats>>,
    trace: std::collections::hash_map::DefaultHasher,
    events: u64,
    /// Set once only stalled nodes are left: their threads end.
    shutdown: bool,
    /// Why each dead node died.
    deaths: BTreeMap<u32, String>,
    /// The most nodes alive at once in the last run.
    most_alive: usize,
    /// When each node next has something to do, by (time, rank): the scheduler's queue. An
    /// entry may be early (the node's next event moved later since: checked as it is taken)
    /// but never late: whatever makes a node's next event earlier (an arrival) updates it.
    wake: BTreeSet<(Duration, u32)>,
    /// Each node's entry in `wake`.
    wake_at: Vec<Option<Duration>>,
}

struct Shared {
    state: Mutex<State>,
}

impl Shared {
    /// After a change of turn: nothing to wake, since the driver of [`SimNetwork::run`] resumes
    /// whichever node holds the baton once the one that gave it up has suspended.
    fn wake(&self, _st: &mut State) {}
}

/// The simulated node whose coroutine runs now on this thread, and where it suspends to: set by
/// [`SimNetwork::run`] around each resume.
struct Current {
    rank: u32,
    yielder: *const corosensei::Yielder<(), ()>,
}

thread_local! {
    static CURRENT: Cell<Option<Current>> = const { Cell::new(None) };
}

/// Gives the thread back to the driver until it resumes this node (any change of turn goes
/// through the driver), then takes the state's lock again.
fn park<'a>(shared: &'a Shared, st: MutexGuard<'a, State>, rank: u32) -> MutexGuard<'a, State> {
    drop(st);
    let current = CURRENT.take();
    match &current {
        Some(c) if c.rank == rank => {
            let yielder = c.yielder;
            CURRENT.set(current);
            // SAFETY: the yielder is the running coroutine's own, alive while it runs, and
            // this code runs on that coroutine's stack (CURRENT names it).
            unsafe { (*yielder).suspend(()) };
        }
        _ => panic!("simulated rank {rank} waited outside SimNetwork::run"),
    }
    lock(shared)
}

/// Bytes of stack each simulated node runs on (mapped as it is touched: a node uses tens of
/// KiB of it; the rest is address space).
pub const STACK_BYTES: usize = 2 << 20;

/// A simulation too large for this machine: the nodes alive at once (started, not ended) each
/// need a stack and their own state, and the system refused one more stack, or the process
/// grew past the memory it may use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "a simulation of {nodes} nodes is too large for this machine: with {alive} nodes alive at \
     once, {reason}. Each node alive takes a stack ({} KiB of address space, two memory maps of \
     the vm.max_map_count a Linux process may hold, usually 65,530) and its own state (its model \
     as sizes, its buffers): simulate fewer nodes, or a strategy that leaves more of them idle",
    STACK_BYTES / 1024
)]
pub struct SimLimit {
    /// Nodes of the simulation.
    pub nodes: usize,
    /// Nodes alive at once when the limit was met.
    pub alive: usize,
    /// Which limit, in words.
    pub reason: String,
}

/// This process's resident memory and what it may grow to (its resident memory at the start
/// and 85% of what the kernel says is available then), where `/proc` tells.
fn memory_now() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn memory_budget() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available_kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(memory_now()? + available_kib * 1024 / 100 * 85)
}

/// A simulated network: create it, take one [`SimNode`] per rank (or use [`SimNetwork::run`]).
pub struct SimNetwork {
    shared: Arc<Shared>,
    world: u32,
}

/// One node's end of a [`SimNetwork`].
pub struct SimNode {
    shared: Arc<Shared>,
    rank: u32,
    pending: VecDeque<(u32, Message)>,
    goodbyes: BTreeSet<u32>,
    buffers: BufferPool,
    /// Whether this node's thread holds the baton now.
    held: Cell<bool>,
    closed: bool,
    audit: Option<std::cell::RefCell<Vec<crate::network::SentRecord>>>,
}

/// A node's virtual clock.
struct SimClock {
    shared: Arc<Shared>,
    rank: u32,
}

impl SimNetwork {
    /// A network of `neighbours.len()` nodes where node r links to `neighbours[r]` (links are
    /// made symmetric).
    pub fn new(cfg: SimConfig, neighbours: Vec<BTreeSet<u32>>) -> Self {
        let world = neighbours.len() as u32;
        let mut links = neighbours;
        for r in 0..world {
            for p in links[r as usize].clone() {
                if p < world && p != r {
                    links[p as usize].insert(r);
                }
            }
            links[r as usize].retain(|p| *p < world && *p != r);
        }
        let n = world as usize;
        let rng = cfg.seed ^ 0x9e37_79b9_7f4a_7c15;
        let state = State {
            cfg,
            stats: links
                .iter()
                .map(|peers| {
                    peers
                        .iter()
                        .map(|p| {
                            (
                                *p,
                                LinkStats {
                                    peer: *p,
                                    ..Default::default()
                                },
                            )
                        })
                        .collect()
                })
                .collect(),
            neighbours: links,
            now: vec![Duration::ZERO; n],
            status: vec![Status::Ready; n],
            inbox: (0..n).map(|_| BTreeMap::new()).collect(),
            seq: 0,
            cards: (0..n).map(|_| crate::sim_card::Card::default()).collect(),
            flights: BTreeMap::new(),
            link_last: BTreeMap::new(),
            running: None,
            rng,
            trace: std::collections::hash_map::DefaultHasher::new(),
            events: 0,
            shutdown: false,
            deaths: BTreeMap::new(),
            most_alive: 0,
            wake: (0..world).map(|r| (Duration::ZERO, r)).collect(),
            wake_at: vec![Some(Duration::ZERO); n],
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
        });
        // The first turn goes to rank 0 at time 0, whenever its thread gets there.
        {
            let mut st = lock(&shared);
            schedule(&mut st);
        }
        Self { shared, world }
    }

    /// Node `rank`'s end of the network (each rank once, run as a coroutine by
    /// [`SimNetwork::run`]).
    fn node(&self, rank: u32) -> SimNode {
        SimNode {
            shared: self.shared.clone(),
            rank,
            pending: VecDeque::new(),
            goodbyes: BTreeSet::new(),
            buffers: BufferPool::default(),
            held: Cell::new(false),
            closed: false,
            audit: None,
        }
    }

    /// Runs `body(node)` for every rank, each as a coroutine on this thread, and returns the
    /// results in rank order once every node has finished, died or (stalled nodes) been
    /// released at the end.
    ///
    /// # Panics
    /// If a node's body panics (the panic goes on from here), or a stack for a node cannot be
    /// made ([`SimNetwork::try_run`] says so instead).
    pub fn run<R>(&self, body: impl Fn(SimNode) -> R + Sync) -> Vec<R> {
        self.try_run(body)
            .unwrap_or_else(|e| panic!("simulated network: {e}"))
    }

    /// [`SimNetwork::run`], or why the simulation could not hold its nodes: the stacks of the
    /// nodes alive at once are the simulator's limit (`STACK_BYTES` each, address space and
    /// memory maps of this process).
    pub fn try_run<R>(&self, body: impl Fn(SimNode) -> R + Sync) -> Result<Vec<R>, SimLimit> {
        type Node<'a> = corosensei::Coroutine<(), (), (), corosensei::stack::DefaultStack>;
        let world = self.world as usize;
        let (phantom, inline) = {
            let st = lock(&self.shared);
            (st.cfg.phantom, st.cfg.phantom_inline_values)
        };
        let caller_meter = (ringtmp_meter::phantom_settings(), ringtmp_meter::take());
        ringtmp_meter::set_phantom(phantom, inline);
        // Results outlive the coroutines that write them (declared first, dropped last).
        let mut results: Vec<Option<R>> = (0..world).map(|_| None).collect();
        let results_at = results.as_mut_ptr();
        let mut work: Vec<ringtmp_meter::Work> = vec![ringtmp_meter::Work::default(); world];
        let mut spare: Vec<corosensei::stack::DefaultStack> = Vec::new();
        let mut alive_most = 0usize;
        let mut nodes: BTreeMap<u32, Node<'_>> = BTreeMap::new();
        let mut yielders: BTreeMap<u32, *const corosensei::Yielder<(), ()>> = BTreeMap::new();
        let mut done = vec![false; world];
        let (mut deaths_seen, mut dying) = (0usize, Vec::<u32>::new());
        let budget = memory_budget();
        let mut resumes = 0u64;
        let body = &body;
        let outcome = (|| {
            loop {
                // The process's memory, now and then: nodes alive at once past what this
                // machine holds end the run with the figures, not in the kernel's OOM killer.
                resumes += 1;
                if resumes.is_multiple_of(1024)
                    && let (Some(now), Some(most)) = (memory_now(), budget)
                    && now > most
                {
                    return Err(SimLimit {
                        nodes: world,
                        alive: nodes.len(),
                        reason: format!(
                            "the simulation held {:.1} GB, past the {:.1} GB this machine had \
                             available for it",
                            now as f64 / 1e9,
                            most as f64 / 1e9
                        ),
                    });
                }
                // Who runs next: a node killed while it waited (it must see its death), else
                // the baton's holder, else, once nobody can run, every node not yet ended (the
                // stalled ones and those never started learn that the run is over).
                let next = {
                    let mut st = lock(&self.shared);
                    if st.deaths.len() != deaths_seen {
                        deaths_seen = st.deaths.len();
                        dying.extend(st.deaths.keys().filter(|r| nodes.contains_key(r)));
                    }
                    match (dying.pop(), st.running) {
                        (Some(r), _) => Some(r),
                        (None, Some(r)) if !done[r as usize] => Some(r),
                        _ => {
                            st.shutdown = true;
                            (0..self.world).find(|r| !done[*r as usize])
                        }
                    }
                };
                let Some(r) = next else { return Ok(()) };
                let ri = r as usize;
                if done[ri] {
                    continue;
                }
                if !nodes.contains_key(&r) {
                    let stack = match spare.pop() {
                        Some(stack) => stack,
                        None => corosensei::stack::DefaultStack::new(STACK_BYTES).map_err(|e| {
                            SimLimit {
                                nodes: world,
                                alive: nodes.len() + 1,
                                reason: format!("the system refused a stack for one more ({e})"),
                            }
                        })?,
                    };
                    let node = self.node(r);
                    let slot = results_at.wrapping_add(ri);
                    let start = move |yielder: &corosensei::Yielder<(), ()>, ()| {
                        CURRENT.set(Some(Current {
                            rank: r,
                            yielder: yielder as *const _,
                        }));
                        let result = body(node);
                        // SAFETY: `slot` points into `results`, which outlives every
                        // coroutine of this run; each writes its own element once.
                        unsafe { *slot = Some(result) };
                    };
                    // SAFETY: the coroutine borrows `body` and `results`, both alive until the
                    // coroutines are dropped or finished: `nodes` is dropped before either.
                    let coroutine = unsafe { Node::with_stack_unchecked(stack, start) };
                    nodes.insert(r, coroutine);
                    alive_most = alive_most.max(nodes.len());
                }
                let coroutine = nodes.get_mut(&r).expect("made above");
                ringtmp_meter::restore(std::mem::take(&mut work[ri]));
                CURRENT.set(Some(Current {
                    rank: r,
                    yielder: yielders.get(&r).copied().unwrap_or(std::ptr::null()),
                }));
                let ended = matches!(
                    coroutine.resume(()),
                    corosensei::CoroutineResult::Return(())
                );
                if let Some(c) = CURRENT.take()
                    && c.rank == r
                    && !c.yielder.is_null()
                {
                    yielders.insert(r, c.yielder);
                }
                work[ri] = ringtmp_meter::take();
                if ended {
                    done[ri] = true;
                    yielders.remove(&r);
                    if let Some(finished) = nodes.remove(&r) {
                        spare.push(finished.into_stack());
                    }
                }
            }
        })();
        drop(nodes);
        ringtmp_meter::set_phantom(caller_meter.0.0, caller_meter.0.1);
        ringtmp_meter::restore(caller_meter.1);
        lock(&self.shared).most_alive = alive_most;
        outcome?;
        Ok(results
            .into_iter()
            .map(|r| r.expect("every node's body returned"))
            .collect())
    }

    /// The most nodes that were alive at once (had started and not ended) in the last run.
    pub fn most_alive(&self) -> usize {
        lock(&self.shared).most_alive
    }

    /// A hash of everything that was sent (when, from, to, what, how big; for control messages,
    /// which may carry measurements, when and between whom): equal for equal runs.
    pub fn trace_hash(&self) -> u64 {
        lock(&self.shared).trace.finish()
    }

    /// Messages sent so far.
    pub fn events(&self) -> u64 {
        lock(&self.shared).events
    }

    /// The latest virtual time any node reached.
    pub fn elapsed(&self) -> Duration {
        lock(&self.shared)
            .now
            .iter()
            .copied()
            .max()
            .unwrap_or_default()
    }

    /// Virtual time node `rank` reached.
    pub fn node_time(&self, rank: u32) -> Duration {
        lock(&self.shared).now[rank as usize]
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl State {
    fn speed(&self, rank: u32) -> f64 {
        self.cfg
            .node_speed
            .get(&rank)
            .copied()
            .filter(|s| *s > 0.0)
            .unwrap_or(1.0)
    }

    fn push(&mut self, to: u32, at: Duration, event: Event) {
        self.seq += 1;
        self.inbox[to as usize].insert((at, self.seq), event);
        self.touch(to);
    }

    /// Puts node `r`'s entry in the scheduler's queue at its current next event.
    fn touch(&mut self, r: u32) {
        let ri = r as usize;
        let next = self.wake_time(ri);
        if self.wake_at[ri] == next {
            return;
        }
        if let Some(old) = self.wake_at[ri] {
            self.wake.remove(&(old, r));
        }
        if let Some(t) = next {
            self.wake.insert((t, r));
        }
        self.wake_at[ri] = next;
    }

    /// SplitMix64: a seeded stream with no dependency to keep stable.
    fn random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Whether `rank` has died or frozen by now (a node runs on until it next yields the baton;
    /// what it sends after its fault's time never leaves).
    fn faulted(&self, rank: u32) -> bool {
        let now = self.now[rank as usize];
        self.cfg.faults.iter().any(|f| {
            matches!(*f, Fault::Die { rank: x, at } | Fault::Stall { rank: x, at }
                if x == rank && at <= now)
        })
    }

    /// Turns the send-triggered faults that `message` (from `from` to `to`, now) fires into
    /// faults at a time.
    fn trigger_faults(&mut self, from: u32, to: u32, message: &Message) {
        let now = self.now[from as usize];
        let mut description: Option<String> = None;
        for fault in &mut self.cfg.faults {
            let Fault::OnSend {
                rank,
                stall,
                trigger,
                after,
            } = fault
            else {
                continue;
            };
            if trigger.from != from || trigger.to.is_some_and(|t| t != to) {
                continue;
            }
            let text = description.get_or_insert_with(|| message.describe());
            if !text.starts_with(trigger.what) {
                continue;
            }
            trigger.nth = trigger.nth.saturating_sub(1);
            if trigger.nth == 0 {
                let (rank, at) = (*rank, now + *after);
                *fault = if *stall {
                    Fault::Stall { rank, at }
                } else {
                    Fault::Die { rank, at }
                };
            }
        }
    }

    /// Puts `message` on the wire from `from` to `to` at `from`'s current time.
    fn transmit(&mut self, from: u32, to: u32, message: Message) {
        if self.faulted(from) {
            return;
        }
        if self
            .cfg
            .faults
            .iter()
            .any(|f| matches!(f, Fault::OnSend { .. }))
        {
            self.trigger_faults(from, to, &message);
        }
        // Declared, not held: a phantom tensor carries no values but costs its size.
        let bytes = ringtmp_wire::frame::declared_len(&message) as u64;
        let now = self.now[from as usize];
        let bandwidth = self
            .cfg
            .node_bandwidth_bps
            .get(&from)
            .copied()
            .or(self.cfg.bandwidth_bps);
        let jitter = if self.cfg.jitter.is_zero() {
            Duration::ZERO
        } else {
            let nanos = self.cfg.jitter.as_nanos().min(u128::from(u64::MAX)) as u64;
            Duration::from_nanos(self.random() % nanos.max(1))
        };
        let extra: Duration = self
            .cfg
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::Delay {
                    from: a,
                    to: b,
                    start,
                    end,
                    extra,
                } if a == from && b == to && (start..end).contains(&now) => Some(extra),
                _ => None,
            })
            .sum();
        let tail = self.cfg.latency + jitter + extra;
        self.seq += 1;
        let seq = self.seq;
        // When the card has sent it (the links with bytes queued share the card), then the
        // link's latency; other messages still on the card may now leave later.
        let sent = match bandwidth {
            None => now,
            Some(bps) => self.on_card(from, to, now, bytes, bps, seq, tail),
        };
        let last = self.link_last.get(&(from, to)).copied().unwrap_or_default();
        // TCP keeps a link's order: a message never overtakes the one before it.
        let arrival = (sent + tail).max(last);
        self.link_last.insert((from, to), arrival);
        let kind: u8 = match &message {
            Message::Control(_) => 0,
            Message::Tensor(h, _) => 1 + h.tag as u8,
        };
        // Control messages may carry measurements (a node's report: CPU seconds, peak memory)
        // whose size differs between equal runs; the trace records their kind and sending time.
        if kind == 0 {
            (now.as_nanos(), from, to).hash(&mut self.trace);
        } else {
            (arrival.as_nanos(), now.as_nanos(), from, to, kind, bytes).hash(&mut self.trace);
        }
        self.events += 1;
        if let Some(s) = self.stats[from as usize].get_mut(&to) {
            s.bytes_sent += bytes;
            s.messages_sent += 1;
        }
        if bandwidth.is_some() {
            self.flights.insert(seq, (from, to, arrival, tail));
        }
        if !matches!(self.status[to as usize], Status::Dead) {
            self.inbox[to as usize].insert((arrival, seq), Event::Message(from, message));
            self.touch(to);
        }
    }

    /// Queues a message of `bytes` from `from` to `to` on `from`'s card at `now`; returns when
    /// the card will have sent it, and moves the arrival of every message the new one delays
    /// (later, never earlier, each link's in its order).
    fn on_card(
        &mut self,
        from: u32,
        to: u32,
        now: Duration,
        bytes: u64,
        bps: u64,
        seq: u64,
        tail: Duration,
    ) -> Duration {
        let (finished, times) =
            self.cards[from as usize].send(now, bps.max(1) as f64, to, bytes as f64 * 8.0, seq);
        for id in finished {
            self.flights.remove(&id);
        }
        let mut sent_new = now;
        let mut previous: Option<(u32, Duration)> = None;
        for (link, id, done) in times {
            if id == seq {
                sent_new = done;
                previous = Some((link, done + tail));
                continue;
            }
            let Some(&(f, t, old, tail)) = self.flights.get(&id) else {
                continue;
            };
            let mut arrival = (done + tail).max(old);
            if let Some((l, a)) = previous
                && l == link
            {
                arrival = arrival.max(a);
            }
            previous = Some((link, arrival));
            if arrival != old {
                if let Some(event) = self.inbox[t as usize].remove(&(old, id)) {
                    self.inbox[t as usize].insert((arrival, id), event);
                }
                self.flights.insert(id, (f, t, arrival, tail));
                let last = self.link_last.entry((f, t)).or_default();
                *last = (*last).max(arrival);
            }
        }
        sent_new
    }

    /// When something sent on `from → to` at `at` arrives after `delay`: never before what the
    /// link carries already (a goodbye or a reset does not overtake data in flight).
    fn after_link(&mut self, from: u32, to: u32, at: Duration, delay: Duration) -> Duration {
        let last = self.link_last.get(&(from, to)).copied().unwrap_or_default();
        let arrival = at.max(last) + delay;
        self.link_last.insert((from, to), arrival);
        arrival
    }

    /// When node `r` next has something to do, if ever.
    fn wake_time(&self, r: usize) -> Option<Duration> {
        let first = || self.inbox[r].keys().next().map(|(t, _)| *t);
        match self.status[r] {
            Status::Ready | Status::Running => Some(self.now[r]),
            Status::Sleeping { until } => Some(until),
            Status::Blocked { deadline } => Some(first().map_or(deadline, |t| t.min(deadline))),
            Status::Finished | Status::Dead | Status::Stalled => None,
        }
    }

    /// Tells `rank`'s neighbours (that are still there) about its failure at `at`.
    fn fail_neighbours(&mut self, rank: u32, at: Duration, silent: bool) {
        let peers: Vec<u32> = self.neighbours[rank as usize].iter().copied().collect();
        for p in peers {
            if matches!(self.status[p as usize], Status::Finished | Status::Dead) {
                continue;
            }
            let peer = PeerName {
                rank: Some(rank),
                addr: None,
            };
            let (when, error) = if silent {
                // Silence counts from the last byte that reached the peer.
                let timeout = self.cfg.peer_timeout;
                (
                    self.after_link(rank, p, at, timeout),
                    TransportError::PeerSilent {
                        peer,
                        silent_for: self.cfg.peer_timeout,
                    },
                )
            } else {
                let latency = self.cfg.latency;
                (
                    self.after_link(rank, p, at, latency),
                    TransportError::PeerClosed {
                        peer,
                        reason: "connection closed without a goodbye".into(),
                    },
                )
            };
            self.push(p, when, Event::Failed(error));
        }
    }
}

/// Hands the baton to the node with the earliest thing to do (ties: lowest rank), applying the
/// faults and the time limit on the way. Leaves `running` empty when nobody can run.
fn schedule(st: &mut State) {
    loop {
        let Some(&(at, rank)) = st.wake.first() else {
            st.running = None;
            return;
        };
        let r = rank as usize;
        // An early entry (the node's next event moved later): put it right and look again.
        if st.wake_time(r) != Some(at) {
            st.touch(rank);
            continue;
        }
        let fault = st.cfg.faults.iter().find_map(|f| match *f {
            Fault::Die { rank: x, at: t } if x == rank && t <= at => Some((t, false)),
            Fault::Stall { rank: x, at: t } if x == rank && t <= at => Some((t, true)),
            _ => None,
        });
        if let Some((t, stalled)) = fault {
            st.now[r] = st.now[r].max(t);
            st.status[r] = if stalled {
                Status::Stalled
            } else {
                st.deaths.insert(
                    rank,
                    format!("rank {rank} was killed at {t:?} (simulated fault)"),
                );
                Status::Dead
            };
            st.touch(rank);
            st.fail_neighbours(rank, t, stalled);
            // The fault fires once.
            st.cfg.faults.retain(|f| {
                !matches!(*f, Fault::Die { rank: x, .. } | Fault::Stall { rank: x, .. } if x == rank)
            });
            continue;
        }
        if at > st.cfg.time_limit {
            st.status[r] = Status::Dead;
            st.touch(rank);
            st.deaths.insert(
                rank,
                format!(
                    "rank {rank} ran past the simulation's time limit of {:?}",
                    st.cfg.time_limit
                ),
            );
            st.fail_neighbours(rank, st.cfg.time_limit, false);
            continue;
        }
        st.now[r] = st.now[r].max(at);
        st.status[r] = Status::Running;
        st.touch(rank);
        st.running = Some(rank);
        return;
    }
}

fn killed(st: &State, rank: u32) -> TransportError {
    TransportError::Io {
        context: "simulation".into(),
        source: std::io::Error::other(
            st.deaths
                .get(&rank)
                .cloned()
                .unwrap_or_else(|| format!("rank {rank} was stopped at the end of the simulation")),
        ),
    }
}

/// Waits for `rank`'s turn (the first call of a thread, or after giving the baton up).
fn acquire<'a>(
    shared: &'a Shared,
    rank: u32,
    held: &Cell<bool>,
    mut st: MutexGuard<'a, State>,
) -> Result<MutexGuard<'a, State>, TransportError> {
    let r = rank as usize;
    loop {
        if matches!(st.status[r], Status::Dead) || st.shutdown {
            held.set(false);
            return Err(killed(&st, rank));
        }
        if st.running == Some(rank) {
            held.set(true);
            return Ok(st);
        }
        st = park(shared, st, rank);
    }
}

/// The state, in `rank`'s turn.
fn enter<'a>(
    shared: &'a Shared,
    rank: u32,
    held: &Cell<bool>,
) -> Result<MutexGuard<'a, State>, TransportError> {
    let st = lock(shared);
    if held.get() && st.running == Some(rank) {
        return Ok(st);
    }
    acquire(shared, rank, held, st)
}

/// Gives the turn up in `status` and waits until it comes back.
fn wait_as<'a>(
    shared: &'a Shared,
    rank: u32,
    held: &Cell<bool>,
    mut st: MutexGuard<'a, State>,
    status: Status,
) -> Result<MutexGuard<'a, State>, TransportError> {
    st.status[rank as usize] = status;
    st.touch(rank);
    held.set(false);
    schedule(&mut st);
    shared.wake(&mut st);
    acquire(shared, rank, held, st)
}

impl SimNode {
    /// Starts recording every message this node sends (as [`crate::Network::enable_audit`]).
    pub fn enable_audit(&mut self) {
        self.audit = Some(std::cell::RefCell::new(Vec::new()));
    }

    /// The messages sent since [`SimNode::enable_audit`].
    pub fn audit_log(&self) -> Vec<crate::network::SentRecord> {
        self.audit
            .as_ref()
            .map(|a| a.borrow().clone())
            .unwrap_or_default()
    }

    /// The first event that has arrived by now, if any.
    fn arrived(st: &mut State, r: usize) -> Option<Event> {
        let now = st.now[r];
        let key = *st.inbox[r].keys().next()?;
        if key.0 > now {
            return None;
        }
        let event = st.inbox[r].remove(&key)?;
        if let Event::Message(from, m) = &event
            && let Some(s) = st.stats[r].get_mut(from)
        {
            s.bytes_received += ringtmp_wire::frame::declared_len(m) as u64;
            s.messages_received += 1;
        }
        if let Event::Message(_, Message::Tensor(h, _)) = &event {
            // Decoding and combining it (sum, average, copy into a buffer): one pass.
            ringtmp_meter::elementwise(h.elements().unwrap_or(0) as usize);
        }
        Some(event)
    }

    /// Sends an abort to every neighbour but `skip`.
    fn broadcast_abort(rank: u32, st: &mut State, skip: u32, origin: u32, reason: &str) {
        let peers: Vec<u32> = st.neighbours[rank as usize].iter().copied().collect();
        for p in peers.into_iter().filter(|p| *p != skip) {
            st.transmit(
                rank,
                p,
                Message::Control(Control::Abort {
                    origin,
                    reason: reason.to_string(),
                }),
            );
        }
    }

    /// The next message (from `awaited`, or anyone), waiting until `deadline` in virtual time.
    fn next(
        &mut self,
        deadline: Duration,
        awaited: Option<u32>,
    ) -> Result<(u32, Message), TransportError> {
        let r = self.rank as usize;
        let shared = Arc::clone(&self.shared);
        let mut st = enter(&shared, self.rank, &self.held)?;
        let started = st.now[r];
        loop {
            while let Some(event) = Self::arrived(&mut st, r) {
                match event {
                    Event::Message(from, Message::Control(Control::Abort { origin, reason })) => {
                        Self::broadcast_abort(self.rank, &mut st, from, origin, &reason);
                        return Err(TransportError::Aborted { origin, reason });
                    }
                    Event::Message(from, m) => {
                        if awaited.is_none_or(|a| a == from) {
                            return Ok((from, m));
                        }
                        self.pending.push_back((from, m));
                    }
                    Event::Goodbye(from) => {
                        self.goodbyes.insert(from);
                        if awaited == Some(from) {
                            return Err(TransportError::PeerClosed {
                                peer: name(from),
                                reason: "it finished and said goodbye".into(),
                            });
                        }
                    }
                    Event::Failed(e) => {
                        let waiting_for = match awaited {
                            Some(a) => format!("a message from {}", name(a)),
                            None => "a message from any peer".into(),
                        };
                        return Err(TransportError::WhileWaiting {
                            waiting_for,
                            cause: Box::new(e),
                        });
                    }
                }
            }
            if st.now[r] >= deadline {
                let waited = st.now[r].saturating_sub(started);
                return Err(TransportError::Timeout {
                    what: "a message".into(),
                    from: match awaited {
                        Some(a) => name(a).to_string(),
                        None => format!(
                            "any of ranks {:?}",
                            st.neighbours[r].iter().collect::<Vec<_>>()
                        ),
                    },
                    waited,
                });
            }
            st = wait_as(
                &shared,
                self.rank,
                &self.held,
                st,
                Status::Blocked { deadline },
            )?;
        }
    }
}

fn name(rank: u32) -> PeerName {
    PeerName {
        rank: Some(rank),
        addr: None,
    }
}

impl Transport for SimNode {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn peers(&self) -> Vec<u32> {
        lock(&self.shared).neighbours[self.rank as usize]
            .iter()
            .copied()
            .collect()
    }

    fn peer_name(&self, rank: u32) -> PeerName {
        name(rank)
    }

    fn send(&self, to: u32, message: Message) -> Result<(), TransportError> {
        let mut st = enter(&self.shared, self.rank, &self.held)?;
        if !st.neighbours[self.rank as usize].contains(&to) {
            return Err(TransportError::NoLink(to));
        }
        if let Some(audit) = &self.audit {
            audit
                .borrow_mut()
                .push(crate::network::SentRecord::of(to, &message));
        }
        if let Message::Tensor(h, _) = &message {
            // Encoding it: one pass over its values.
            ringtmp_meter::elementwise(h.elements().unwrap_or(0) as usize);
        }
        st.transmit(self.rank, to, message);
        Ok(())
    }

    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(m);
        }
        let deadline = lock(&self.shared).now[self.rank as usize] + wait;
        self.next(deadline, None)
    }

    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(Some(m));
        }
        let deadline = lock(&self.shared).now[self.rank as usize];
        match self.next(deadline, None) {
            Ok(m) => Ok(Some(m)),
            Err(TransportError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        if let Some(i) = self.pending.iter().position(|(r, _)| *r == from) {
            return Ok(self.pending.remove(i).expect("index from position").1);
        }
        if !lock(&self.shared).neighbours[self.rank as usize].contains(&from) {
            return Err(TransportError::NoLink(from));
        }
        let deadline = lock(&self.shared).now[self.rank as usize] + wait;
        self.next(deadline, Some(from)).map(|(_, m)| m)
    }

    fn unread(&mut self, from: u32, message: Message) {
        self.pending.push_front((from, message));
    }

    fn buffers(&self) -> &BufferPool {
        &self.buffers
    }

    fn stats(&self) -> Vec<LinkStats> {
        lock(&self.shared).stats[self.rank as usize]
            .values()
            .cloned()
            .collect()
    }

    fn abort(&self, reason: &str) {
        if let Ok(mut st) = enter(&self.shared, self.rank, &self.held) {
            Self::broadcast_abort(self.rank, &mut st, u32::MAX, self.rank, reason);
        }
    }

    fn close(&mut self) -> Result<(), TransportError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let r = self.rank as usize;
        let shared = Arc::clone(&self.shared);
        let mut st = enter(&shared, self.rank, &self.held)?;
        let peers: Vec<u32> = st.neighbours[r].iter().copied().collect();
        for p in &peers {
            let (now, latency) = (st.now[r], st.cfg.latency);
            let at = st.after_link(self.rank, *p, now, latency);
            st.push(*p, at, Event::Goodbye(self.rank));
        }
        // Wait (bounded by the peer timeout) for every peer's goodbye, as the TCP network does,
        // so that no side mistakes the end of the run for a failure.
        let deadline = st.now[r] + st.cfg.peer_timeout;
        loop {
            let mut failed = false;
            while let Some(event) = Self::arrived(&mut st, r) {
                match event {
                    Event::Goodbye(from) => {
                        self.goodbyes.insert(from);
                    }
                    Event::Failed(_) => failed = true,
                    Event::Message(..) => {}
                }
            }
            if failed || self.goodbyes.len() >= peers.len() || st.now[r] >= deadline {
                break;
            }
            st = wait_as(
                &shared,
                self.rank,
                &self.held,
                st,
                Status::Blocked { deadline },
            )?;
        }
        st.status[r] = Status::Finished;
        st.running = None;
        schedule(&mut st);
        self.held.set(false);
        self.shared.wake(&mut st);
        Ok(())
    }

    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SimClock {
            shared: self.shared.clone(),
            rank: self.rank,
        })
    }
}

impl Drop for SimNode {
    /// A node whose thread ends without closing is a process that exited: its neighbours see the
    /// connection close.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let r = self.rank as usize;
        let mut st = lock(&self.shared);
        if matches!(st.status[r], Status::Dead | Status::Finished) {
            return;
        }
        let now = st.now[r];
        st.fail_neighbours(self.rank, now, false);
        st.status[r] = Status::Finished;
        if st.running == Some(self.rank) {
            st.running = None;
            schedule(&mut st);
        }
        self.shared.wake(&mut st);
    }
}

impl Clock for SimClock {
    fn is_virtual(&self) -> bool {
        true
    }

    fn overlaps_compute(&self) -> bool {
        false
    }

    fn now(&self) -> Duration {
        lock(&self.shared).now[self.rank as usize]
    }

    fn computed(&self, measured: Duration, speed: f64) {
        let mut st = lock(&self.shared);
        let r = self.rank as usize;
        // Compute is accounted in this node's turn, like everything else it does.
        while st.running != Some(self.rank) {
            if matches!(st.status[r], Status::Dead | Status::Finished) || st.shutdown {
                return;
            }
            st = park(&self.shared, st, self.rank);
        }
        let work = ringtmp_meter::take();
        let base = match &st.cfg.compute {
            ComputeCost::Zero => Duration::ZERO,
            ComputeCost::Fixed(d) => *d,
            ComputeCost::Measured => measured,
            ComputeCost::Priced(model) => model.price(&work),
        };
        let speed = (speed * st.speed(self.rank)).clamp(1e-6, 1.0e6);
        let mut cost = base.div_f64(speed);
        let jitter = st.cfg.compute_jitter.clamp(0.0, 1.0);
        if jitter > 0.0 && !cost.is_zero() {
            let u = (st.random() >> 11) as f64 / (1u64 << 53) as f64;
            cost = cost.mul_f64(1.0 + jitter * (2.0 * u - 1.0));
        }
        if cost.is_zero() {
            return;
        }
        st.status[r] = Status::Sleeping {
            until: st.now[r] + cost,
        };
        schedule(&mut st);
        self.shared.wake(&mut st);
        // Back when the scheduler says so (or at the end, for a node that was killed meanwhile).
        while st.running != Some(self.rank) && !matches!(st.status[r], Status::Dead) && !st.shutdown
        {
            st = park(&self.shared, st, self.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtmp_wire::{Dtype, TensorHeader, TensorTag};

    fn ring(n: u32) -> Vec<BTreeSet<u32>> {
        (0..n)
            .map(|r| BTreeSet::from([(r + 1) % n, (r + n - 1) % n]))
            .collect()
    }

    fn tensor(step: u64, bytes: usize) -> Message {
        Message::Tensor(
            TensorHeader {
                run_id: 0,
                step,
                micro_batch: 0,
                tag: TensorTag::Activation,
                dtype: Dtype::F32,
                shape: vec![(bytes / 4) as u32],
            },
            vec![0; bytes],
        )
    }

    /// Nodes are coroutines holding a stack only while alive: 200,000 nodes of which all but
    /// two end at once run with at most three alive, and the two that talk do so in virtual
    /// time as ever. Each node's meter record is its own though they share a thread.
    #[test]
    fn many_nodes_cost_a_stack_only_while_alive() {
        let n = 200_000u32;
        let mut links: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n as usize];
        links[0].insert(1);
        let mut cfg = SimConfig::new(7);
        cfg.latency = Duration::from_millis(2);
        cfg.compute = ComputeCost::Measured;
        let net = SimNetwork::new(cfg, links);
        let out = net.run(|mut node| {
            let me = node.rank();
            if me > 1 {
                return None;
            }
            let clock = node.clock();
            ringtmp_meter::elementwise(1000 * (me as usize + 1));
            if me == 0 {
                node.send(1, tensor(0, 64)).unwrap();
                node.recv_from(1, Duration::from_secs(1)).unwrap();
            } else {
                node.recv_from(0, Duration::from_secs(1)).unwrap();
                node.send(0, tensor(0, 64)).unwrap();
            }
            let (work, at) = (ringtmp_meter::take(), clock.now());
            node.close().unwrap();
            Some((at, work.elementwise))
        });
        assert_eq!(out.len(), n as usize);
        assert!(out[2..].iter().all(Option::is_none));
        let (t0, w0) = out[0].unwrap();
        let (_, w1) = out[1].unwrap();
        assert_eq!(
            t0,
            Duration::from_millis(4),
            "a round trip of two 2 ms links"
        );
        // Each its own work, plus decoding what it received (64 bytes: 16 values), plus
        // encoding what it sent (16 values).
        assert_eq!((w0, w1), (1000 + 32, 2000 + 32));
        assert!(net.most_alive() <= 3, "{}", net.most_alive());
    }

    /// Every node passes `rounds` tokens around the ring; returns each node's receive times.
    fn token_ring(cfg: SimConfig, n: u32, rounds: u64) -> (Vec<Vec<(u64, Duration)>>, u64) {
        let net = SimNetwork::new(cfg, ring(n));
        let out = net.run(|mut node| {
            let clock = node.clock();
            let me = node.rank();
            let mut seen = Vec::new();
            for step in 0..rounds {
                node.send((me + 1) % n, tensor(step, 4096)).unwrap();
                let m = node
                    .recv_from((me + n - 1) % n, Duration::from_secs(10))
                    .unwrap();
                let Message::Tensor(h, _) = m else { panic!() };
                seen.push((h.step, clock.now()));
                clock.computed(Duration::ZERO, 1.0);
            }
            node.close().unwrap();
            seen
        });
        (out, net.trace_hash())
    }

    #[test]
    fn messages_keep_link_order_and_take_latency_and_bandwidth() {
        let mut cfg = SimConfig::new(test_seed(1));
        cfg.jitter = Duration::from_millis(3);
        cfg.bandwidth_bps = Some(8_000_000); // 1 MB/s: a 4 KiB frame takes ~4.1 ms on the wire
        let (seen, _) = token_ring(cfg.clone(), 4, 20);
        for (rank, times) in seen.iter().enumerate() {
            let steps: Vec<u64> = times.iter().map(|t| t.0).collect();
            assert_eq!(
                steps,
                (0..20).collect::<Vec<_>>(),
                "rank {rank}: FIFO per link"
            );
            // The first token cannot arrive before wire time plus latency.
            assert!(
                times[0].1 >= Duration::from_micros(4100) + cfg.latency,
                "{times:?}"
            );
            assert!(times.windows(2).all(|w| w[0].1 <= w[1].1));
        }
    }

    #[test]
    fn a_seed_replays_exactly_and_another_seed_differs() {
        let mut cfg = SimConfig::new(test_seed(7));
        cfg.jitter = Duration::from_millis(5);
        let (a, ha) = token_ring(cfg.clone(), 5, 30);
        let (b, hb) = token_ring(cfg.clone(), 5, 30);
        assert_eq!((a.clone(), ha), (b, hb));
        cfg.seed += 1;
        let (_, hc) = token_ring(cfg, 5, 30);
        assert_ne!(ha, hc);
    }

    #[test]
    fn compute_cost_is_virtual_and_scaled_by_speed() {
        let mut cfg = SimConfig::new(test_seed(3));
        cfg.compute = ComputeCost::Fixed(Duration::from_millis(10));
        cfg.node_speed.insert(1, 0.25);
        let net = SimNetwork::new(cfg, ring(2));
        let started = std::time::Instant::now();
        let times = net.run(|mut node| {
            let clock = node.clock();
            for _ in 0..100 {
                clock.computed(Duration::from_secs(1), 1.0);
            }
            let t = clock.now();
            node.close().unwrap();
            t
        });
        // 100 × 10 ms, and 4× that on the quarter-speed node, without sleeping for real.
        assert_eq!(times[0], Duration::from_secs(1));
        assert_eq!(times[1], Duration::from_secs(4));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn compute_jitter_stays_in_its_bounds_and_replays() {
        let run = |seed: u64| {
            let mut cfg = SimConfig::new(seed);
            cfg.compute = ComputeCost::Fixed(Duration::from_millis(10));
            cfg.compute_jitter = 0.1;
            SimNetwork::new(cfg, ring(2)).run(|mut node| {
                let clock = node.clock();
                let mut each = Vec::new();
                for _ in 0..100 {
                    let before = clock.now();
                    clock.computed(Duration::ZERO, 1.0);
                    each.push(clock.now() - before);
                }
                node.close().unwrap();
                each
            })
        };
        let a = run(test_seed(5));
        assert_eq!(a, run(test_seed(5)), "a seed replays");
        for each in &a {
            assert!(
                each.iter().all(|d| (9..=11).contains(&d.as_millis())),
                "{each:?}"
            );
            let total: Duration = each.iter().sum();
            // Uniform in [9, 11] ms: 100 of them sum to 1 s ± a few ms, and differ.
            assert!(total.abs_diff(Duration::from_secs(1)) < Duration::from_millis(40));
            assert!(each.windows(2).any(|w| w[0] != w[1]));
        }
        assert_ne!(a[0], a[1], "each node draws its own");
    }

    #[test]
    fn a_dead_node_is_named_by_its_neighbours_and_a_stalled_one_falls_silent() {
        for (fault, expect) in [
            (
                Fault::Die {
                    rank: 2,
                    at: Duration::from_millis(50),
                },
                "closed without a goodbye",
            ),
            (
                Fault::Stall {
                    rank: 2,
                    at: Duration::from_millis(50),
                },
                "silent",
            ),
        ] {
            let mut cfg = SimConfig::new(test_seed(11));
            cfg.faults.push(fault);
            let n = 4;
            let net = SimNetwork::new(cfg.clone(), ring(n));
            let results = net.run(|mut node| -> Result<u64, String> {
                let me = node.rank();
                let clock = node.clock();
                for step in 0..1000 {
                    node.send((me + 1) % n, tensor(step, 64))
                        .map_err(|e| e.to_string())?;
                    node.recv_from((me + n - 1) % n, Duration::from_secs(30))
                        .map_err(|e| e.to_string())?;
                    clock.computed(Duration::ZERO, 1.0);
                }
                Ok(1000)
            });
            for (rank, r) in results.iter().enumerate() {
                let err = r.as_ref().expect_err("no node finishes 1000 rounds");
                if rank == 1 || rank == 3 {
                    assert!(
                        err.contains("rank 2") && err.contains(expect),
                        "rank {rank}: {err}"
                    );
                }
            }
            // Detection in virtual time: latency for a death, the peer timeout for a stall.
            let detected = net.node_time(3);
            let bound = Duration::from_millis(50) + cfg.peer_timeout + Duration::from_millis(10);
            assert!(detected <= bound, "{detected:?}");
        }
    }

    /// A fault placed at a message: killed or frozen right after its second send, rank 1's third
    /// never leaves (a process stopped between two writes), though its thread runs on until it
    /// waits; killed 10 ms after it, all three had left by then.
    #[test]
    fn a_fault_at_a_message_fires_between_two_sends() {
        for (stall, after, expect) in [
            (false, Duration::ZERO, vec![0, 1]),
            (true, Duration::ZERO, vec![0, 1]),
            (false, Duration::from_millis(10), vec![0, 1, 2]),
        ] {
            let mut cfg = SimConfig::new(test_seed(12));
            cfg.faults.push(Fault::OnSend {
                rank: 1,
                stall,
                trigger: SendTrigger {
                    from: 1,
                    to: Some(0),
                    what: "Activation tensor",
                    nth: 2,
                },
                after,
            });
            let net = SimNetwork::new(cfg, ring(2));
            let results = net.run(|mut node| -> Vec<u64> {
                if node.rank() == 1 {
                    for step in 0..3 {
                        let _ = node.send(0, tensor(step, 4));
                    }
                    let _ = node.recv(Duration::from_secs(30));
                    return Vec::new();
                }
                let mut got = Vec::new();
                while let Ok(Message::Tensor(h, _)) = node.recv_from(1, Duration::from_secs(30)) {
                    got.push(h.step);
                }
                got
            });
            assert_eq!(results[0], expect, "stall {stall}, {after:?} after");
        }
    }

    #[test]
    fn an_abort_reaches_every_node() {
        let cfg = SimConfig::new(test_seed(5));
        let n = 6;
        let net = SimNetwork::new(cfg, ring(n));
        let results = net.run(|mut node| {
            if node.rank() == 3 {
                node.abort("rank 3 gives up");
                return "aborted".to_string();
            }
            node.recv(Duration::from_secs(60))
                .map(|_| "message".to_string())
                .unwrap_or_else(|e| e.to_string())
        });
        for (rank, r) in results.iter().enumerate() {
            if rank != 3 {
                assert!(r.contains("rank 3 aborted the run"), "rank {rank}: {r}");
            }
        }
    }

    #[test]
    fn a_timeout_is_virtual() {
        let net = SimNetwork::new(SimConfig::new(test_seed(2)), ring(3));
        let started = std::time::Instant::now();
        let results = net.run(|mut node| {
            let e = node.recv(Duration::from_secs(120)).unwrap_err().to_string();
            (e, node.clock().now())
        });
        for (e, t) in results {
            assert!(e.contains("timed out after"), "{e}");
            assert_eq!(t, Duration::from_secs(120));
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
