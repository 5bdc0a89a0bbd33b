//! [`Communicator`]: the NCCL-shaped API.
//!
//! A communicator is one rank's membership in a group of ranks, with connections to
//! every peer. Its collectives are blocking calls on host memory that run in the
//! caller's thread ([`crate::engine`]). Typed calls take slices (`&[T]`,
//! `&mut [T]`, [`Element`] types); the in-place forms take one buffer laid out as NCCL
//! defines in-place calls. Every argument is checked before any data moves: a wrong root,
//! length or type is an [`Error::InvalidArgument`] naming the argument, and leaves the
//! communicator usable. A failure while data moves (a peer died, the deadline passed)
//! aborts the communicator: the call and every later one fail, and the peers waiting on
//! this rank learn which rank failed first.
//!
//! This file holds the communicator, its lifecycle (init, split, shrink, abort) and the
//! untyped host calls; `typed.rs` the typed API, `planning.rs` the choice of algorithm
//! and the plans, `device.rs` calls on device memory, [`device_tuning`] how those are
//! tuned, [`config`](CommConfig) the settings.

pub(crate) mod config;
mod device;
pub mod device_tuning;
mod planning;
mod typed;
mod window;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use config::CommConfig;
use planning::{PlanCache, Planner};

use crate::bootstrap::{Bootstrap, UniqueId};
use crate::engine::progress::{Pending, ProgressThread, Turns, pending};
use crate::engine::{self, OpBuffers};
use crate::error::{ABORTED_BY_USER, CallInfo, Error, Result};
use crate::plan::{self, Algorithm, Collective, Plan, PlanOptions};
use crate::reduce::Kernel;
use crate::store::{HashStore, PrefixStore, Store};
use crate::transport::bell::{Bell, Closed};
use crate::transport::{Connections, Protocol, SlotStores, TransportConfig};
use crate::tune::stores::{Sample, StoreTrial, Stores};
use crate::tune::{Choice, CostModel, Shape};
use crate::types::{DataType, Element, ReduceOp};

/// One rank's handle on a group of ranks that run collectives together.
///
/// # Example
///
/// Four ranks as threads of this process all-reduce a vector; rank processes made by
/// [`Communicator::from_env`] under a launcher (`ferrorun`, `torchrun`, `srun`,
/// `mpirun`) call the same methods.
///
/// ```
/// use ferroccl::{Communicator, ReduceOp};
///
/// let comms = Communicator::init_all(4)?;
/// std::thread::scope(|s| {
///     for comm in &comms {
///         s.spawn(move || {
///             let mine = [comm.rank() as f32; 3];
///             let mut sum = [0.0f32; 3];
///             comm.all_reduce(&mine, &mut sum, ReduceOp::Sum).unwrap();
///             assert_eq!(sum, [6.0; 3]); // 0 + 1 + 2 + 3
///         });
///     }
/// });
/// # Ok::<(), ferroccl::Error>(())
/// ```
pub struct Communicator {
    rank: usize,
    nranks: usize,
    config: CommConfig,
    /// How host calls are planned (rank 0's cost model: every rank uses the same one, so
    /// choices agree).
    planner: Planner,
    /// How host calls are planned while windows are registered, when that differs: ranks
    /// of other processes then read each other's windows in place, as threads do.
    windowed_planner: Option<Planner>,
    /// How calls on device memory are planned (agreed at initialisation).
    device_planner: Planner,
    /// What the device planner was made from.
    device_tuning: device_tuning::DeviceTuning,
    /// The GPU current on the initialising thread (`ncclCommCuDevice`), if any.
    gpu: Option<crate::cuda::GpuIdentity>,
    /// Ranks, hosts, ranks per host.
    shape: Shape,
    boot: Bootstrap,
    state: Mutex<State>,
    splits: AtomicU64,
    /// Issue order of calls, shared by blocking and asynchronous ones.
    turns: Turns,
    /// Runs asynchronous calls; started by the first one.
    progress: OnceLock<ProgressThread>,
    /// Closes this rank's bell without the state lock, so an abort reaches a running
    /// call.
    abort_bell: Arc<Bell>,
    /// Set once a call failed while moving data, or on abort (the first reason kept).
    failure: Arc<FailureSlot>,
    /// The device side's abort word, once there is a device side.
    device_abort: OnceLock<crate::engine::device::AbortWord>,
}

struct State {
    conns: Connections,
    /// Sequence number of the next call.
    seq: u64,
    /// The plans of the last few distinct single-operation host calls.
    host_plans: PlanCache,
    /// The same for calls on device memory (planned by the device planner).
    device_plans: PlanCache,
    /// Scratch memory of host calls (in words, for 8-byte alignment).
    scratch: Vec<u64>,
    /// The device side, made by the first call on device memory.
    device: Option<crate::engine::device::Launcher>,
    /// Live windows: each one's token (unique in this process) and number (the same
    /// on every rank).
    windows: HashMap<u64, u64>,
    /// Windows registered so far (the next one's number).
    windows_made: u64,
    /// Whether host calls of each size write past the caches (slots towards far peers,
    /// large results), timed on the calls (`FERROCCL_SLOT_STORES=auto`).
    store_trial: StoreTrial,
}

/// Scratch memory kept between calls (4 MiB): the direct algorithms' fold slots are a
/// chunk per channel; a tree reduce's partial sums, as large as the call, are freed.
const KEPT_SCRATCH_WORDS: usize = 1 << 19;

/// A single-operation plan with what it was made from and what it needs.
struct CachedPlan {
    key: PlanKey,
    plan: Plan,
    choice: Choice,
    /// [`Plan::scratch_elems`] of its operation.
    scratch_elems: usize,
    /// Whether the FIFOs it needs are made (after its first call).
    connected: bool,
    /// How the engine runs it (known after its first call).
    schedule: Option<engine::Schedule>,
}

/// What a single-operation plan depends on besides the communicator.
type PlanKey = (Collective, usize, usize);

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("channels", &self.config.channels)
            .finish_non_exhaustive()
    }
}

/// One operation over raw buffers, as the C API issues it (see
/// [`Communicator::group_raw`]).
#[derive(Clone, Copy, Debug)]
pub struct RawCall {
    /// What to run (with its root or peer).
    pub collective: Collective,
    /// NCCL's count argument for the collective.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (ignored by collectives that do not reduce).
    pub op: ReduceOp,
    /// NCCL's send buffer (null where the call has no input on this rank).
    pub input: *const u8,
    /// NCCL's receive buffer (null where the call has no output on this rank).
    pub output: *mut u8,
}

/// Whether a call's results go to its output past the caches
/// ([`RawCall::result_streaming`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ResultStreaming {
    /// Plain stores: a small output, or one that overlaps the input.
    Never,
    /// Streaming stores: the outputs of the ranks a CPU runs outgrow its caches together.
    Always,
    /// As the store trial of the call's size chose.
    AsTried,
}

impl RawCall {
    /// Whether the call reduces, and the reduction its kernels apply (sum, as a plain
    /// copy, for collectives that move data without reducing it).
    fn reduction(&self) -> (bool, ReduceOp) {
        let reducing = self.collective.is_reducing();
        (reducing, if reducing { self.op } else { ReduceOp::Sum })
    }

    /// How rank `rank`'s call uses the caches: whether its results may go to its output
    /// past them ([`OpBuffers::streaming`]), and whether the store trial decides it. An
    /// output of at least [`engine::streaming_from`] bytes for `ranks_per_cpu` ranks to
    /// a CPU that does not overlap the input may stream (in place, the input's lines are
    /// already cached when the result replaces them, and a streaming store would only
    /// evict them: measured, 2 ranks, 128 MiB in place, 9.6 GB/s plain, 6.9 streaming);
    /// from [`engine::STREAMING_FROM`] the trial of the call's size decides
    /// ([`Stores::streams_results`]), below it a crowded CPU's results always stream.
    fn result_streaming(
        &self,
        rank: usize,
        nranks: usize,
        ranks_per_cpu: usize,
    ) -> ResultStreaming {
        let (ins, outs) = self.collective.buffer_lens(self.count, rank, nranks);
        let elem = self.dtype.size();
        let (i0, o0) = (self.input as usize, self.output as usize);
        let apart = i0 + ins * elem <= o0 || o0 + outs * elem <= i0;
        let bytes = outs * elem;
        if !apart || bytes < engine::streaming_from(ranks_per_cpu) {
            ResultStreaming::Never
        } else if bytes < engine::STREAMING_FROM {
            ResultStreaming::Always
        } else {
            ResultStreaming::AsTried
        }
    }
}

/// Loads the device executor into the current context at initialisation, before any
/// rank can launch a call: with lazy loading (the CUDA default since 12.2) a kernel's
/// first launch may wait for the whole context, where a peer's kernel already waits for
/// this rank or the caller holds a stream until the call returns (both hung on an H100;
/// see [`crate::cuda::Function::load`]). A failure only postpones the load to the first
/// device call, which reports it; host calls never need the executor.
fn load_device_executor(rank: usize) {
    if let Err(e) = engine::device::load_executor() {
        tracing::info!(
            rank,
            "the device executor is not loaded at initialisation: {e}"
        );
    }
}

/// What every rank agrees on at initialisation (collective): everyone plans with rank
/// 0's cost model, so that every rank picks the same algorithm for the same call even if
/// their environments differ; the settings that shape plans and FIFOs must be the same
/// everywhere, or calls would hang (an error names the first that differs). Returns the
/// model and every rank's GPU line ([`device_tuning::describe`]).
fn agree_at_init(
    boot: &Bootstrap,
    config: &CommConfig,
    gpu: Option<&crate::cuda::GpuIdentity>,
) -> Result<(CostModel, Vec<String>)> {
    let mine = format!(
        "{}\n{}\n{}",
        CostModel::from_env()?.to_text(),
        device_tuning::describe(gpu),
        config.shared_settings()
    );
    // Each text: the cost model, the GPU line, the settings.
    let texts: Vec<[String; 3]> = boot
        .all_gather(mine.as_bytes())?
        .iter()
        .map(|b| {
            let text = String::from_utf8_lossy(b);
            let mut lines = text.splitn(3, '\n').map(String::from);
            [(); 3].map(|_| lines.next().unwrap_or_default())
        })
        .collect();
    let [model, _, settings] = &texts[0];
    for (r, [_, _, theirs]) in texts.iter().enumerate() {
        if let Some(diff) = CommConfig::settings_differ(settings, theirs) {
            return Err(Error::invalid(format!(
                "rank {r}'s settings differ from rank 0's: {diff}; every rank must use the same"
            )));
        }
    }
    let model = CostModel::parse("rank 0's cost model", model)?;
    Ok((model, texts.iter().map(|[_, gpu, _]| gpu.clone()).collect()))
}

/// Why a communicator stopped being usable, once it has: its own lock, not the
/// state's, which a running call holds (asking must not wait for the call), and a
/// flag, so that every call's check costs one load rather than a lock and unlock.
#[derive(Debug, Default)]
pub(crate) struct FailureSlot {
    failed: std::sync::atomic::AtomicBool,
    reason: Mutex<Option<String>>,
}

impl FailureSlot {
    /// The first reason set, if any.
    pub(crate) fn get(&self) -> Option<String> {
        if !self.failed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records `reason` unless a reason was recorded before.
    pub(crate) fn set(&self, reason: String) {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(reason);
        self.failed
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Communicator {
    /// Joins the communicator named by `id` as `rank` of `nranks`
    /// (`ncclCommInitRank`), with settings from the environment.
    pub fn init_rank(id: &UniqueId, nranks: usize, rank: usize) -> Result<Self> {
        Self::init_rank_with(id, nranks, rank, CommConfig::from_env()?)
    }

    /// Like [`Communicator::init_rank`], with explicit settings.
    pub fn init_rank_with(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        config: CommConfig,
    ) -> Result<Self> {
        config.validate()?;
        let boot = Bootstrap::from_unique_id(id, rank, nranks, &config.bootstrap)?;
        Self::from_bootstrap(boot, config)
    }

    /// `env://` initialisation from the launcher's variables (ferrorun, torchrun, srun,
    /// mpirun; see [`Bootstrap::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(CommConfig::from_env()?)
    }

    /// Like [`Communicator::from_env`], with explicit settings.
    pub fn from_env_with(config: CommConfig) -> Result<Self> {
        config.validate()?;
        let (boot, _) = Bootstrap::from_env(&config.bootstrap)?;
        Self::from_bootstrap(boot, config)
    }

    /// `n` ranks as threads of this process (`ncclCommInitAll`): returns the
    /// communicators in rank order, to be used from one thread each.
    pub fn init_all(n: usize) -> Result<Vec<Self>> {
        Self::init_all_with(n, CommConfig::from_env()?)
    }

    /// Like [`Communicator::init_all`], with explicit settings.
    pub fn init_all_with(n: usize, config: CommConfig) -> Result<Vec<Self>> {
        Self::init_all_on(n, config, &|_| Ok(()))
    }

    /// Like [`Communicator::init_all_with`], running `before_init(rank)` on each rank's
    /// initialising thread first: to make the rank's GPU current, as a NCCL program
    /// calls `cudaSetDevice` before `ncclCommInitRank`, so that the device calls' tuning
    /// knows the GPUs ([`Communicator::device_tuning`]).
    pub fn init_all_on(
        n: usize,
        config: CommConfig,
        before_init: &(dyn Fn(usize) -> Result<()> + Sync),
    ) -> Result<Vec<Self>> {
        if n == 0 {
            return Err(Error::invalid("init_all: 0 ranks"));
        }
        config.validate()?;
        if crate::cuda::current_gpu().is_some() {
            // The ranks' threads have no context unless `before_init` makes one current:
            // their device calls will run in this thread's, so load the executor there.
            load_device_executor(0);
        }
        let store = HashStore::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let store: Arc<dyn Store> = Arc::new(store.clone());
                    let config = config.clone();
                    s.spawn(move || {
                        before_init(rank)?;
                        let boot = Bootstrap::new(store, rank, n, &config.bootstrap)?;
                        Self::from_bootstrap(boot, config)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("init_all thread panicked"))
                .collect()
        })
    }

    /// Builds the communicator over a rendezvous that already happened (collective:
    /// every rank of `boot` must call it).
    pub fn from_bootstrap(boot: Bootstrap, config: CommConfig) -> Result<Self> {
        crate::trace::init_from_env();
        config.validate()?;
        let (rank, nranks) = (boot.rank(), boot.world_size());
        // The GPU current on this thread, if any, for the device calls' tuning.
        let gpu = crate::cuda::current_gpu();
        if gpu.is_some() {
            // Before the collective below, so that no rank of this communicator has a
            // kernel running while another loads the executor.
            load_device_executor(rank);
        }
        let (mut model, gpu_lines) = agree_at_init(&boot, &config, gpu.as_ref())?;
        // The same hosts for the plans' rings and trees, the cost model and the
        // transports (with TCP forced, every rank is a host of its own).
        let hosts = config.transport.host_labels(boot.peers());
        let rings = PlanOptions::for_hosts(&hosts, config.channels, 1).rings;
        crate::topo::dump_from_env(rank, boot.peers(), &rings)?;
        let conns = Connections::establish(
            &boot,
            &TransportConfig {
                geometry: config.geometry(),
                dedicated: config.dedicated_geometry(),
                crowded: config.crowded_geometry(),
                ll: config.ll_geometry(),
                dedicated_ll: config.dedicated_ll_geometry(),
                single_copy: config.protocols.contains(&Protocol::SingleCopy),
                slot_stores: config.slot_stores,
                slot_exchange: config.slot_exchange,
                rings: rings.clone(),
                choice: config.transport,
                connect_timeout: config.bootstrap.timeout,
                link_timeout: config.link_timeout,
                striping: config.striping,
                net: config.net,
                #[cfg(feature = "rdma")]
                rdma: config.rdma.clone(),
            },
        )?;
        // Over RDMA the network is the NIC, not TCP through proxies.
        if let Some(gbps) = conns.rdma_link_gbps() {
            model.net = crate::tune::LinkCost::rdma(gbps);
        }
        let host_count = hosts.iter().max().map_or(1, |m| m + 1);
        let memory = conns.peer_memory();
        let crowded = crowded_ring_steps(rank, &config, &conns);
        let (planner, windowed_planner) =
            Planner::for_host(&config, &hosts, model, memory, crowded);
        let device_tuning =
            device_tuning::agree(&boot, &gpu_lines, &hosts, config.device_channels, model.net)?;
        let device_planner = Planner::new(
            &config,
            &hosts,
            device_tuning.channels,
            device_tuning.model,
            false,
            false,
        );
        let shape = Shape {
            ranks: nranks,
            hosts: host_count,
            ranks_per_host: (0..host_count)
                .map(|h| hosts.iter().filter(|&&x| x == h).count())
                .max()
                .unwrap_or(1),
            crowding: conns.crowding(),
        };
        let store_trial = StoreTrial::new(nranks, config.channels, config.slot_bytes);
        Ok(Communicator {
            rank,
            nranks,
            config,
            planner,
            windowed_planner,
            device_planner,
            device_tuning,
            gpu,
            shape,
            boot,
            abort_bell: conns.abort_handle(),
            failure: Arc::default(),
            device_abort: OnceLock::new(),
            state: Mutex::new(State {
                conns,
                seq: 0,
                host_plans: PlanCache::default(),
                device_plans: PlanCache::default(),
                scratch: Vec::new(),
                device: None,
                windows: HashMap::new(),
                windows_made: 0,
                store_trial,
            }),
            splits: AtomicU64::new(0),
            turns: Turns::default(),
            progress: OnceLock::new(),
        })
    }

    /// This rank (`ncclCommUserRank`).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks (`ncclCommCount`).
    pub fn size(&self) -> usize {
        self.nranks
    }

    /// The settings in force.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// Whether the ranks of some host of this communicator outnumber the cores they may
    /// use: the FIFOs between them then have [`CommConfig::crowded_slots`], and host
    /// calls' Simple ring steps fit half of one ([`CommConfig::chunk_bytes_for`]).
    pub fn crowded(&self) -> bool {
        self.shape.crowding.outnumbered()
    }

    /// Facts about every rank (host, pid, addresses), from the rendezvous.
    pub fn peers(&self) -> &[crate::bootstrap::PeerInfo] {
        self.boot.peers()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    /// Registers `len` bytes at `addr` with this communicator (`ncclCommRegister`): with
    /// its RDMA device when it has RDMA links, through a cache (a buffer inside one
    /// registered before shares its registration); otherwise it is only recorded, as
    /// shared memory and TCP need no registration.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Communicator::deregister`] or until the
    /// communicator is dropped.
    pub unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
    ) -> Result<crate::transport::Registration> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.lock().conns.register(addr, len) }
    }

    /// Ends a registration made by [`Communicator::register`] (`ncclCommDeregister`).
    pub fn deregister(&self, registration: &crate::transport::Registration) -> Result<()> {
        self.lock().conns.deregister(registration)
    }

    /// The store of this communicator's rendezvous (a prefix of the job's), for layers
    /// that keep their own keys next to it.
    pub fn store(&self) -> Arc<dyn Store> {
        self.boot.store().clone()
    }

    /// The first error this communicator failed with, if it has (`ncclCommGetAsyncError`).
    pub fn failure(&self) -> Option<String> {
        self.failure.get()
    }

    fn set_failure(&self, reason: String) {
        self.failure.set(reason);
    }

    /// Waits for every call issued so far (blocking or asynchronous) to finish.
    pub fn flush(&self) {
        self.turns.run_blocking(|| ());
    }

    /// Aborts the communicator (`ncclCommAbort`): later calls fail, and peers waiting on
    /// this rank fail at once with an error naming it.
    pub fn abort(&self) {
        self.close_now(Closed::ByOwner, ABORTED_BY_USER.into());
    }

    /// Aborts because `rank` is at fault (a watchdog's verdict): peers learn that
    /// `rank` failed, as if this rank had seen it fail.
    pub fn abort_blaming(&self, rank: usize, reason: &str) {
        self.close_now(Closed::PeerFailed(rank), reason.to_string());
    }

    fn close_now(&self, why: Closed, reason: String) {
        // First wake a call running in another thread (it holds the state), so that it
        // fails now rather than at its deadline.
        self.abort_bell.close(why);
        self.set_failure(reason);
        // The device's abort word needs no lock: a call waiting on the device holds it.
        if let Some(word) = self.device_abort.get() {
            word.set();
        }
        self.lock().conns.close(why);
    }

    /// Destroys the communicator (`ncclCommDestroy`): waits for its asynchronous calls to
    /// finish, then releases its connections. Peers still waiting on this rank learn
    /// that it left. Dropping the communicator does the same.
    pub fn destroy(self) -> Result<()> {
        // Runs after every call issued so far, then lets the progress thread end.
        self.turns.run_blocking(|| ());
        let (rank, failure) = (self.rank, self.failure());
        drop(self);
        match failure {
            Some(reason) if reason != ABORTED_BY_USER => Err(Error::Aborted { rank, reason }),
            _ => Ok(()),
        }
    }

    /// Creates sub-communicators (`ncclCommSplit`): ranks passing the same `color` end up
    /// in one, ordered by `key` and then by their rank here; `None` (NCCL's
    /// `NCCL_SPLIT_NOCOLOR`) takes part without joining any. Collective over this
    /// communicator.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        self.split_with(color, key, self.config.clone())
    }

    /// [`Communicator::split`] with other settings for the new communicator
    /// (`ncclCommSplit`'s config argument), such as a forced algorithm or protocol.
    pub fn split_with(
        &self,
        color: Option<u32>,
        key: i32,
        config: CommConfig,
    ) -> Result<Option<Communicator>> {
        config.validate()?;
        self.turns
            .run_blocking(|| self.split_in_turn(color, key, config))
    }

    fn split_in_turn(
        &self,
        color: Option<u32>,
        key: i32,
        config: CommConfig,
    ) -> Result<Option<Communicator>> {
        let generation = self.splits.fetch_add(1, Ordering::SeqCst);
        let mut mine = Vec::with_capacity(12);
        mine.extend_from_slice(&color.map_or(-1i64, i64::from).to_le_bytes());
        mine.extend_from_slice(&key.to_le_bytes());
        let all = self.boot.all_gather(&mine)?;
        let sub = self.join_split(&all, color, generation, config);
        // Every rank of the parent, whatever its color, waits here until all have made
        // their communicators: the store lives in one rank's process, and that rank must
        // not return (and perhaps exit) while other colors still rendezvous on it.
        self.boot.barrier()?;
        sub
    }

    fn join_split(
        &self,
        all: &[Vec<u8>],
        color: Option<u32>,
        generation: u64,
        config: CommConfig,
    ) -> Result<Option<Communicator>> {
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i32, usize)> = Vec::new();
        for (r, bytes) in all.iter().enumerate() {
            let bad = || Error::BootstrapData {
                rank: r,
                detail: "split: malformed (color, key)".into(),
            };
            let c = i64::from_le_bytes(bytes.get(0..8).ok_or_else(bad)?.try_into().unwrap());
            let k = i32::from_le_bytes(bytes.get(8..12).ok_or_else(bad)?.try_into().unwrap());
            if c == i64::from(color) {
                members.push((k, r));
            }
        }
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank has its own color");
        let store = PrefixStore::new(
            format!("split/{generation}/{color}"),
            self.boot.store().clone(),
        );
        let boot = self
            .boot
            .sub(Arc::new(store), new_rank, members.len(), &config.bootstrap)?;
        Communicator::from_bootstrap(boot, config).map(Some)
    }

    /// A communicator of this one's ranks except `exclude` (`ncclCommShrink`), so that a
    /// job can go on past a dead rank: every rank not excluded calls it with the same
    /// list; ranks keep their order (new rank = position among the survivors). It works
    /// on a communicator that failed or was aborted, since it needs only the bootstrap
    /// store: the process hosting the store must be alive (rank 0's for a
    /// [`UniqueId`] job; `ferrorun`'s agent for a launched one).
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        self.shrink_with(exclude, self.config.clone())
    }

    /// [`Communicator::shrink`] with other settings for the new communicator.
    pub fn shrink_with(&self, exclude: &[usize], config: CommConfig) -> Result<Communicator> {
        config.validate()?;
        let mut gone = exclude.to_vec();
        gone.sort_unstable();
        if let Some(&r) = gone.iter().find(|&&r| r >= self.nranks) {
            return Err(Error::invalid(format!(
                "shrink: excluded rank {r} is not a rank of this communicator of {} ranks",
                self.nranks
            )));
        }
        if let Some(w) = gone.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(format!(
                "shrink: rank {} excluded twice",
                w[0]
            )));
        }
        if gone.binary_search(&self.rank).is_ok() {
            return Err(Error::invalid(format!(
                "shrink: rank {} is in the exclude list it passed; excluded ranks do not \
                 call shrink",
                self.rank
            )));
        }
        let survivors: Vec<usize> = (0..self.nranks)
            .filter(|r| gone.binary_search(r).is_err())
            .collect();
        let new_rank = survivors
            .iter()
            .position(|&r| r == self.rank)
            .expect("not excluded");
        // Survivors have made the same splits and shrinks, so they agree on the
        // generation; the list is part of the rendezvous' name, so ranks passing
        // different lists never meet (they time out naming the ranks they missed).
        let generation = self.splits.fetch_add(1, Ordering::SeqCst);
        let list: Vec<String> = gone.iter().map(usize::to_string).collect();
        let store = PrefixStore::new(
            format!("shrink/{generation}/without/{}", list.join(",")),
            self.boot.store().clone(),
        );
        let boot = self.boot.sub(
            Arc::new(store),
            new_rank,
            survivors.len(),
            &config.bootstrap,
        )?;
        tracing::info!(
            "rank {}: shrunk to rank {new_rank} of {} without ranks {gone:?}",
            self.rank,
            survivors.len()
        );
        Communicator::from_bootstrap(boot, config)
    }

    /// Runs a collective over raw buffers (the C API's entry point): `count` is NCCL's
    /// count argument for `collective`, `input`/`output` are NCCL's send and receive
    /// buffers (equal, or offset as NCCL defines, for in-place calls).
    ///
    /// # Safety
    /// The buffers must hold the elements the call reads and writes
    /// ([`Collective::buffer_lens`]), stay valid and untouched by others for the call,
    /// and overlap only as an in-place call defines.
    pub unsafe fn collective_raw(
        &self,
        collective: Collective,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        input: *const u8,
        output: *mut u8,
    ) -> Result<()> {
        self.check_root_or_peer(collective)?;
        let raw = RawCall {
            collective,
            count,
            dtype,
            op,
            input,
            output,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.run(&[raw]) }
    }

    /// Runs several operations over raw buffers together, as one group (the C API's
    /// `ncclGroupStart` … `ncclGroupEnd` on one communicator): sends and receives between
    /// two ranks in one group cannot wait on each other.
    ///
    /// # Safety
    /// As [`Communicator::collective_raw`], for every call.
    pub unsafe fn group_raw(&self, calls: &[RawCall]) -> Result<()> {
        for call in calls {
            self.check_root_or_peer(call.collective)?;
        }
        if calls.is_empty() {
            return Ok(());
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.run(calls) }
    }

    /// Plans, then executes, a list of operations issued together.
    ///
    /// # Safety
    /// As [`Communicator::collective_raw`], for every operation.
    unsafe fn run(&self, raws: &[RawCall]) -> Result<()> {
        // SAFETY: forwarded; the call runs before `run` returns.
        self.turns
            .run_blocking(|| unsafe { self.run_in_turn(raws) })
    }

    /// [`Communicator::run`], once it is this call's turn.
    ///
    /// # Safety
    /// As [`Communicator::run`].
    unsafe fn run_in_turn(&self, raws: &[RawCall]) -> Result<()> {
        let mut st = self.lock();
        if let Some(why) = self.failure() {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: why.clone(),
            });
        }
        // `per_op`: each operation's choice and the scratch elements its plan needs (an
        // array for a single operation: a small call allocates nothing).
        let single: [(Choice, usize); 1];
        let group: Vec<(Choice, usize)>;
        let (fused, name, per_op): (_, _, &[(Choice, usize)]) = match raws {
            [raw] => {
                let planner = self.host_planner(st.windows.len());
                let cached = self.single_plan(planner, &mut st.host_plans, raw)?;
                single = [(cached.choice, cached.scratch_elems)];
                (None, raw.collective.name(), &single)
            }
            _ => {
                let (fused, choices) =
                    self.fused_plan(self.host_planner(st.windows.len()), raws)?;
                group = choices
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| (c, fused.scratch_elems(i)))
                    .collect();
                (Some(fused), "group", &group)
            }
        };
        // The scratch memory the plan asks for, 8-byte aligned for every element type,
        // carved from the communicator's scratch buffer (kept between calls up to
        // `KEPT_SCRATCH_WORDS`, so that repeated calls do not allocate).
        let words = |(raw, &(_, elems)): (&RawCall, &(Choice, usize))| {
            (elems * raw.dtype.size()).div_ceil(8)
        };
        let total: usize = raws.iter().zip(per_op).map(words).sum();
        let (stores, sample) = self.stores_for(&mut st.store_trial, raws);
        if st.scratch.len() < total {
            st.scratch = vec![0u64; total];
        }
        let mut next_scratch = st.scratch.as_mut_ptr();
        let ranks_per_cpu = st.conns.crowding().per_cpu();
        let mut make_op =
            |raw: &RawCall, &(choice, elems): &(Choice, usize)| -> Result<OpBuffers> {
                let mut scratch = std::ptr::null_mut();
                if elems > 0 {
                    scratch = next_scratch as *mut u8;
                    // SAFETY: the buffer holds `total` words, the sum of every operation's.
                    next_scratch = unsafe { next_scratch.add(words((raw, &(choice, elems)))) };
                }
                self.op_buffers(raw, choice, scratch, stores, ranks_per_cpu)
            };
        let one_op: [OpBuffers; 1];
        let many_ops: Vec<OpBuffers>;
        let ops: &[OpBuffers] = match raws {
            [raw] => {
                one_op = [make_op(raw, &per_op[0])?];
                &one_op
            }
            _ => {
                many_ops = raws
                    .iter()
                    .zip(per_op)
                    .map(|(raw, p)| make_op(raw, p))
                    .collect::<Result<_>>()?;
                &many_ops
            }
        };
        let call = CallInfo {
            op: name,
            seq: st.seq,
            timeout: self.config.timeout,
        };
        let _span = self.call_span(&call, raws, per_op).entered();
        st.seq += 1;
        let st = &mut *st;
        // SAFETY: the buffers are valid as the caller promised, and the scratch memory
        // (the communicator's buffer, which nothing else touches or resizes until the
        // call returns); the plan's regions stay inside them because the plan was made
        // from the same counts.
        let started = sample.map(|s| (s, Instant::now()));
        let result = unsafe { Self::connect_and_execute(st, fused.as_ref(), ops, &call) };
        if let (Ok(()), Some((sample, started))) = (&result, started) {
            self.record_stores(&mut st.store_trial, sample, started.elapsed());
        }
        if st.scratch.len() > KEPT_SCRATCH_WORDS {
            st.scratch = Vec::new();
        }
        // Rebuilt rather than moved: a moved `Result` is copied whole (the size of
        // `Error`) with wide loads of a value whose `Ok` wrote only its tag, a
        // store-forwarding stall that cost a fifth of a 1-rank 8-byte call (`perf annotate`).
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                self.fail_after(&mut st.conns, &e);
                Err(e)
            }
        }
    }

    /// Runs a host call's plan: `fused`, or the current single-operation plan (the one
    /// the call found or made). The first call of a plan makes the FIFOs it needs beyond
    /// the rings'.
    ///
    /// # Safety
    /// As [`engine::execute`], for the plan and `ops`.
    unsafe fn connect_and_execute(
        st: &mut State,
        fused: Option<&Plan>,
        ops: &[OpBuffers],
        call: &CallInfo,
    ) -> Result<()> {
        let plan = match fused {
            Some(fused) => fused,
            None => &st.host_plans.current().expect("planned above").plan,
        };
        let cached = match fused {
            Some(_) => None,
            None => st.host_plans.current(),
        };
        if !cached.is_some_and(|c| c.connected) {
            engine::connect_for(plan, ops, &mut st.conns, call)?;
        }
        let schedule = cached
            .and_then(|c| c.schedule)
            .unwrap_or_else(|| engine::Schedule::of(plan, ops, &st.conns));
        // SAFETY: forwarded from this function's contract.
        unsafe { engine::execute(schedule, plan, ops, &mut st.conns, call) }?;
        if fused.is_none()
            && let Some(c) = st.host_plans.current_mut()
        {
            c.connected = true;
            c.schedule = Some(schedule);
        }
        Ok(())
    }

    /// Whether a host call of `raws` writes past the caches what it may (slots towards
    /// far peers, large results), and whether it is timed to choose that for calls of its
    /// size.
    fn stores_for(&self, trial: &mut StoreTrial, raws: &[RawCall]) -> (Stores, Option<Sample>) {
        match self.config.slot_stores {
            SlotStores::Auto => trial.next(raws.iter().map(|r| r.count * r.dtype.size()).sum()),
            SlotStores::Plain | SlotStores::Streaming => (Stores::NonTemporal, None),
        }
    }

    /// Records a timed call in the store trial, and logs the trial's verdict when it
    /// changes the way.
    fn record_stores(&self, trial: &mut StoreTrial, sample: Sample, elapsed: Duration) {
        if let Some(v) = trial.record(sample, elapsed)
            && v.changed
        {
            tracing::debug!("rank {}: {v}", self.rank);
        }
    }

    /// The buffers and kernels of one operation of a host call (`scratch`: its part of
    /// the call's scratch memory, or null; `stores`: whether the call may write past
    /// the caches what it would).
    #[inline]
    fn op_buffers(
        &self,
        raw: &RawCall,
        choice: Choice,
        scratch: *mut u8,
        stores: Stores,
        ranks_per_cpu: usize,
    ) -> Result<OpBuffers> {
        let (reducing, op) = raw.reduction();
        let plain = match op {
            ReduceOp::PreMulSum(_) => ReduceOp::Sum,
            other => other,
        };
        let streaming = match raw.result_streaming(self.rank, self.nranks, ranks_per_cpu) {
            ResultStreaming::Never => false,
            ResultStreaming::Always => true,
            ResultStreaming::AsTried => stores.streams_results(),
        };
        Ok(OpBuffers {
            input: raw.input,
            output: raw.output,
            kernel: Kernel::new(raw.dtype, op, self.nranks)?,
            plain: Kernel::new(raw.dtype, plain, self.nranks)?,
            reducing,
            scratch,
            protocol: choice.protocol,
            streaming,
            may_stream_slots: stores.streams_slots(),
            write_back: choice.algorithm == Algorithm::TwoShot
                && choice.protocol == Protocol::SingleCopy
                && raw.collective == Collective::AllReduce,
        })
    }

    /// The trace span of a call (a group shows its operations' choice when they all made
    /// the same one).
    fn call_span(
        &self,
        call: &CallInfo,
        raws: &[RawCall],
        per_op: &[(Choice, usize)],
    ) -> tracing::Span {
        let same = |f: fn(&Choice) -> &'static str| -> &'static str {
            let first = f(&per_op[0].0);
            if per_op.iter().all(|(c, _)| f(c) == first) {
                first
            } else {
                "mixed"
            }
        };
        tracing::trace_span!(
            target: crate::trace::TRACE_TARGET,
            "collective",
            rank = self.rank,
            op = call.op,
            seq = call.seq,
            bytes = raws.iter().map(|r| r.count * r.dtype.size()).sum::<usize>(),
            algorithm = same(|c| c.algorithm.name()),
            protocol = same(|c| c.protocol.name()),
        )
    }

    /// Aborts the communicator after a host call failed with `e` while moving data, and
    /// tells the peers which rank failed first, as far as this rank knows: the one it
    /// saw fail, the stalled one its wait led to, or the one it timed out waiting for.
    fn fail_after(&self, conns: &mut Connections, e: &Error) {
        self.set_failure(match e {
            Error::Aborted { reason, .. } => reason.clone(),
            other => other.to_string(),
        });
        conns.close(engine::closed_after(e));
        tracing::warn!("rank {}: {e}; communicator aborted", self.rank);
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.nranks {
            return Err(Error::invalid(format!(
                "{op}: root {root} is not a rank of this communicator (0..{})",
                self.nranks
            )));
        }
        Ok(())
    }

    fn check_root_or_peer(&self, collective: Collective) -> Result<()> {
        match collective {
            Collective::Send { peer } | Collective::Recv { peer } => {
                self.check_peer(collective.name(), peer)
            }
            c => c
                .root()
                .map_or(Ok(()), |root| self.check_root(c.name(), root)),
        }
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.nranks {
            return Err(Error::invalid(format!(
                "{op}: peer {peer} is not a rank of this communicator (0..{})",
                self.nranks
            )));
        }
        Ok(())
    }

    fn times_size(
        &self,
        op: &str,
        big: &str,
        big_len: usize,
        small: &str,
        small_len: usize,
    ) -> Result<()> {
        if big_len != small_len * self.nranks {
            return Err(Error::invalid(format!(
                "{op}: {big} has {big_len} elements but must have {} ({small}'s {small_len} \
                 x {} ranks)",
                small_len * self.nranks,
                self.nranks
            )));
        }
        Ok(())
    }

    fn block_of(&self, op: &str, len: usize) -> Result<usize> {
        if !len.is_multiple_of(self.nranks) {
            return Err(Error::invalid(format!(
                "{op}: buffer of {len} elements does not split into {} equal blocks",
                self.nranks
            )));
        }
        Ok(len / self.nranks)
    }
}

fn same_len(op: &str, a: &str, a_len: usize, b: &str, b_len: usize) -> Result<()> {
    if a_len != b_len {
        return Err(Error::invalid(format!(
            "{op}: {a} has {a_len} elements but {b} has {b_len}; they must be equal"
        )));
    }
    Ok(())
}

fn check_len(c: Collective, what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::invalid(format!(
            "{}: {what} has {have} elements, the call needs {need}",
            c.name()
        )));
    }
    Ok(())
}

/// Operations issued together on one communicator; see [`Communicator::group`]. The
/// buffers stay borrowed until [`Group::end`].
pub struct Group<'c, 'b> {
    comm: &'c Communicator,
    ops: Vec<RawCall>,
    _buffers: PhantomData<&'b mut [u8]>,
}

impl<'b> Group<'_, 'b> {
    /// Adds a send of `buf` to `peer`.
    pub fn send<T: Element>(&mut self, buf: &'b [T], peer: usize) -> Result<&mut Self> {
        self.comm.check_peer("send", peer)?;
        self.ops.push(RawCall {
            collective: Collective::Send { peer },
            count: buf.len(),
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            input: buf.as_ptr() as *const u8,
            output: std::ptr::null_mut(),
        });
        Ok(self)
    }

    /// Adds a receive into `buf` from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &'b mut [T], peer: usize) -> Result<&mut Self> {
        self.comm.check_peer("recv", peer)?;
        self.ops.push(RawCall {
            collective: Collective::Recv { peer },
            count: buf.len(),
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            input: std::ptr::null(),
            output: buf.as_mut_ptr() as *mut u8,
        });
        Ok(self)
    }

    /// Adds an all-reduce.
    pub fn all_reduce<T: Element>(
        &mut self,
        send: &'b [T],
        recv: &'b mut [T],
        op: ReduceOp,
    ) -> Result<&mut Self> {
        same_len("all_reduce", "send", send.len(), "recv", recv.len())?;
        self.ops.push(RawCall {
            collective: Collective::AllReduce,
            count: send.len(),
            dtype: T::DTYPE,
            op,
            input: send.as_ptr() as *const u8,
            output: recv.as_mut_ptr() as *mut u8,
        });
        Ok(self)
    }

    /// Runs every operation of the group together.
    pub fn end(self) -> Result<()> {
        if self.ops.is_empty() {
            return Ok(());
        }
        // SAFETY: every buffer is borrowed for 'b, which outlives this call, with the
        // length its operation uses.
        unsafe { self.comm.run(&self.ops) }
    }
}

/// Whether some host's ranks outnumber its cores (the same on every rank): its FIFOs are
/// then short, and so are the host calls' Simple ring steps (device calls have FIFOs of
/// their own). Says so at `FERROCCL_DEBUG=INFO` when that shortens the steps.
fn crowded_ring_steps(rank: usize, config: &CommConfig, conns: &Connections) -> bool {
    let crowded = conns.crowding().outnumbered();
    let step = config.chunk_bytes_for(Protocol::Simple, crowded);
    if step < config.chunk_bytes {
        tracing::info!(
            "rank {rank}: ranks outnumber the cores of a host: ring steps of {step} B, half \
             of its FIFOs of {} slots (FERROCCL_SLOTS sets them)",
            config.crowded_slots
        );
    }
    crowded
}

#[cfg(test)]
mod tests;
