//! Workers for the decoder's matrix–vector products, which come a few hundred per token, each
//! tens of microseconds long: waking a sleeping thread for each (as rayon's pool does when its
//! workers have gone to sleep between calls) took a third of a token's time on a 2-vCPU VM
//! (the kernel's scheduler functions at 15% of the samples, two threads 1.2× one). Here each
//! worker spins on its own slot for a while after a job, so the next one starts at once, and
//! parks only after [`SPIN`] without work.
//!
//! Invariants: a job is split into parts `0..n`, part 0 run by the caller and part `i` by
//! worker `i − 1`; [`run`] returns only when every part has finished, so the job may borrow
//! from the caller's stack; one caller at a time holds the workers (another, arriving while
//! they are held, runs its parts itself, in turn); a worker reads its slot's job only between
//! being handed it and saying it is done.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a worker spins for its next job before it parks.
const SPIN: Duration = Duration::from_micros(300);

const IDLE: u8 = 0;
const HANDED: u8 = 1;
const DONE: u8 = 2;

type Job = *const (dyn Fn(usize) + Sync);

/// One worker's mailbox.
struct Slot {
    state: AtomicU8,
    sleeping: AtomicBool,
    /// The last part this worker ran panicked (the caller panics in turn).
    panicked: AtomicBool,
    /// The job and the part to run: written by the caller while `state` is `IDLE`, read by
    /// the worker while it is `HANDED`.
    job: UnsafeCell<(Option<Job>, usize)>,
    thread: OnceLock<Thread>,
}

// SAFETY: `job` is written and read on either side of the `state` handshake (Release/Acquire),
// never at once; the job it points to is `Sync`.
unsafe impl Sync for Slot {}
// SAFETY: as above; the pointer is only dereferenced by the worker while the caller waits.
unsafe impl Send for Slot {}

struct Pool {
    slots: Vec<&'static Slot>,
    held: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let slots = (1..cores)
            .map(|_| {
                let slot: &'static Slot = Box::leak(Box::new(Slot {
                    state: AtomicU8::new(IDLE),
                    sleeping: AtomicBool::new(false),
                    panicked: AtomicBool::new(false),
                    job: UnsafeCell::new((None, 0)),
                    thread: OnceLock::new(),
                }));
                let handle = std::thread::Builder::new()
                    .name("ringtmp-decode".into())
                    .spawn(move || work(slot))
                    .expect("spawning a decode worker");
                let _ = slot.thread.set(handle.thread().clone());
                slot
            })
            .collect();
        Pool {
            slots,
            held: Mutex::new(()),
        }
    })
}

fn work(slot: &'static Slot) {
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        while slot.state.load(Ordering::Acquire) != HANDED {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && since.elapsed() > SPIN {
                slot.sleeping.store(true, Ordering::SeqCst);
                if slot.state.load(Ordering::SeqCst) != HANDED {
                    std::thread::park();
                }
                slot.sleeping.store(false, Ordering::SeqCst);
                since = Instant::now();
            }
        }
        // SAFETY: the caller wrote the job before handing it over (Release, seen by the
        // Acquire above) and waits for DONE before it returns or writes the slot again.
        let (job, part) = unsafe { *slot.job.get() };
        if let Some(job) = job {
            // SAFETY: as above: the job outlives this call.
            let job = unsafe { &*job };
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(part)));
            slot.panicked.store(ran.is_err(), Ordering::Relaxed);
        }
        slot.state.store(DONE, Ordering::Release);
    }
}

/// Parts a job runs at once: the caller and the workers.
pub fn parallelism() -> usize {
    pool().slots.len() + 1
}

/// Runs `job(i)` for every part `i` of `0..parts`, on this thread and the workers; returns
/// when all have finished.
pub fn run(parts: usize, job: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 {
        if parts == 1 {
            job(0);
        }
        return;
    }
    let pool = pool();
    let Ok(_held) = pool.held.try_lock() else {
        (0..parts).for_each(job);
        return;
    };
    let helpers = (parts - 1).min(pool.slots.len());
    // SAFETY: the pointer's lifetime is erased; every worker handed it is waited for below
    // (DONE) before this function returns, so it never outlives `job`.
    let erased: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
    for (i, slot) in pool.slots.iter().take(helpers).enumerate() {
        // SAFETY: the slot is IDLE: no worker reads it until HANDED below.
        unsafe { *slot.job.get() = (Some(erased), i + 1) };
        slot.state.store(HANDED, Ordering::SeqCst);
        if slot.sleeping.load(Ordering::SeqCst)
            && let Some(t) = slot.thread.get()
        {
            t.unpark();
        }
    }
    job(0);
    for part in helpers + 1..parts {
        job(part);
    }
    for slot in pool.slots.iter().take(helpers) {
        while slot.state.load(Ordering::Acquire) != DONE {
            std::hint::spin_loop();
        }
        // SAFETY: DONE: the worker no longer reads the slot.
        unsafe { *slot.job.get() = (None, 0) };
        slot.state.store(IDLE, Ordering::Release);
        assert!(
            !slot.panicked.load(Ordering::Relaxed),
            "a decode worker's part of the job panicked"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_runs_once_from_any_number_of_callers() {
        let callers: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for parts in [0usize, 1, 2, 3, 7] {
                        let counts: Vec<AtomicUsize> =
                            (0..parts).map(|_| AtomicUsize::new(0)).collect();
                        run(parts, &|i| {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        // After the workers have parked, a job still runs.
        std::thread::sleep(SPIN * 3);
        let sum = AtomicUsize::new(0);
        run(2, &|i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3);
    }
}
