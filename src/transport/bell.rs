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
//! that stalls it ([`super::Connections::stalled_rank`]).

use std::sync::atomic::{AtomicU32, Ordering, fence};
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
}

// Offsets of the words, one cache line apart.
const SEQ: usize = 0;
const SLEEPING: usize = 64;
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

impl Bell {
    /// Wraps a segment of at least [`BELL_BYTES`] bytes (zeroed by its creator).
    pub fn new(seg: Segment) -> Self {
        assert!(seg.len() >= BELL_BYTES);
        Bell { seg }
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
        // Pairs with the fence in `prepare_sleep`: either the owner sees our update to
        // the FIFO, or we see its `sleeping` flag.
        fence(Ordering::SeqCst);
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
        let name = format!("ferroccl-test-bell-{}", std::process::id());
        let owner = Bell::new(Segment::create(SegmentKind::InProcess, &name, BELL_BYTES).unwrap());
        let peer = Bell::new(Segment::open(SegmentKind::InProcess, &name, BELL_BYTES).unwrap());
        Segment::unlink(SegmentKind::InProcess, &name);
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
}
