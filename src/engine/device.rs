//! The device side of the engine: collectives on device memory, enqueued on the
//! caller's stream as NCCL does.
//!
//! A call lays its plan out for the executor ([`work::lay_out`]), connects the FIFO ends
//! it names ([`DeviceFifos`]), packs everything the executor reads into one block
//! ([`pack`]), copies it to the device in the stream's order from page-locked memory,
//! launches `ferroccl_execute` (one block per lane) on the stream, records an event and
//! returns: the call is complete when the stream reaches the event, and the caller
//! orders its own work after it with the stream, or with events, as with NCCL. The
//! memory of a call (its packed work, scratch, staging, statuses) is kept until its
//! event has passed; each later call, [`Launcher::poll`] and [`Launcher::wait_all`] read
//! the lanes' statuses of finished calls and turn a failed lane into an error.
//!
//! A call's memory comes from pools kept by the launcher and goes back to them when the
//! call has finished: `cuMemFree` and `cuMemFreeHost` may wait for the whole device, so
//! the steady state of a training loop allocates and frees nothing.
//!
//! The executor's waits look at an abort word in page-locked host memory: setting it
//! ([`Launcher::abort`]: the communicator's abort, or a deadline passing in
//! [`Launcher::wait_all`]) returns the stream to its owner.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::cuda::work::{self, FcclFifo, FcclLane, FcclOp, FcclStep, FcclWork};
use crate::cuda::{
    Context, DeviceBuffer, Event, Function, MappedHostBuffer, copy_to_device_async, nvrtc,
};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::plan::Protocol;
use crate::reduce::Kernel;
use crate::store::Store;
use crate::transport::cuda_ipc::DeviceFifos;
use crate::transport::fifo::Geometry;

/// Loads the executor (`ferroccl_execute`) into the current context, its code on the GPU
/// ([`Function::load`]), or returns it if it was loaded before. Communicators call it at
/// initialisation when a GPU is current: a lazy load at a rank's first launch may wait
/// for the whole context, where a peer's kernel already waits for this rank, or for a
/// stream the caller holds until the call returns.
pub fn load_executor() -> Result<Function> {
    Function::load(&nvrtc::EXECUTOR, "ferroccl_execute")
}

/// Threads per block of the executor.
pub const THREADS: u32 = 256;

/// One operation of a device call.
#[derive(Clone, Copy, Debug)]
pub struct DeviceOp {
    /// Element type and reduction (with the communicator's rank count).
    pub kernel: Kernel,
    /// Whether the collective reduces.
    pub reducing: bool,
    /// Send buffer (device address).
    pub input: u64,
    /// Receive buffer (device address).
    pub output: u64,
    /// How its slices move.
    pub protocol: Protocol,
}

/// Everything the executor reads for one launch, packed into one block of bytes (each
/// array 16-byte aligned), with the offsets of its arrays.
#[derive(Clone, Debug)]
pub struct Packed {
    /// The bytes, to copy to the device.
    pub bytes: Vec<u8>,
    lanes_at: usize,
    steps_at: usize,
    fifos_at: usize,
    ops_at: usize,
    nlanes: u32,
}

fn push_array<T: Copy>(bytes: &mut Vec<u8>, items: &[T]) -> usize {
    let at = bytes.len().next_multiple_of(16);
    bytes.resize(at, 0);
    // SAFETY: `T` is one of the `#[repr(C)]` plain-data structures of `work`; its bytes
    // are read as they are laid out.
    let raw = unsafe {
        std::slice::from_raw_parts(items.as_ptr() as *const u8, std::mem::size_of_val(items))
    };
    bytes.extend_from_slice(raw);
    at
}

/// Packs a laid-out plan with its FIFO ends and operations.
pub fn pack(laid: &work::LaidOut, fifos: &[FcclFifo], ops: &[FcclOp]) -> Packed {
    let mut bytes = Vec::new();
    let lanes_at = push_array::<FcclLane>(&mut bytes, &laid.lanes);
    let steps_at = push_array::<FcclStep>(&mut bytes, &laid.steps);
    let fifos_at = push_array::<FcclFifo>(&mut bytes, fifos);
    let ops_at = push_array::<FcclOp>(&mut bytes, ops);
    bytes.resize(bytes.len().next_multiple_of(16).max(16), 0);
    Packed {
        bytes,
        lanes_at,
        steps_at,
        fifos_at,
        ops_at,
        nlanes: laid.lanes.len() as u32,
    }
}

impl Packed {
    /// The kernel's argument once the bytes are at address `base` (where the executor
    /// runs), with `nlanes` status words at `status` and the abort word at `abort`.
    pub fn work(&self, base: u64, status: u64, abort: u64) -> FcclWork {
        FcclWork {
            lanes: (base + self.lanes_at as u64) as *const FcclLane,
            steps: (base + self.steps_at as u64) as *const FcclStep,
            fifos: (base + self.fifos_at as u64) as *const FcclFifo,
            ops: (base + self.ops_at as u64) as *const FcclOp,
            status: status as *mut u32,
            abort: abort as *const u32,
            nlanes: self.nlanes,
            pad: 0,
        }
    }

    /// Number of lanes (thread blocks).
    pub fn nlanes(&self) -> u32 {
        self.nlanes
    }
}

/// A launched call whose memory must live until its event passes.
struct Pending {
    op: &'static str,
    seq: u64,
    event: Arc<Event>,
    status: MappedHostBuffer,
    nlanes: usize,
    staging: MappedHostBuffer,
    work: DeviceBuffer,
    scratch: Vec<DeviceBuffer>,
}

/// Buffers of finished calls, for later ones (first fit).
#[derive(Default)]
struct Pools {
    device: Vec<DeviceBuffer>,
    host: Vec<MappedHostBuffer>,
}

impl Pools {
    /// Device memory of at least `bytes` (contents undefined).
    fn device(&mut self, bytes: usize) -> Result<DeviceBuffer> {
        match self.device.iter().position(|b| b.len() >= bytes) {
            Some(i) => Ok(self.device.swap_remove(i)),
            None => DeviceBuffer::zeroed(bytes),
        }
    }

    /// Mapped host memory of at least `bytes` (contents undefined).
    fn host(&mut self, bytes: usize) -> Result<MappedHostBuffer> {
        match self.host.iter().position(|b| b.len() >= bytes) {
            Some(i) => Ok(self.host.swap_remove(i)),
            None => MappedHostBuffer::zeroed(bytes),
        }
    }

    fn give_back(&mut self, p: Pending) {
        self.host.extend([p.status, p.staging]);
        self.device.push(p.work);
        self.device.extend(p.scratch);
    }
}

/// The word that tells a rank's executors to stop waiting; shared, so that an abort
/// needs no lock a waiting call may hold.
#[derive(Clone, Debug)]
pub struct AbortWord(Arc<MappedHostBuffer>);

impl AbortWord {
    /// Sets the word: every running executor of the rank stops waiting (its lanes report
    /// `FCCL_STATUS_ABORTED`), and later launches stop at once.
    pub fn set(&self) {
        // SAFETY: a u32 of page-locked memory the device only reads.
        unsafe { std::ptr::write_volatile(self.0.host() as *mut u32, 1) };
    }

    fn device(&self) -> u64 {
        self.0.device()
    }
}

/// Told why, when a call outlives the timeout (the communicator records it as its
/// failure).
pub type OnTimeout = Box<dyn Fn(String) + Send>;

/// A call the watchdog looks after: its completion event and deadline.
struct Watched {
    op: &'static str,
    seq: u64,
    event: Arc<Event>,
    deadline: Instant,
}

/// A call the watchdog gave up on (it then set the abort word).
#[derive(Clone, Copy, Debug)]
struct Expiry {
    op: &'static str,
    seq: u64,
    /// The peer whose process exited while the call waited (`None`: the deadline
    /// passed).
    dead: Option<usize>,
}

/// What the launcher and its watchdog share.
#[derive(Default)]
struct WatchState {
    calls: Vec<Watched>,
    expired: Option<Expiry>,
    stop: bool,
}

/// Peers in other processes of this host, by rank, whose exit the watchdog notices.
pub type WatchedPeers = Vec<(usize, crate::transport::liveness::Liveness)>;

/// A thread that sets the abort word when a call in flight outlives the communicator's
/// timeout, so that a stream waiting on a dead peer is given back even when nobody calls
/// [`Launcher::wait_all`] (a user's `cudaStreamSynchronize` would otherwise wait
/// forever).
struct Watchdog {
    shared: Arc<(Mutex<WatchState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(
        rank: usize,
        abort: AbortWord,
        on_timeout: OnTimeout,
        peers: WatchedPeers,
    ) -> Result<Self> {
        let shared: Arc<(Mutex<WatchState>, Condvar)> = Arc::default();
        let theirs = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferroccl-gpu-watch-{rank}"))
            .spawn(move || Self::run(rank, &theirs, &abort, &on_timeout, &peers))
            .map_err(|e| Error::Cuda {
                what: format!("cannot start the device watchdog thread: {e}"),
            })?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    fn run(
        rank: usize,
        shared: &(Mutex<WatchState>, Condvar),
        abort: &AbortWord,
        on_timeout: &OnTimeout,
        peers: &WatchedPeers,
    ) {
        let (state, wake) = shared;
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        while !st.stop {
            st.calls.retain(|w| !w.event.done().unwrap_or(true));
            let now = Instant::now();
            if st.expired.is_none()
                && let Some(w) = st.calls.first()
            {
                let dead = peers.iter().find(|(_, l)| l.has_exited()).map(|(r, _)| *r);
                let late = st.calls.iter().find(|w| w.deadline <= now);
                let why = match (dead, late) {
                    (Some(peer), _) => Some(format!(
                        "rank {rank}: {} #{} on the device: the process of rank {peer} \
                         exited while this rank's kernel waited; its executor was told to \
                         stop waiting",
                        w.op, w.seq
                    )),
                    (None, Some(w)) => Some(format!(
                        "rank {rank}: {} #{} on the device did not finish within the \
                         communicator's timeout: its executor was told to stop waiting on \
                         peers",
                        w.op, w.seq
                    )),
                    (None, None) => None,
                };
                if let Some(why) = why {
                    let w = late.filter(|_| dead.is_none()).unwrap_or(w);
                    tracing::error!("{why}");
                    st.expired = Some(Expiry {
                        op: w.op,
                        seq: w.seq,
                        dead,
                    });
                    abort.set();
                    on_timeout(why);
                }
            }
            let next = st
                .calls
                .iter()
                .map(|w| w.deadline.saturating_duration_since(now))
                .min()
                .unwrap_or(Duration::from_secs(3600))
                .clamp(Duration::from_millis(1), Duration::from_millis(100));
            st = wake
                .wait_timeout(st, next)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.shared.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn watch(&self, w: Watched) {
        self.lock().calls.push(w);
        self.shared.1.notify_all();
    }

    fn expired(&self) -> Option<Expiry> {
        self.lock().expired
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.lock().stop = true;
        self.shared.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Which rank of which communicator last enqueued which call on a stream (by the
/// stream's handle, or its context's for the legacy default stream).
type StreamUsers = Mutex<HashMap<usize, (u64, usize, u64)>>;

fn stream_users() -> std::sync::MutexGuard<'static, HashMap<usize, (u64, usize, u64)>> {
    static USERS: OnceLock<StreamUsers> = OnceLock::new();
    USERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Refuses a call that two ranks of one communicator put on one stream: their kernels
/// must run at the same time, so the second would wait for the first forever (and the
/// first for the second). `comm` identifies the communicator in this process.
fn claim_stream(stream_key: usize, comm: u64, rank: usize, op: &str, seq: u64) -> Result<()> {
    let mut users = stream_users();
    if let Some(&(c, other, s)) = users.get(&stream_key)
        && c == comm
        && s == seq
        && other != rank
    {
        return Err(Error::invalid(format!(
            "ranks {other} and {rank} of one communicator enqueued {op} #{seq} on the same \
             CUDA stream (or both on the legacy default stream of one context): their \
             kernels must run at the same time, so each would wait for the other forever; \
             give each rank a stream of its own"
        )));
    }
    users.insert(stream_key, (comm, rank, seq));
    Ok(())
}

/// Forgets the streams rank `rank` of `comm` used. The driver hands a destroyed stream's
/// handle to the next stream made, and a later communicator of the same members has the
/// same `comm`: a stale claim then refused a rank's first call as if another rank had
/// made it on the same stream (ranks that were threads of one process on an H100).
fn release_streams(comm: u64, rank: usize) {
    stream_users().retain(|_, &mut (c, r, _)| (c, r) != (comm, rank));
}

/// One rank's device side: the executor, its FIFOs, its calls in flight, all in one
/// CUDA context (the first call's), which every later call must use too.
pub struct Launcher {
    rank: usize,
    /// Identifies the communicator among those of this process (see [`claim_stream`]).
    comm: u64,
    ctx: Context,
    watchdog: Watchdog,
    timeout: Duration,
    executor: Function,
    fifos: DeviceFifos,
    abort_word: AbortWord,
    pending: VecDeque<Pending>,
    pools: Pools,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("rank", &self.rank)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl Launcher {
    /// The device side of `rank` in context `ctx`, with FIFOs shaped as the host's
    /// (`simple`, `ll`); `timeout` bounds the wait for peers and for calls in flight when
    /// it is dropped. Compiles (or takes from the cache) and loads the executor.
    /// `comm` identifies the communicator among those of this process (equal for its
    /// ranks here, different from other communicators'); `on_timeout` hears of a call
    /// that outlived `timeout`, or whose wait a peer of `peers` left by exiting, with
    /// nobody waiting for it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        comm: u64,
        on_timeout: OnTimeout,
        peers: WatchedPeers,
        ctx: Context,
        simple: Geometry,
        ll: Geometry,
        timeout: Duration,
    ) -> Result<Self> {
        let _current = ctx.push()?;
        let abort_word = AbortWord(Arc::new(MappedHostBuffer::zeroed(4)?));
        Ok(Launcher {
            rank,
            comm,
            ctx,
            watchdog: Watchdog::start(rank, abort_word.clone(), on_timeout, peers)?,
            timeout,
            executor: load_executor()?,
            fifos: DeviceFifos::new(rank, simple, ll)?,
            abort_word,
            pending: VecDeque::new(),
            pools: Pools::default(),
        })
    }

    /// The context the launcher's memory and calls belong to.
    pub fn context(&self) -> Context {
        self.ctx
    }

    /// The rank's abort word (see [`AbortWord::set`]).
    pub fn abort_word(&self) -> AbortWord {
        self.abort_word.clone()
    }

    /// Enqueues `plan` on `stream` and returns without waiting for it. The launch waits
    /// (on the device) for the rank's previous one, whatever stream that was on: they use
    /// the same FIFOs.
    ///
    /// # Safety
    /// Every region of the plan lies inside the device buffers `ops` name, which stay
    /// valid and are not otherwise used until the stream has passed this call; `stream`
    /// is a stream of the launcher's context (or NULL).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue(
        &mut self,
        plan: &Plan,
        ops: &[DeviceOp],
        stream: *mut c_void,
        store: &dyn Store,
        connect_timeout: Duration,
        op: &'static str,
        seq: u64,
    ) -> Result<()> {
        let _current = self.ctx.push()?;
        self.poll()?;
        // SAFETY: the caller's stream, of this context.
        if unsafe { crate::cuda::is_capturing(stream)? } {
            return Err(Error::invalid(format!(
                "{op} #{seq}: the stream is being captured into a CUDA graph, and ferroccl's \
                 device calls cannot be captured yet (each call's work, FIFO positions and \
                 completion are host-side state of that one call, which a replay would \
                 reuse); make the call outside the capture"
            )));
        }
        let stream_key = if stream.is_null() {
            self.ctx.key()
        } else {
            stream as usize
        };
        claim_stream(stream_key, self.comm, self.rank, op, seq)?;
        if ops.len() != plan.ops.len() {
            return Err(Error::invalid(format!(
                "device call: {} operations for a plan of {}",
                ops.len(),
                plan.ops.len()
            )));
        }
        let protocols: Vec<Protocol> = ops.iter().map(|o| o.protocol).collect();
        let laid = work::lay_out(plan, &protocols)?;
        if laid.lanes.is_empty() {
            return Ok(());
        }
        let fifos = self.fifos.connect(&laid.fifos, store, connect_timeout)?;
        if let Some(previous) = self.pending.back() {
            // SAFETY: the caller's stream, of this context.
            unsafe { previous.event.make_wait(stream)? };
        }
        let mut scratch = Vec::new();
        let mut fccl_ops = Vec::with_capacity(ops.len());
        for (i, o) in ops.iter().enumerate() {
            let elems = plan.scratch_elems(i);
            let s = if elems > 0 {
                let b = self.pools.device(elems * o.kernel.dtype().size())?;
                let p = b.ptr();
                scratch.push(b);
                p
            } else {
                0
            };
            fccl_ops.push(FcclOp::new(
                &o.kernel,
                o.reducing,
                o.input as *const c_void,
                o.output as *mut c_void,
                s as *mut c_void,
            ));
        }
        let packed = pack(&laid, &fifos, &fccl_ops);
        let status = self.pools.host(4 * laid.lanes.len())?;
        // Not yet run: a lane that never reports is not mistaken for a success.
        // SAFETY: nlanes u32 words of page-locked memory no kernel uses yet.
        unsafe { std::ptr::write_bytes(status.host(), 0xFF, 4 * laid.lanes.len()) };
        let staging = self.pools.host(packed.bytes.len())?;
        // SAFETY: the staging buffer holds the packed bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(packed.bytes.as_ptr(), staging.host(), packed.bytes.len())
        };
        let work_mem = self.pools.device(packed.bytes.len())?;
        // SAFETY: staging is page-locked and kept (in `Pending`) until the event passes;
        // the device buffer holds the bytes; the stream is the caller's.
        unsafe {
            copy_to_device_async(work_mem.ptr(), staging.host(), packed.bytes.len(), stream)?
        };
        let mut arg = packed.work(work_mem.ptr(), status.device(), self.abort_word.device());
        let mut params = [&mut arg as *mut FcclWork as *mut c_void];
        // SAFETY: `ferroccl_execute(FcclWork)` takes one parameter, passed by pointer as
        // cuLaunchKernel wants; every address inside it stays valid until the event.
        unsafe {
            self.executor
                .launch(packed.nlanes(), THREADS, stream, &mut params)?
        };
        // SAFETY: the caller's stream.
        let event = Arc::new(unsafe { Event::record(stream)? });
        self.watchdog.watch(Watched {
            op,
            seq,
            event: event.clone(),
            deadline: Instant::now() + self.timeout,
        });
        self.pending.push_back(Pending {
            op,
            seq,
            event,
            nlanes: laid.lanes.len(),
            status,
            staging,
            work: work_mem,
            scratch,
        });
        Ok(())
    }

    /// Releases the calls that have finished; the first failed lane among them is the
    /// error.
    pub fn poll(&mut self) -> Result<()> {
        let _current = self.ctx.push()?;
        while let Some(p) = self.pending.front() {
            if !p.event.done()? {
                break;
            }
            self.retire_oldest()?;
        }
        Ok(())
    }

    /// Waits for every call in flight; past `deadline` the executor is told to stop
    /// waiting on its peers and the call fails with a timeout.
    pub fn wait_all(&mut self, deadline: Instant) -> Result<()> {
        let _current = self.ctx.push()?;
        while let Some(p) = self.pending.front() {
            if !p.event.done()? {
                if Instant::now() >= deadline {
                    self.abort();
                    p.event.wait()?;
                    let p = self.pending.pop_front().expect("checked above");
                    let (op, seq) = (p.op, p.seq);
                    self.pools.give_back(p);
                    return Err(Error::Timeout {
                        op: op.to_string(),
                        seq,
                        rank: self.rank,
                        waiting_on: Vec::new(),
                        stalled: None,
                        waited: Duration::ZERO,
                    });
                }
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            self.retire_oldest()?;
        }
        Ok(())
    }

    /// Releases the oldest call (finished) to the pools; its verdict.
    fn retire_oldest(&mut self) -> Result<()> {
        let Some(p) = self.pending.pop_front() else {
            return Ok(());
        };
        let verdict = self.verdict(&p);
        self.pools.give_back(p);
        verdict
    }

    /// Tells every running executor of this rank to stop waiting (they report
    /// `FCCL_STATUS_ABORTED`); later launches stop at once too.
    pub fn abort(&self) {
        self.abort_word.set();
    }

    /// Whether calls are in flight.
    pub fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    fn verdict(&self, p: &Pending) -> Result<()> {
        for lane in 0..p.nlanes {
            // SAFETY: lane < nlanes words, written by the finished kernel.
            let s = unsafe { std::ptr::read_volatile((p.status.host() as *const u32).add(lane)) };
            match s {
                0 => {}
                1 if let Some(e) = self.watchdog.expired() => {
                    return Err(match e.dead {
                        Some(peer) => Error::PeerFailed {
                            op: e.op.to_string(),
                            seq: e.seq,
                            rank: self.rank,
                            failed_rank: peer,
                            detail: "its process exited while this rank's kernel waited on it"
                                .into(),
                        },
                        None => Error::Timeout {
                            op: e.op.to_string(),
                            seq: e.seq,
                            rank: self.rank,
                            waiting_on: Vec::new(),
                            stalled: None,
                            waited: self.timeout,
                        },
                    });
                }
                1 => {
                    return Err(Error::Aborted {
                        rank: self.rank,
                        reason: format!("{} #{} on the device was aborted", p.op, p.seq),
                    });
                }
                _ => {
                    return Err(Error::Cuda {
                        what: format!(
                            "rank {}: {} #{}: lane {lane}: {}",
                            self.rank,
                            p.op,
                            p.seq,
                            work::status_name(s)
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

impl Drop for Launcher {
    /// Memory of calls in flight must outlive them: wait for them (for the
    /// communicator's timeout; then the device is told to stop waiting on peers, so a
    /// dead peer cannot hold this forever), then free everything in the launcher's
    /// context.
    fn drop(&mut self) {
        release_streams(self.comm, self.rank);
        let Ok(_current) = self.ctx.push() else {
            return;
        };
        let _ = self.wait_all(Instant::now() + self.timeout);
        for p in &self.pending {
            let _ = p.event.wait();
        }
        self.pending.clear();
        self.pools = Pools::default();
        self.fifos.release();
    }
}

#[cfg(test)]
mod tests {
    use super::{claim_stream, release_streams};

    /// A stream handle the driver hands out again, to a later communicator of the same
    /// members: the earlier one's claim is gone once its launcher is dropped.
    #[test]
    fn a_stream_claim_ends_with_its_launcher() {
        let (stream, comm) = (0x5eed_0001, 0xfeed_0001);
        claim_stream(stream, comm, 0, "all_reduce", 0).unwrap();
        let err = claim_stream(stream, comm, 1, "all_reduce", 0).unwrap_err();
        assert!(err.to_string().contains("ranks 0 and 1"), "{err}");
        // The same rank's next call, and another communicator, may use it.
        claim_stream(stream, comm, 0, "all_reduce", 1).unwrap();
        claim_stream(stream, comm + 1, 1, "all_reduce", 1).unwrap();
        release_streams(comm + 1, 1);
        claim_stream(stream, comm, 0, "all_reduce", 0).unwrap();
        release_streams(comm, 0);
        claim_stream(stream, comm, 1, "all_reduce", 0).unwrap();
        release_streams(comm, 1);
    }
}
