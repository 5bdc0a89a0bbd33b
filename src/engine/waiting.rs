//! How a call waits when a look at its FIFOs moved nothing: spin, then yield, then sleep
//! on the rank's bell, with the call's deadline and its peers' failures checked before
//! each sleep (see the [engine](super)'s documentation).

use std::time::{Duration, Instant};

use crate::error::{ABORTED_BY_USER, CallInfo, Error, Result};
use crate::transport::Connections;
use crate::transport::bell::Closed;

/// Sweeps without progress spent spinning, then yielding, before sleeping, when every
/// rank of this machine can have a core of its own: a reply from another core arrives
/// within the spin.
const DEDICATED_WAIT: (u32, u32) = (64, 16);
/// With a core of its own, a rank keeps spinning at least this long after its last
/// progress before it sleeps: peers that spend a few tens of microseconds between calls
/// (Python, torch's dispatch) would otherwise find it asleep at every call, and a
/// futex wake-up on a VM costs more than the wait (measured: 2 ranks under
/// `torch.distributed`, 8-byte all-reduce, 71 us -> 32-56 us).
const DEDICATED_SPIN: Duration = Duration::from_micros(100);
/// The same when ranks outnumber cores: spinning would only keep the rank being waited
/// for off the core, so yield at once, and for longer (measured on 2 cores, 8-byte
/// all-reduce: 4 ranks 8.1 -> 5.5 us, 8 ranks 26 -> 20 us).
const OVERSUBSCRIBED_WAIT: (u32, u32) = (0, 64);
/// The look without progress at which a wait first reads the clock (when it spins that
/// long).
const FIRST_CLOCK_READ: u32 = 8;
/// Longest single sleep (a sleeping rank wakes at least this often to check on peers).
const MAX_SLEEP: Duration = Duration::from_millis(50);
/// After a timeout, how long a rank watches the peers on the chain of waits for one that
/// does not wake (several [`MAX_SLEEP`]s, so a waiting peer surely wakes in it).
const STALL_WATCH: Duration = Duration::from_millis(200);
/// How often a waiting rank asks the kernel whether the processes it waits on exist.
const PROCESS_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// What a waiting call knows about its own progress.
pub(super) trait Look {
    /// The peers the call waits on now (a peer that failed among them ends the call).
    fn blocked_on(&mut self, conns: &mut Connections) -> Vec<usize>;
    /// Looks at the FIFOs once more, moving what can move; returns whether anything did
    /// or can.
    fn look(&mut self, conns: &mut Connections) -> Result<bool>;
}

/// The waiting state of one call: when it first waited (the start of its deadline) and
/// how long it has gone without progress.
#[derive(Default)]
pub(super) struct Waiting {
    start: Option<Instant>,
    idle_looks: u32,
    idle_since: Option<Instant>,
    last_process_check: Option<Instant>,
    /// Whether the call told its bell whom it waits on (cleared at its end).
    announced: bool,
}

impl Waiting {
    /// The call moved something: the next wait starts spinning again.
    #[inline]
    pub(super) fn progressed(&mut self) {
        self.idle_looks = 0;
    }

    /// After a look that moved nothing: spins, yields, or sleeps on the bell until a
    /// peer rings it, then returns for the caller to look again. Fails when the call was
    /// aborted, a peer it waits on failed, or its deadline passed.
    pub(super) fn idle(
        &mut self,
        conns: &mut Connections,
        call: &CallInfo,
        look: &mut impl Look,
    ) -> Result<()> {
        self.idle_looks += 1;
        let (spin_looks, yield_looks) = if conns.oversubscribed() {
            OVERSUBSCRIBED_WAIT
        } else {
            DEDICATED_WAIT
        };
        // The clock is first read after a few spins: a small call's reply usually comes
        // within them, and on a VM the read costs a good part of the wait.
        if self.idle_looks == FIRST_CLOCK_READ.min(spin_looks + 1) {
            let now = Instant::now();
            self.idle_since = Some(now);
            self.start.get_or_insert(now);
            self.last_process_check.get_or_insert(now);
        }
        // Past the first spins, the clock is read every 16th look only.
        if self.idle_looks <= spin_looks
            || (spin_looks > 0
                && (!self.idle_looks.is_multiple_of(16)
                    || self
                        .idle_since
                        .is_some_and(|t| t.elapsed() < DEDICATED_SPIN)))
        {
            std::hint::spin_loop();
            return Ok(());
        }
        if self.idle_looks <= spin_looks + yield_looks {
            std::thread::yield_now();
            return Ok(());
        }
        self.sleep(conns, call, look)
    }

    /// Sleep: announce it, check on the peers, look at the FIFOs once more, then wait
    /// for a ring. The peers' states are read before that last look: a peer commits its
    /// last slots before it closes, so whatever it sent before closing is seen by the
    /// look, and a closed peer is only an error if nothing is left to take.
    fn sleep(
        &mut self,
        conns: &mut Connections,
        call: &CallInfo,
        look: &mut impl Look,
    ) -> Result<()> {
        let seq = conns.bell().prepare_sleep();
        let mut waiting_on = look.blocked_on(conns);
        waiting_on.sort_unstable();
        waiting_on.dedup();
        let now = Instant::now();
        let check_process = self
            .last_process_check
            .is_none_or(|t| now.duration_since(t) >= PROCESS_CHECK_INTERVAL);
        if check_process {
            self.last_process_check = Some(now);
        }
        let failure = conns.peer_failure(&waiting_on, check_process);
        let progressed = match look.look(conns) {
            Ok(p) => p,
            Err(e) => {
                conns.bell().cancel_sleep();
                return Err(e);
            }
        };
        if progressed {
            conns.bell().cancel_sleep();
            self.idle_looks = 0;
            return Ok(());
        }
        if conns.bell().closed() != Closed::Open {
            // Aborted from another thread (see `Connections::abort_handle`).
            conns.bell().cancel_sleep();
            return Err(Error::Aborted {
                rank: conns.rank(),
                reason: ABORTED_BY_USER.into(),
            });
        }
        if let Some(failure) = failure {
            conns.bell().cancel_sleep();
            return Err(call.peer_failed(conns.rank(), failure));
        }
        let start = self.start.unwrap_or(now);
        let deadline = start + call.timeout;
        if now >= deadline {
            conns.bell().cancel_sleep();
            let stalled = conns
                .stalled_rank(&waiting_on, STALL_WATCH)
                .filter(|&s| Some(&s) != waiting_on.first());
            // While this rank watched, a peer may have found and named the culprit.
            if stalled.is_none()
                && let Some(failure) = conns.peer_failure(&waiting_on, true)
            {
                return Err(call.peer_failed(conns.rank(), failure));
            }
            return Err(call.timed_out(
                conns.rank(),
                waiting_on,
                stalled,
                now.duration_since(start),
            ));
        }
        let nap = MAX_SLEEP.min(deadline - now).min(PROCESS_CHECK_INTERVAL);
        conns.bell().set_waiting_on(&waiting_on);
        self.announced = true;
        // Asleep, the engine cannot read TCP links in line: their proxies do, and ring.
        conns.stop_reading();
        conns.bell().sleep(seq, nap);
        Ok(())
    }

    /// The call is over: the TCP receive proxies read the links, and after a call that
    /// `succeeded` this rank waits on no one.
    ///
    /// A failed call keeps its list until the communicator is closed (every failure
    /// closes it, naming the culprit): a peer that timed out too may be following the
    /// chain of waits through this rank (`Connections::stalled_rank`) in between, and an
    /// empty list there would end the chain one rank short of the one that stalled it.
    pub(super) fn finish(self, conns: &mut Connections, succeeded: bool) {
        conns.stop_reading();
        if self.announced && succeeded {
            conns.bell().set_waiting_on(&[]);
        }
    }
}
