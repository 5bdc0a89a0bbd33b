//! A rank's doorbell: the one word it sleeps on, and the flags that tell peers it has
//! gone away.
//!
//! Every rank owns one small control block in shared memory, mapped by all its local
//! peers. A rank that cannot make progress sleeps on its `seq` word with `futex(2)`; a
//! peer that publishes a slot to it, or frees a slot it was waiting for, rings the bell
//! (bumps `seq` and wakes it) — but only when the rank said it is going to sleep, so the
//! busy path costs no system call. The `closed` and `cause` words let a rank that leaves
//! (destroy, abort, or failure) tell everyone waiting on it, and why. The `waiting_on`
//! and `wakes` words let a rank that timed out follow the chain of waits to the rank
//! that stalls it ([`super::Connections::stalled_rank`]). The `reading` word says
//! whether the rank may still read regions its peers published by reference in a call
//! (single copy), which a peer that fails the call waits out before it lets its caller
//! free them ([`super::single_copy`]).
//!
//! Ringing and going to sleep are a Dekker pair: the ringer publishes its slot, then
//! reads `sleeping`; the sleeper raises `sleeping`, then looks at its FIFOs once more.
//! Each side needs a full barrier between its store and its load, or both may miss
//! the other. The ringer rings after every slice, the sleeper sleeps rarely, so the
//! barrier is made asymmetric where Linux allows it: the ringer orders only the
//! compiler, and the sleeper makes every thread of every ferroccl process pass a full
//! barrier with `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)` before its last look
//! (the pattern of userspace RCU and folly's `asymmetricHeavyBarrier`). A ringer's
//! fence waits for its slot's store to leave the core, which is the cross-core
//! hand-off itself: measured, 2 ranks, 8 B all-reduce, 0.72 → 0.66 µs (far placement)
//! without it. Where `membarrier` is refused (old kernel, seccomp), the bell's
//! `heavy_sleeper` word stays 0 and ringers keep the fence.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering, compiler_fence, fence};
use std::time::Duration;

use super::segment::Segment;

/// Bytes of a control block (one page, so nothing else shares its cache lines).
pub const BELL_BYTES: usize = 4096;

/// Why a rank closed its communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Still open.
    Open,
    /// Destroyed or aborted by its owner.
    ByOwner,
    /// Aborted because it saw rank `0` fail first.
    PeerFailed(usize),
}

/// A view of one rank's control block.
pub struct Bell {
    seg: Segment,
    /// Whether [`Bell::ring`] may skip its fence: the bell's sleeper issues the heavy
    /// barrier, and this process is registered to receive it.
    light_ring: bool,
}

// Offsets of the words, one cache line apart.
const SEQ: usize = 0;
const SLEEPING: usize = 64;
/// 1 when the bell's sleeper issues the heavy barrier before its last look (written by
/// [`Bell::create`], before any peer opens the bell). In `sleeping`'s line, which every
/// ring reads anyway.
const HEAVY_SLEEPER: usize = SLEEPING + 4;
const CLOSED: usize = 128;
const CAUSE: usize = 192;
/// How many peers the owner waits on, then their ranks (at most [`MAX_WAITING_ON`]),
/// set before each sleep in a call.
const WAITING_ON: usize = 256;
/// Most peers a bell lists as waited on.
pub const MAX_WAITING_ON: usize = 8;
/// Bumped every time the owner wakes from a sleep: a waiting rank whose count stands
/// still is not running (stopped, or busy outside the wait).
const WAKES: usize = 320;
/// While the owner may read regions its peers published by reference in a single-copy
/// call: that call's tag ([`call_tag`]); 0 otherwise.
const READING: usize = 384;

/// The word [`Bell::start_reading`] stores for call `seq` (never 0: two calls 2³²
/// apart share a tag, which only makes a failed peer wait for the later one).
fn call_tag(seq: u64) -> u32 {
    (seq as u32).wrapping_add(1).max(1)
}

impl Bell {
    /// Formats a new, zeroed segment of at least [`BELL_BYTES`] bytes as the bell this
    /// process's ranks (or proxies) sleep on.
    pub fn create(seg: Segment) -> Self {
        let mut bell = Bell::new(seg);
        if heavy_barrier_registered() {
            bell.word(HEAVY_SLEEPER).store(1, Ordering::SeqCst);
            bell.light_ring = true;
        }
        bell
    }

    /// Wraps a segment of at least [`BELL_BYTES`] bytes that [`Bell::create`] formatted.
    pub fn new(seg: Segment) -> Self {
        assert!(seg.len() >= BELL_BYTES);
        let mut bell = Bell {
            seg,
            light_ring: false,
        };
        bell.light_ring = bell.heavy_sleeper() && heavy_barrier_registered();
        bell
    }

    /// Whether the bell's sleeper issues the heavy barrier before its last look.
    fn heavy_sleeper(&self) -> bool {
        self.word(HEAVY_SLEEPER).load(Ordering::SeqCst) != 0
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: the segment is at least BELL_BYTES long and page-aligned, so the offset
        // is in bounds and 4-byte aligned; the memory lives as long as `self.seg` and is
        // only ever accessed atomically.
        unsafe { &*(self.seg.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// Called by a peer after it made progress possible for this bell's owner: wakes
    /// the owner if it is asleep or about to sleep.
    pub fn ring(&self) {
        // Pairs with the barrier in `prepare_sleep`: either the owner sees our update to
        // the FIFO, or we see its `sleeping` flag. With a heavy sleeper, its membarrier
        // puts this thread's store and load on one side of a full barrier, so only the
        // compiler must keep them in order here.
        if self.light_ring {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
        if self.word(SLEEPING).load(Ordering::Relaxed) != 0 {
            self.word(SEQ).fetch_add(1, Ordering::SeqCst);
            futex_wake(self.word(SEQ));
        }
    }

    /// Wakes the owner whether or not it said it would sleep (for rare events such as a
    /// peer closing, where a system call does not matter).
    pub fn ring_always(&self) {
        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
        futex_wake(self.word(SEQ));
    }

    /// The owner announces it is about to sleep; returns the value to sleep on. The
    /// owner must look at its FIFOs once more after this and before [`Bell::sleep`].
    pub fn prepare_sleep(&self) -> u32 {
        let seq = self.word(SEQ).load(Ordering::SeqCst);
        self.word(SLEEPING).fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.heavy_sleeper() {
            heavy_barrier();
        }
        seq
    }

    /// The owner sleeps until rung (or `timeout`), unless it was rung since `seq`.
    pub fn sleep(&self, seq: u32, timeout: Duration) {
        futex_wait(self.word(SEQ), seq, timeout);
        self.word(SLEEPING).fetch_sub(1, Ordering::Relaxed);
        self.word(WAKES).fetch_add(1, Ordering::Relaxed);
    }

    /// The owner records the peers it is about to wait on (the first
    /// [`MAX_WAITING_ON`]; none once its call ended).
    pub fn set_waiting_on(&self, peers: &[usize]) {
        let peers = &peers[..peers.len().min(MAX_WAITING_ON)];
        // Compared in place: every call ends by clearing the list, and most find it
        // clear already.
        let listed = self.word(WAITING_ON).load(Ordering::Relaxed) as usize;
        if listed == peers.len()
            && peers.iter().enumerate().all(|(i, &p)| {
                self.word(WAITING_ON + 4 * (i + 1)).load(Ordering::Relaxed) as usize == p
            })
        {
            return;
        }
        for (i, &p) in peers.iter().enumerate() {
            self.word(WAITING_ON + 4 * (i + 1))
                .store(p as u32, Ordering::Relaxed);
        }
        self.word(WAITING_ON)
            .store(peers.len() as u32, Ordering::Release);
    }

    /// The peers the owner last said it waits on (a peer reading it while the owner
    /// changes it may see a mix of the two lists: it is a diagnosis, not a protocol).
    pub fn waiting_on(&self) -> Vec<usize> {
        let n = (self.word(WAITING_ON).load(Ordering::Acquire) as usize).min(MAX_WAITING_ON);
        (1..=n)
            .map(|i| self.word(WAITING_ON + 4 * i).load(Ordering::Relaxed) as usize)
            .collect()
    }

    /// The owner shows it is running without sleeping (while it watches its peers).
    pub fn note_awake(&self) {
        self.word(WAKES).fetch_add(1, Ordering::Relaxed);
    }

    /// How many times the owner woke from a sleep (wraps).
    pub fn wakes(&self) -> u32 {
        self.word(WAKES).load(Ordering::Relaxed)
    }

    /// The owner may read, from now until [`Bell::stop_reading`], regions its peers
    /// publish in call `seq`. Sequentially consistent, as a peer's close: an owner that
    /// then reads a peer's open bell knows the peer will see this before it leaves.
    pub fn start_reading(&self, seq: u64) {
        self.word(READING).store(call_tag(seq), Ordering::SeqCst);
    }

    /// The owner reads no region of its peers any more (its call ended, or failed).
    pub fn stop_reading(&self) {
        self.word(READING).store(0, Ordering::SeqCst);
    }

    /// Whether the owner may still read regions published in call `seq`.
    pub fn reading(&self, seq: u64) -> bool {
        self.word(READING).load(Ordering::SeqCst) == call_tag(seq)
    }

    /// The owner decided not to sleep after [`Bell::prepare_sleep`].
    pub fn cancel_sleep(&self) {
        self.word(SLEEPING).fetch_sub(1, Ordering::Relaxed);
    }

    /// Marks the owner's communicator closed, then wakes the owner (if it sleeps) so
    /// that it notices.
    pub fn close(&self, why: Closed) {
        let cause = match why {
            Closed::Open => return,
            Closed::ByOwner => 0,
            Closed::PeerFailed(rank) => rank as u32 + 1,
        };
        self.word(CAUSE).store(cause, Ordering::SeqCst);
        self.word(CLOSED).store(1, Ordering::SeqCst);
        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
        futex_wake(self.word(SEQ));
    }

    /// Whether (and why) the owner closed its communicator.
    pub fn closed(&self) -> Closed {
        if self.word(CLOSED).load(Ordering::SeqCst) == 0 {
            return Closed::Open;
        }
        match self.word(CAUSE).load(Ordering::SeqCst) {
            0 => Closed::ByOwner,
            r => Closed::PeerFailed(r as usize - 1),
        }
    }
}

/// `membarrier(2)` commands (linux/membarrier.h).
const MEMBARRIER_CMD_QUERY: libc::c_long = 0;
const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_long = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_long = 1 << 2;

/// Whether this process is registered for the heavy barrier (registers it on the first
/// call; a process forked afterwards registers itself anew).
fn heavy_barrier_registered() -> bool {
    // The process that registered, and whether it could.
    static REGISTERED: Mutex<Option<(u32, bool)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut state = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    match *state {
        Some((registered_pid, ok)) if registered_pid == pid => ok,
        _ => {
            let ok = register_heavy_barrier();
            *state = Some((pid, ok));
            ok
        }
    }
}

/// Asks the kernel for `MEMBARRIER_CMD_GLOBAL_EXPEDITED` on this process.
fn register_heavy_barrier() -> bool {
    let membarrier = |cmd: libc::c_long| {
        // SAFETY: membarrier takes a command and two integer arguments (flags, cpu id)
        // and touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                cmd,
                0 as libc::c_long,
                0 as libc::c_long,
            )
        }
    };
    let supported = membarrier(MEMBARRIER_CMD_QUERY);
    let ok = supported >= 0
        && supported & MEMBARRIER_CMD_GLOBAL_EXPEDITED != 0
        && membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) == 0;
    if !ok {
        tracing::debug!(
            "membarrier(GLOBAL_EXPEDITED) unavailable ({}): every doorbell ring fences",
            std::io::Error::last_os_error()
        );
    }
    ok
}

/// A full memory barrier on every running thread of every registered process.
fn heavy_barrier() {
    // SAFETY: as in `register_heavy_barrier`. It cannot fail once registered; if it
    // did, a ringer could miss this sleep and wake it only at the end of its nap.
    let r = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_GLOBAL_EXPEDITED,
            0 as libc::c_long,
            0 as libc::c_long,
        )
    };
    debug_assert_eq!(r, 0, "membarrier(GLOBAL_EXPEDITED) after registering");
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned 32-bit word that outlives the call, with a
    // valid relative timeout. Not FUTEX_PRIVATE: the word may be shared across processes.
    // Spurious wake-ups, EAGAIN (value changed) and EINTR are all fine for the caller,
    // which re-checks its FIFOs.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned 32-bit word; wakes every waiter.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::SegmentKind;
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_sleeper_is_woken_by_a_ring_and_sees_closure() {
        let (owner, peer) = bell_pair("close", true);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            peer.ring();
            peer
        });
        let start = Instant::now();
        let seq = owner.prepare_sleep();
        owner.sleep(seq, Duration::from_secs(10));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "not woken by the ring"
        );
        let peer = t.join().unwrap();
        assert_eq!(peer.closed(), Closed::Open);
        owner.close(Closed::PeerFailed(3));
        assert_eq!(peer.closed(), Closed::PeerFailed(3));
        // A ring with nobody sleeping does not wake the next sleep early.
        peer.ring();
        let start = Instant::now();
        let seq = owner.prepare_sleep();
        owner.sleep(seq, Duration::from_millis(100));
        assert!(start.elapsed() >= Duration::from_millis(90));
    }

    /// A bell's owner view and a peer's view of it, in process memory; `heavy`: made
    /// by [`Bell::create`], else as in a process the kernel refuses `membarrier` (the
    /// sleeper issues none, its ringers fence).
    fn bell_pair(tag: &str, heavy: bool) -> (Bell, Bell) {
        let name = format!("ferroccl-test-bell-{tag}-{heavy}-{}", std::process::id());
        let seg = Segment::create(SegmentKind::InProcess, &name, BELL_BYTES).unwrap();
        let owner = if heavy {
            Bell::create(seg)
        } else {
            Bell::new(seg)
        };
        let peer = Bell::new(Segment::open(SegmentKind::InProcess, &name, BELL_BYTES).unwrap());
        Segment::unlink(SegmentKind::InProcess, &name);
        (owner, peer)
    }

    /// Two threads pass a turn back and forth 10 000 times, each sleeping on its bell at
    /// every wait (never spinning), so every hand-off runs the ring/sleep race. A lost
    /// wake-up shows as a wait that lasts the whole nap. Run with light rings (the
    /// sleeper's membarrier, where this kernel has it) and with the fenced rings and
    /// plain sleeps of a process that has no membarrier. The race a
    /// missing barrier opens is nanoseconds wide: this catches a ring that does not
    /// wake, or a sleeper that sleeps through one, not every missing barrier (with the
    /// membarrier taken out it still passed 3 runs of 50 000 rounds).
    #[test]
    fn no_wake_up_is_lost_between_ringing_and_sleeping() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU64};
        const ROUNDS: u64 = 10_000;
        // Long enough that no busy machine stalls a thread for as long (a lost wake-up
        // waits exactly this); the first such wait ends the game.
        const NAP: Duration = Duration::from_secs(10);
        for light in [true, false] {
            let ((own_a, ring_a), (own_b, ring_b)) = (bell_pair("a", light), bell_pair("b", light));
            assert_eq!(ring_a.light_ring, light && heavy_barrier_registered());
            let turn = Arc::new(AtomicU64::new(0));
            let over = Arc::new(AtomicBool::new(false));
            // Player `me` moves when the turn's parity is `me`, then rings the other;
            // returns the first wait that lasted its whole nap, if any.
            let play = move |me: u64,
                             own: Bell,
                             other: Bell,
                             turn: Arc<AtomicU64>,
                             over: Arc<AtomicBool>| {
                for _ in 0..ROUNDS {
                    let start = Instant::now();
                    while turn.load(Ordering::Relaxed) % 2 != me {
                        if over.load(Ordering::Relaxed) {
                            return None;
                        }
                        let seq = own.prepare_sleep();
                        if turn.load(Ordering::Relaxed) % 2 == me {
                            own.cancel_sleep();
                            break;
                        }
                        own.sleep(seq, NAP);
                    }
                    if start.elapsed() >= NAP {
                        over.store(true, Ordering::Relaxed);
                        other.ring_always();
                        return Some(start.elapsed());
                    }
                    // A plain store, as a FIFO publishes a slot (a read-modify-write
                    // would fence by itself on x86 and hide a missing barrier).
                    let next = turn.load(Ordering::Relaxed) + 1;
                    turn.store(next, Ordering::Release);
                    other.ring();
                }
                None
            };
            let t = {
                let (turn, over) = (turn.clone(), over.clone());
                std::thread::spawn(move || play(1, own_b, ring_a, turn, over))
            };
            let lost_a = play(0, own_a, ring_b, turn.clone(), over);
            let lost_b = t.join().unwrap();
            if let Some(waited) = lost_a.or(lost_b) {
                panic!(
                    "light rings {light}: a wait lasted its whole nap ({waited:?}): a ring was lost"
                );
            }
            assert_eq!(turn.load(Ordering::Relaxed), 2 * ROUNDS);
        }
    }
}
