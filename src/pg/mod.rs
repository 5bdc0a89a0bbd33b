//! The layer PyTorch users know: a [`ProcessGroup`] whose collectives return a [`Work`]
//! handle at once and run in order on the group's progress thread (so computation can
//! overlap communication), sub-groups and [`DeviceMesh`], a flight recorder of recent
//! calls, a watchdog that turns hangs into diagnoses, and an optional desync check.
//!
//! - **Work**: `wait()`, `wait_timeout(d)`, `is_completed()`, `is_success()`,
//!   `exception()`.
//! - **Watchdog**: a thread per group. A call running longer than the group's timeout
//!   makes it dump the [flight recorder](recorder) (to `FERROCCL_FR_DUMP_DIR`, default
//!   the system temp directory, one file per rank, and the log), ask every rank through
//!   the store to dump theirs, fail the call's `Work` with an error naming the ranks that
//!   had not reached that sequence number, and abort the communicator. Every rank's
//!   watchdog publishes how far its rank has got, so even a rank that stopped calling
//!   collectives is named, and dumps.
//! - **Desync check** (`FERROCCL_DESYNC_DEBUG=1`): before each collective every rank
//!   publishes what it is about to call, and a mismatch is an error naming the ranks
//!   and both calls, not a hang.

pub mod mesh;
pub mod recorder;
mod watchdog;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use mesh::DeviceMesh;
use recorder::{Entry, FlightRecorder};

use crate::comm::{CommConfig, Communicator, RawCall};
use crate::engine::progress::Pending;
use crate::error::{Error, Result};
use crate::store::{PrefixStore, Store};
use crate::types::{DataType, Element, ReduceOp};

/// Settings of a process group.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// A call running longer than this is a hang: the watchdog steps in
    /// (`FERROCCL_PG_TIMEOUT`, seconds; default 600).
    pub timeout: Duration,
    /// Check before each collective that every rank calls the same one
    /// (`FERROCCL_DESYNC_DEBUG=1`).
    pub desync_debug: bool,
    /// Calls the flight recorder keeps (`FERROCCL_FR_ENTRIES`; default 2000).
    pub recorder_entries: usize,
    /// Where dumps go (`FERROCCL_FR_DUMP_DIR`; default the system temp directory).
    pub dump_dir: std::path::PathBuf,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            timeout: Duration::from_secs(600),
            desync_debug: false,
            recorder_entries: 2000,
            dump_dir: std::env::temp_dir(),
        }
    }
}

impl PgOptions {
    /// Defaults with the environment variables applied.
    pub fn from_env() -> Result<Self> {
        let mut o = PgOptions::default();
        let number = |var: &str| crate::env::env_number(&[var]);
        if let Some(v) = number("FERROCCL_PG_TIMEOUT")? {
            o.timeout = Duration::try_from_secs_f64(v).map_err(|_| Error::Env {
                var: "FERROCCL_PG_TIMEOUT".into(),
                detail: format!("{v} seconds is too long"),
            })?;
        }
        if let Some(v) = number("FERROCCL_FR_ENTRIES")? {
            o.recorder_entries = v as usize;
        }
        o.desync_debug = std::env::var("FERROCCL_DESYNC_DEBUG")
            .is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"));
        if let Some(d) = std::env::var_os("FERROCCL_FR_DUMP_DIR") {
            o.dump_dir = d.into();
        }
        Ok(o)
    }
}

/// What a group shares with its watchdog and its calls.
struct Inner {
    comm: Arc<Communicator>,
    name: String,
    store: Arc<dyn Store>,
    options: PgOptions,
    /// Sequence number of the next collective (the same on every rank of the group).
    seq: AtomicU64,
    /// Sequence number of the next send or receive (these pair up between two ranks
    /// only, so they are numbered apart and not desync-checked).
    p2p_seq: AtomicU64,
    recorder: FlightRecorder,
    /// Sub-groups made so far (names them).
    subgroups: AtomicU64,
    stop: AtomicBool,
}

/// A group of ranks running collectives asynchronously, in order.
///
/// # Example
///
/// Two ranks as threads, each with a group over its communicator: an asynchronous
/// all-reduce returns a [`Work`] whose `wait` gives the result.
///
/// ```
/// use ferroccl::pg::{PgOptions, ProcessGroup};
/// use ferroccl::{Communicator, ReduceOp};
///
/// let comms = Communicator::init_all(2)?;
/// std::thread::scope(|s| {
///     for comm in comms {
///         s.spawn(move || {
///             let rank = comm.rank() as f32;
///             let pg = ProcessGroup::from_communicator(comm, "default", PgOptions::default())
///                 .unwrap();
///             let work = pg.all_reduce(vec![rank + 1.0; 4], ReduceOp::Sum).unwrap();
///             assert_eq!(work.wait().unwrap(), vec![3.0; 4]);
///         });
///     }
/// });
/// # Ok::<(), ferroccl::Error>(())
/// ```
pub struct ProcessGroup {
    inner: Arc<Inner>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.name)
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

/// The handle of an asynchronous collective: its result (the buffer, handed back) once
/// it has run.
pub struct Work<R> {
    pending: Option<Pending<R>>,
    done: Option<Result<R>>,
    entry: Arc<Entry>,
    rank: usize,
}

impl<R> Work<R> {
    fn settle(&mut self, r: Result<R>) {
        self.done = Some(verdict(&self.entry, self.rank, r));
    }

    fn poll(&mut self, wait: Duration) {
        if let Some(p) = self.pending.take() {
            match p.wait_timeout(wait) {
                Ok(r) => self.settle(r),
                Err(p) => self.pending = Some(p),
            }
        }
    }

    /// Whether the call has finished (successfully or not).
    pub fn is_completed(&mut self) -> bool {
        self.poll(Duration::ZERO);
        self.done.is_some()
    }

    /// Whether the call finished successfully (false while it runs).
    pub fn is_success(&mut self) -> bool {
        self.poll(Duration::ZERO);
        matches!(self.done, Some(Ok(_)))
    }

    /// The error the call failed with, if it has.
    pub fn exception(&mut self) -> Option<String> {
        self.poll(Duration::ZERO);
        match &self.done {
            Some(Err(e)) => Some(e.to_string()),
            _ => None,
        }
    }

    /// Waits for the call; its result.
    pub fn wait(mut self) -> Result<R> {
        if let Some(p) = self.pending.take() {
            let r = p.wait();
            self.settle(r);
        }
        self.done.take().expect("settled above")
    }

    /// Waits at most `timeout`: `Ok(result)` if the call finished, `Err(self)` if it
    /// is still running.
    // The handle itself comes back in `Err`, as with `Pending::wait_timeout`; boxing it
    // would cost an allocation per call for a path that is rarely taken.
    #[allow(clippy::result_large_err)]
    pub fn wait_timeout(mut self, timeout: Duration) -> std::result::Result<Result<R>, Self> {
        self.poll(timeout);
        match self.done.take() {
            Some(r) => Ok(r),
            None => Err(self),
        }
    }

    /// The call's sequence number in its group.
    pub fn seq(&self) -> u64 {
        self.entry.seq
    }
}

/// A call's outcome as reported: a call the watchdog gave up on reports the watchdog's
/// diagnosis, not the abort that ended it.
fn verdict<R>(entry: &Entry, rank: usize, r: Result<R>) -> Result<R> {
    match (r, entry.watchdog_error(rank)) {
        (Err(_), Some(e)) => Err(e),
        (r, _) => r,
    }
}

/// Runs `call`, recording its start and end in `entry`.
fn recorded<R>(entry: &Entry, call: impl FnOnce() -> Result<R>) -> Result<R> {
    entry.start();
    let r = call();
    entry.finish(r.is_ok());
    r
}

/// What runs around a raw call, on the thread that runs it (see
/// [`ProcessGroup::issue_raw`]).
#[derive(Default)]
pub struct Around {
    /// Runs right before the call (staging copies into memory the call reads).
    pub before: Option<Box<dyn FnOnce() + Send>>,
    /// Runs right after it with its outcome, before its [`Work`] completes (copies out
    /// of staging memory, completing a future) — with the watchdog's diagnosis in place
    /// of the abort it caused.
    pub after: Option<AfterCall>,
}

/// The hook [`Around::after`] holds: called with the call's outcome.
pub type AfterCall = Box<dyn FnOnce(std::result::Result<(), &Error>) + Send>;

/// Whether a call named `op` is point-to-point: it pairs two ranks only, so it is
/// numbered apart from the collectives and not desync-checked.
pub(crate) fn is_p2p(op: &str) -> bool {
    matches!(op, "send" | "recv" | "send_recv")
}

/// What a collective call is, for the recorder and the desync check.
struct Call {
    op: &'static str,
    dtype: String,
    count: usize,
    peer: Option<usize>,
    reduce: Option<ReduceOp>,
}

impl Call {
    /// A call of `op` on `count` elements of `T`.
    fn of<T: Element>(
        op: &'static str,
        count: usize,
        peer: Option<usize>,
        reduce: Option<ReduceOp>,
    ) -> Self {
        Call {
            op,
            dtype: T::DTYPE.name().into(),
            count,
            peer,
            reduce,
        }
    }

    /// What `calls`, issued together as `op`, are: the first call's type, root or peer
    /// and reduction, and the elements of all of them.
    fn of_raw(op: &'static str, calls: &[RawCall]) -> Self {
        let first = calls.first();
        Call {
            op,
            dtype: first.map_or(DataType::Uint8, |c| c.dtype).name().into(),
            count: calls.iter().map(|c| c.count).sum(),
            peer: first.and_then(|c| c.collective.root()),
            reduce: first.filter(|c| c.collective.is_reducing()).map(|c| c.op),
        }
    }

    fn signature(&self) -> String {
        let mut s = format!("{}(count {}, {}", self.op, self.count, self.dtype);
        if let Some(op) = self.reduce {
            s += &format!(", {}", op.name());
        }
        if let Some(p) = self.peer {
            s += &format!(", root {p}");
        }
        s + ")"
    }
}

impl ProcessGroup {
    /// The default group over a rendezvous store (`init_process_group`): `rank` of
    /// `size`, settings from the environment.
    pub fn init(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        options: PgOptions,
    ) -> Result<Self> {
        Self::init_named(store, rank, size, "default", options)
    }

    /// Like [`ProcessGroup::init`], for a group called `name` (which names its
    /// flight-recorder dumps; a torch backend passes each group's name).
    pub fn init_named(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        name: &str,
        options: PgOptions,
    ) -> Result<Self> {
        let config = comm_config(&options)?;
        let boot = crate::bootstrap::Bootstrap::new(
            Arc::new(PrefixStore::new("pg/default", store)),
            rank,
            size,
            &config.bootstrap,
        )?;
        Self::from_communicator(Communicator::from_bootstrap(boot, config)?, name, options)
    }

    /// The default group from the launcher's environment (`env://`: ferrorun, torchrun,
    /// Slurm, Open MPI).
    pub fn init_from_env(options: PgOptions) -> Result<Self> {
        let comm = Communicator::from_env_with(comm_config(&options)?)?;
        Self::from_communicator(comm, "default", options)
    }

    /// A group over an existing communicator (for example one of
    /// [`Communicator::init_all`]'s).
    pub fn from_communicator(comm: Communicator, name: &str, options: PgOptions) -> Result<Self> {
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("pg/{name}"), comm.store()));
        let inner = Arc::new(Inner {
            comm: Arc::new(comm),
            name: name.to_string(),
            store,
            recorder: FlightRecorder::new(options.recorder_entries),
            options,
            seq: AtomicU64::new(0),
            p2p_seq: AtomicU64::new(0),
            subgroups: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let handle = watchdog::start(inner.clone())?;
        Ok(ProcessGroup {
            inner,
            watchdog: Mutex::new(Some(handle)),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.comm.size()
    }

    /// The group's name (`default`, or `default/g0`, … for sub-groups).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Sequence number of the next collective (the same on every rank).
    pub fn sequence_number(&self) -> u64 {
        self.inner.seq.load(Ordering::SeqCst)
    }

    /// The flight recorder.
    pub fn recorder(&self) -> &FlightRecorder {
        &self.inner.recorder
    }

    /// The communicator underneath.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.inner.comm
    }

    /// Splits the group (collective over it): ranks with the same `color` form a new
    /// group ordered by `key`; `None` takes part without joining one.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<ProcessGroup>> {
        let n = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let name = format!("{}/g{n}", self.inner.name);
        match self.inner.comm.split(color, key)? {
            Some(c) => Self::from_communicator(c, &name, self.inner.options.clone()).map(Some),
            None => Ok(None),
        }
    }

    /// A group of `ranks` (`new_group`): collective over this group; ranks not listed
    /// get `None`. Ranks are numbered in the order listed.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() || std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid(format!(
                    "new_group: {ranks:?} must list distinct ranks below {}",
                    self.size()
                )));
            }
        }
        let position = ranks.iter().position(|&r| r == self.rank());
        self.split(position.map(|_| 0), position.unwrap_or(0) as i32)
    }

    /// Numbers a call, checks it against the other ranks when the desync check is on,
    /// and records it.
    fn schedule(&self, call: Call) -> Result<Arc<Entry>> {
        let p2p = is_p2p(call.op);
        let seq = if p2p {
            self.inner.p2p_seq.fetch_add(1, Ordering::SeqCst)
        } else {
            self.inner.seq.fetch_add(1, Ordering::SeqCst)
        };
        if self.inner.options.desync_debug && !p2p {
            watchdog::check_desync(&self.inner, seq, &call.signature())?;
        }
        Ok(self
            .inner
            .recorder
            .schedule(seq, call.op, call.dtype, call.count, call.peer))
    }

    /// Issues a collective on the progress thread.
    fn issue<R: Send + 'static>(
        &self,
        call: Call,
        run: impl FnOnce(&Communicator) -> Result<R> + Send + 'static,
    ) -> Result<Work<R>> {
        let entry = self.schedule(call)?;
        self.submit(entry, run)
    }

    /// Runs a scheduled call on the progress thread.
    fn submit<R: Send + 'static>(
        &self,
        entry: Arc<Entry>,
        run: impl FnOnce(&Communicator) -> Result<R> + Send + 'static,
    ) -> Result<Work<R>> {
        let e = entry.clone();
        let pending = self.inner.comm.submit(move |c| recorded(&e, || run(c)))?;
        Ok(Work {
            pending: Some(pending),
            done: None,
            entry,
            rank: self.rank(),
        })
    }

    /// Runs `calls` — one operation, or several issued together as one group (a
    /// coalesced window, a batch of sends and receives) — over memory this layer does
    /// not own, such as a Python tensor's. With `blocking` they run in the caller's
    /// thread (no hand-off) and the returned [`Work`] has completed; otherwise they run
    /// on the progress thread in issue order. `op` names them in the flight recorder and
    /// the desync check (`send`, `recv` and `send_recv` count as point-to-point).
    ///
    /// `keep` (what owns the memory) is held until the calls have run and handed back
    /// by [`Work::wait`]; `around` runs right before and after them, on the thread that
    /// runs them.
    ///
    /// # Safety
    /// Every call's buffers must hold the elements it reads and writes, stay valid and
    /// be touched by nobody else until the calls have run (the `Work` completes), and
    /// overlap only as an in-place call defines (see [`Communicator::group_raw`]).
    pub unsafe fn issue_raw<K: Send + 'static>(
        &self,
        op: &'static str,
        calls: Vec<RawCall>,
        keep: K,
        blocking: bool,
        around: Around,
    ) -> Result<Work<K>> {
        let entry = self.schedule(Call::of_raw(op, &calls))?;
        let rank = self.rank();
        let run = move |comm: &Communicator, entry: &Entry| -> Result<K> {
            if let Some(before) = around.before {
                before();
            }
            // SAFETY: forwarded from this function's contract.
            let r = verdict(entry, rank, unsafe { comm.group_raw(&calls) });
            if let Some(after) = around.after {
                after(r.as_ref().map(|_| ()));
            }
            r.map(|()| keep)
        };
        if blocking {
            let done = recorded(&entry, || run(&self.inner.comm, &entry));
            return Ok(Work {
                pending: None,
                done: Some(done),
                entry,
                rank,
            });
        }
        /// The calls' raw pointers, moved to the progress thread.
        struct Lent<F>(F);
        // SAFETY: the pointers inside are only used by the progress thread, while the
        // caller keeps the memory valid and untouched (this function's contract).
        unsafe impl<F> Send for Lent<F> {}
        let lent = Lent(run);
        let e = entry.clone();
        self.submit(entry, move |c| {
            let lent = lent;
            (lent.0)(c, &e)
        })
    }

    /// In-place all-reduce of `buf`, handed back by [`Work::wait`].
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        let call = Call::of::<T>("all_reduce", buf.len(), None, Some(op));
        self.issue(call, move |c| {
            c.all_reduce_in_place(&mut buf, op).map(|()| buf)
        })
    }

    /// In-place broadcast from `root`.
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        let call = Call::of::<T>("broadcast", buf.len(), Some(root), None);
        self.issue(call, move |c| {
            c.broadcast_in_place(&mut buf, root).map(|()| buf)
        })
    }

    /// In-place reduce to `root` (other ranks' buffers are left as they were).
    pub fn reduce<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        let call = Call::of::<T>("reduce", buf.len(), Some(root), Some(op));
        self.issue(call, move |c| {
            c.reduce_in_place(&mut buf, op, root).map(|()| buf)
        })
    }

    /// Every rank's `send`, concatenated by rank.
    pub fn all_gather<T: Element>(&self, send: Vec<T>) -> Result<Work<Vec<T>>> {
        let n = self.size();
        let call = Call::of::<T>("all_gather", send.len(), None, None);
        self.issue(call, move |c| {
            let mut out = send.clone();
            out.resize(
                send.len() * n,
                send.first().copied().unwrap_or_else(|| T::from_f64(0.0)),
            );
            c.all_gather(&send, &mut out).map(|()| out)
        })
    }

    /// Block `rank` of the reduction of every rank's `send` (`send.len()` must be a
    /// multiple of the group size).
    pub fn reduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        let n = self.size();
        if !send.len().is_multiple_of(n) {
            return Err(Error::invalid(format!(
                "reduce_scatter: {} elements do not split into {n} equal blocks",
                send.len()
            )));
        }
        let call = Call::of::<T>("reduce_scatter", send.len() / n, None, Some(op));
        self.issue(call, move |c| {
            let mut out = send[..send.len() / n].to_vec();
            c.reduce_scatter(&send, &mut out, op).map(|()| out)
        })
    }

    /// Block `j` of this rank's `send` goes to rank `j`; block `i` of the result came
    /// from rank `i`.
    pub fn all_to_all<T: Element>(&self, send: Vec<T>) -> Result<Work<Vec<T>>> {
        let n = self.size();
        if !send.len().is_multiple_of(n) {
            return Err(Error::invalid(format!(
                "all_to_all: {} elements do not split into {n} equal blocks",
                send.len()
            )));
        }
        let call = Call::of::<T>("all_to_all", send.len() / n, None, None);
        self.issue(call, move |c| {
            let mut out = send.clone();
            c.all_to_all(&send, &mut out).map(|()| out)
        })
    }

    /// Every rank's `send`, concatenated by rank, on `root` (other ranks get an empty
    /// vector).
    pub fn gather<T: Element>(&self, send: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        let (n, me) = (self.size(), self.rank());
        let call = Call::of::<T>("gather", send.len(), Some(root), None);
        self.issue(call, move |c| {
            let mut out = if me == root {
                send.repeat(n)
            } else {
                Vec::new()
            };
            c.gather(&send, &mut out, root).map(|()| out)
        })
    }

    /// Block `r` of `root`'s `send` (`count` elements each) to every rank `r`; other
    /// ranks' `send` is not read.
    pub fn scatter<T: Element>(
        &self,
        send: Vec<T>,
        count: usize,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        if self.rank() == root && send.len() != count * self.size() {
            return Err(Error::invalid(format!(
                "scatter: the root's {} elements are not {count} for each of {} ranks",
                send.len(),
                self.size()
            )));
        }
        let call = Call::of::<T>("scatter", count, Some(root), None);
        self.issue(call, move |c| {
            let mut out = vec![T::from_f64(0.0); count];
            c.scatter(&send, &mut out, root).map(|()| out)
        })
    }

    /// Sends `buf` to `peer` (handed back when sent).
    pub fn send<T: Element>(&self, buf: Vec<T>, peer: usize) -> Result<Work<Vec<T>>> {
        let call = Call::of::<T>("send", buf.len(), Some(peer), None);
        self.issue(call, move |c| c.send(&buf, peer).map(|()| buf))
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<T: Element>(&self, mut buf: Vec<T>, peer: usize) -> Result<Work<Vec<T>>> {
        let call = Call::of::<T>("recv", buf.len(), Some(peer), None);
        self.issue(call, move |c| c.recv(&mut buf, peer).map(|()| buf))
    }

    /// Waits until every rank of the group has called it.
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce(vec![0u8], ReduceOp::Sum)?
            .wait()
            .map(|_| ())
    }

    /// Aborts the group: running and later calls fail at once, and peers waiting on
    /// this rank fail naming it.
    pub fn abort(&self) {
        self.inner.comm.abort();
    }

    /// Finishes the calls issued so far, then releases the group; reports a failure
    /// the group had (other than an abort by its owner).
    pub fn destroy(self) -> Result<()> {
        // Wait for the calls while the watchdog still watches them.
        self.inner.comm.flush();
        self.shutdown_watchdog();
        let (rank, failure) = (self.rank(), self.inner.comm.failure());
        drop(self);
        match failure {
            Some(reason) if reason != crate::error::ABORTED_BY_USER => {
                Err(Error::Aborted { rank, reason })
            }
            _ => Ok(()),
        }
    }

    fn shutdown_watchdog(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let handle = crate::lock(&self.watchdog).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.shutdown_watchdog();
    }
}

/// The communicator settings of a group: from the environment, with the engine's own
/// deadline well past the watchdog's so the watchdog diagnoses hangs first.
fn comm_config(options: &PgOptions) -> Result<CommConfig> {
    let mut c = CommConfig::from_env()?;
    c.timeout = c.timeout.max(
        options
            .timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(10)),
    );
    Ok(c)
}
