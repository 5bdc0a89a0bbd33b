//! The NCCL C ABI: every function of `include/nccl.h` (NCCL 2.21's API plus 2.28's
//! all-to-all, gather and scatter), exported from the cdylib under NCCL's names and
//! their `pnccl*` twins, so a program built against NCCL links to `libferroccl.so`
//! installed as `libnccl.so.2` and runs unchanged.
//!
//! ferroccl's collectives run on host memory: with host pointers and a NULL stream every
//! call has completed when it returns. A non-NULL stream is synchronised first (through
//! the CUDA driver, loaded at run time) so host-memory calls keep the stream's order;
//! device pointers are refused with `ncclInvalidUsage` until the CUDA path exists.
//!
//! Every entry point checks its arguments (NULL, out-of-range ranks, types and ops,
//! handles that are not live communicators, counts that overflow), catches panics, and
//! on failure returns NCCL's code for it and leaves a message for `ncclGetLastError`
//! (per thread). Calls between `ncclGroupStart` and `ncclGroupEnd` are queued per
//! thread and run when the outermost group ends ([`group`]).

#![allow(non_snake_case)]

pub mod group;
pub mod handle;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock};

use crate::bootstrap::{UNIQUE_ID_BYTES, UniqueId};
use crate::comm::{CommConfig, Communicator, RawCall};
use crate::cuda::{self, PointerKind};
use crate::error::Error;
use crate::lock;
use crate::plan::Collective;
use crate::types::{DataType, ReduceOp, Scalar};
use handle::{CommHandle, Life, UserOp};

/// `ncclSuccess`.
pub const SUCCESS: c_int = 0;
/// `ncclUnhandledCudaError`: a CUDA call failed, or CUDA is missing.
pub const UNHANDLED_CUDA_ERROR: c_int = 1;
/// `ncclSystemError`: the network, the store or the operating system failed.
pub const SYSTEM_ERROR: c_int = 2;
/// `ncclInternalError`: a bug in ferroccl (a caught panic).
pub const INTERNAL_ERROR: c_int = 3;
/// `ncclInvalidArgument`.
pub const INVALID_ARGUMENT: c_int = 4;
/// `ncclInvalidUsage`: a valid call at the wrong time, or something ferroccl cannot do.
pub const INVALID_USAGE: c_int = 5;
/// `NCCL_SHRINK_ABORT`: `ncclCommShrink` aborts the parent first.
pub const SHRINK_ABORT: c_int = 1;
/// `ncclRemoteError`: a peer failed, left or timed out.
pub const REMOTE_ERROR: c_int = 6;
/// `ncclInProgress`.
pub const IN_PROGRESS: c_int = 7;
/// `ncclNumOps`: the first value of ops made by `ncclRedOpCreatePreMulSum`.
pub const NUM_OPS: c_int = 5;
/// The `NCCL_VERSION_CODE` of `include/nccl.h` (2.28.0).
pub const VERSION_CODE: c_int = 22800;

/// An error as the C API returns it: the code, and the message for `ncclGetLastError`.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The `ncclResult_t`.
    pub code: c_int,
    /// What went wrong.
    pub message: String,
}

impl Failure {
    /// A failure with `code`.
    pub fn new(code: c_int, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// The failure for a ferroccl error.
    pub fn from_error(e: &Error) -> Self {
        Failure::new(result_of(e), e.to_string())
    }
}

/// NCCL's result code for a ferroccl error.
pub fn result_of(e: &Error) -> c_int {
    match e {
        Error::InvalidArgument { .. }
        | Error::Env { .. }
        | Error::KeyTooLong { .. }
        | Error::ValueTooLarge { .. } => INVALID_ARGUMENT,
        Error::Unsupported { .. } => INVALID_USAGE,
        Error::Cuda { .. } => UNHANDLED_CUDA_ERROR,
        Error::Aborted { reason, .. } if reason == crate::error::ABORTED_BY_USER => INVALID_USAGE,
        Error::PeerFailed { .. }
        | Error::Timeout { .. }
        | Error::Aborted { .. }
        | Error::BootstrapTimeout { .. }
        | Error::BootstrapData { .. } => REMOTE_ERROR,
        _ => SYSTEM_ERROR,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(function: &str, message: &str) {
    let text = format!("{function}: {message}").replace('\0', " ");
    tracing::warn!("{text}");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
}

/// Runs an entry point's body: catches panics, and records failures for
/// `ncclGetLastError`.
fn api(function: &str, body: impl FnOnce() -> Result<c_int, Failure>) -> c_int {
    crate::trace::init_from_env();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => code,
        Ok(Err(f)) => {
            set_last_error(function, &f.message);
            f.code
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            set_last_error(function, &format!("internal error: {what}"));
            INTERNAL_ERROR
        }
    }
}

/// [`api`] for calls a group can hold (collectives, point-to-point, init): inside a
/// group, one that fails its checks fails the whole group.
fn group_api(function: &str, body: impl FnOnce() -> Result<c_int, Failure>) -> c_int {
    api(function, || {
        let r = body();
        if let Err(f) = &r {
            group::fail(f);
        }
        r
    })
}

/// A root or peer argument, which must not be negative (its range is checked against
/// the communicator later).
fn index_arg(value: c_int, what: &str) -> Result<usize, Failure> {
    usize::try_from(value).map_err(|_| invalid(format!("{what} {value} is negative")))
}

fn invalid(message: impl Into<String>) -> Failure {
    Failure::new(INVALID_ARGUMENT, message)
}

fn dtype_of(value: c_int) -> Result<DataType, Failure> {
    DataType::from_nccl(value).map_err(|e| Failure::from_error(&e))
}

/// Reads one element of `dtype` at `ptr` as a pre-mul-sum scalar.
///
/// # Safety
/// `ptr` is NULL or points to one readable element of `dtype`.
pub unsafe fn read_scalar(ptr: *const c_void, dtype: DataType) -> Result<Scalar, Failure> {
    if ptr.is_null() {
        return Err(invalid("scalar is NULL"));
    }
    if cuda::pointer_kind(ptr) == PointerKind::Device {
        return Err(Failure::new(
            INVALID_USAGE,
            "the pre-mul-sum scalar is in device memory: ferroccl reads the scalar on the \
             host (when the op is made, or at each call for ncclScalarDevice), so it must be \
             in host memory",
        ));
    }
    // SAFETY: the caller promised one readable element of `dtype`.
    let scalar = unsafe {
        match dtype {
            DataType::Int8 => Scalar::Int(std::ptr::read_unaligned(ptr as *const i8).into()),
            DataType::Int32 => Scalar::Int(std::ptr::read_unaligned(ptr as *const i32).into()),
            DataType::Int64 => Scalar::Int(std::ptr::read_unaligned(ptr as *const i64)),
            DataType::Uint8 => Scalar::Uint(std::ptr::read_unaligned(ptr as *const u8).into()),
            DataType::Uint32 => Scalar::Uint(std::ptr::read_unaligned(ptr as *const u32).into()),
            DataType::Uint64 => Scalar::Uint(std::ptr::read_unaligned(ptr as *const u64)),
            float => crate::with_element_type!(float, T => {
                Scalar::Float(crate::types::Element::to_f64(std::ptr::read_unaligned(ptr as *const T)))
            }),
        }
    };
    Ok(scalar)
}

/// Checks and runs (or queues, inside a group) one collective or point-to-point call.
///
/// # Safety
/// The buffers must be valid for the call as NCCL defines it.
#[allow(clippy::too_many_arguments)]
unsafe fn collective(
    comm: *mut c_void,
    collective: Collective,
    count: usize,
    datatype: c_int,
    op: Option<c_int>,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    stream: *mut c_void,
) -> Result<c_int, Failure> {
    let handle = CommHandle::find(comm)?;
    let dtype = dtype_of(datatype)?;
    // Known from the init call, even while a deferred initialisation is pending.
    let (rank, nranks) = (handle.rank, handle.nranks);
    if let Some(r) = collective.root() {
        let what = if matches!(
            collective,
            Collective::Send { .. } | Collective::Recv { .. }
        ) {
            "peer"
        } else {
            "root"
        };
        if r >= nranks {
            return Err(invalid(format!(
                "{what} {r} is not a rank of this communicator (0..{nranks})"
            )));
        }
    }
    let bytes = count
        .checked_mul(nranks)
        .and_then(|n| n.checked_mul(dtype.size()))
        .filter(|&b| b <= isize::MAX as usize);
    if bytes.is_none() {
        return Err(invalid(format!(
            "count {count} of {dtype} on {nranks} ranks overflows the address space"
        )));
    }
    let (in_len, out_len) = collective.buffer_lens(count, rank, nranks);
    if in_len > 0 && sendbuff.is_null() {
        return Err(invalid(format!("sendbuff is NULL for {count} elements")));
    }
    if out_len > 0 && recvbuff.is_null() {
        return Err(invalid(format!("recvbuff is NULL for {count} elements")));
    }
    // Device memory (either buffer): enqueued on the stream. Host memory: run now, in
    // the stream's order. A buffer the call does not use (a reduce's recvbuff off the
    // root, an empty one) is not asked about: it may point anywhere, as with NCCL.
    let used = |p: *const c_void, len: usize| if len > 0 { p } else { std::ptr::null() };
    let kinds = [
        ("sendbuff", used(sendbuff, in_len)),
        ("recvbuff", used(recvbuff as *const c_void, out_len)),
    ]
    .map(|(name, p)| (name, p, cuda::pointer_kind(p)));
    let on_device = kinds.iter().any(|k| k.2 == PointerKind::Device);
    if on_device
        && let Some((name, p, _)) = kinds
            .iter()
            .find(|k| !k.1.is_null() && k.2 != PointerKind::Device)
    {
        return Err(invalid(format!(
            "{name} {p:?} is host memory while the other buffer is CUDA device memory: \
             both must be on the device"
        )));
    }
    let op = match op {
        Some(op) => handle.reduce_op(op, dtype)?,
        None => ReduceOp::Sum,
    };
    if !stream.is_null() && !on_device {
        // SAFETY: the caller's stream handle, as NCCL takes it.
        unsafe { cuda::synchronize(stream) }.map_err(|e| Failure::from_error(&e))?;
    }
    let call = RawCall {
        collective,
        count,
        dtype,
        op,
        input: sendbuff as *const u8,
        output: recvbuff as *mut u8,
    };
    let device_call = if on_device {
        // SAFETY: the caller's stream, as NCCL takes it.
        let ctx =
            unsafe { cuda::Context::of_stream(stream) }.map_err(|e| Failure::from_error(&e))?;
        Some((stream as usize, ctx))
    } else {
        None
    };
    if group::queue_call(&handle, call, device_call) {
        return Ok(SUCCESS);
    }
    let comm = handle.communicator()?;
    if on_device {
        // SAFETY: the caller's device buffers, valid until the stream passes the call
        // (NCCL's contract), and the caller's stream.
        unsafe { comm.enqueue_device(&[call], stream) }.map_err(|e| Failure::from_error(&e))?;
        return Ok(SUCCESS);
    }
    // SAFETY: the buffers are the caller's, valid for the call as NCCL defines it.
    unsafe { comm.collective_raw(collective, count, dtype, op, call.input, call.output) }
        .map_err(|e| Failure::from_error(&e))?;
    Ok(SUCCESS)
}

fn rank_arg(value: c_int, nranks: usize, what: &str) -> Result<usize, Failure> {
    usize::try_from(value)
        .ok()
        .filter(|&r| r < nranks)
        .ok_or_else(|| invalid(format!("{what} {value} is not in 0..{nranks}")))
}

/// One `ncclMemAlloc` allocation.
enum Allocation {
    /// Shared host memory (no CUDA context was current), which windows can be made of
    /// (unmapped on drop, unless a window still holds it).
    Host(#[allow(dead_code)] crate::transport::window::SharedMemory),
    /// Device memory of the context that was current (freed on drop).
    Device(#[allow(dead_code)] cuda::DeviceBuffer),
}

/// `ncclMemAlloc` allocations: address → allocation.
fn allocations() -> &'static Mutex<HashMap<usize, Allocation>> {
    static ALLOCATIONS: OnceLock<Mutex<HashMap<usize, Allocation>>> = OnceLock::new();
    ALLOCATIONS.get_or_init(Default::default)
}

/// Device memory for `ncclMemAlloc` when a CUDA context is current on this thread (as
/// NCCL allocates on the current device), else `None`.
fn device_allocation(size: usize) -> Result<Option<cuda::DeviceBuffer>, Failure> {
    if cuda::driver().is_err() {
        return Ok(None);
    }
    match cuda::current_context() {
        Ok(Some(_)) => cuda::DeviceBuffer::zeroed(size.max(1))
            .map(Some)
            .map_err(|e| Failure::from_error(&e)),
        Ok(None) | Err(_) => Ok(None),
    }
}

/// Joins a communicator now, later in the group, or in the background.
fn init_rank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: &NcclUniqueId,
    rank: c_int,
    config: *const c_void,
) -> Result<c_int, Failure> {
    if comm.is_null() {
        return Err(invalid("comm (the output pointer) is NULL"));
    }
    let nranks = usize::try_from(nranks)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid(format!("nranks {nranks} must be at least 1")))?;
    let rank = rank_arg(rank, nranks, "rank")?;
    // SAFETY: the caller passes NULL or a config initialised with NCCL_CONFIG_INITIALIZER
    // (checked through its magic).
    let settings = unsafe { handle::read_config(config) }?;
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (b, c) in bytes.iter_mut().zip(id.internal) {
        *b = c as u8;
    }
    let id = UniqueId::from_bytes(&bytes).map_err(|e| Failure::from_error(&e))?;
    let config = settings.apply(CommConfig::from_env().map_err(|e| Failure::from_error(&e))?);
    let join = move || Communicator::init_rank_with(&id, nranks, rank, config);
    if group::in_group() {
        // Run with the other ranks' inits when the group ends.
        let (handle, ptr) =
            CommHandle::register(Life::Initializing, settings.nonblocking, rank, nranks);
        group::queue_init(handle, Box::new(join));
        // SAFETY: `comm` is non-NULL (checked) and points to the caller's ncclComm_t.
        unsafe { *comm = ptr };
        return Ok(SUCCESS);
    }
    if settings.nonblocking {
        let (handle, ptr) = CommHandle::register(Life::Initializing, true, rank, nranks);
        if let Err(e) = std::thread::Builder::new()
            .name(format!("ferroccl-init-r{rank}"))
            .spawn(move || handle.finish_init(group::run_init(Box::new(join))))
        {
            CommHandle::unregister(ptr);
            return Err(Failure::new(
                SYSTEM_ERROR,
                format!("start the init thread: {e}"),
            ));
        }
        // SAFETY: as above.
        unsafe { *comm = ptr };
        return Ok(IN_PROGRESS);
    }
    let c = join().map_err(|e| Failure::from_error(&e))?;
    let (_, ptr) = CommHandle::register(Life::Ready(c.into()), false, rank, nranks);
    // SAFETY: as above.
    unsafe { *comm = ptr };
    Ok(SUCCESS)
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    /// The bytes.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// Exports each function under NCCL's name and under its `pnccl` twin.
macro_rules! nccl_api {
    ($(
        $(#[$doc:meta])*
        fn $name:ident / $twin:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty $body:block
    )*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// Pointer arguments must be as NCCL documents for this function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret $body

        #[doc = concat!("[`", stringify!($name), "`] under NCCL's profiling name.")]
        ///
        /// # Safety
        #[doc = concat!("As [`", stringify!($name), "`].")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $twin($($arg: $ty),*) -> $ret {
            // SAFETY: the same contract.
            unsafe { $name($($arg),*) }
        }
    )*};
}

nccl_api! {
    /// `ncclGetVersion`: the version this library implements (2.28.0 → 22800).
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) -> c_int {
        api("ncclGetVersion", || {
            if version.is_null() {
                return Err(invalid("version is NULL"));
            }
            // SAFETY: non-NULL, the caller's int.
            unsafe { *version = VERSION_CODE };
            Ok(SUCCESS)
        })
    }

    /// `ncclGetUniqueId`: starts this job's rendezvous server in this process and
    /// returns its id.
    fn ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut NcclUniqueId) -> c_int {
        api("ncclGetUniqueId", || {
            if unique_id.is_null() {
                return Err(invalid("uniqueId is NULL"));
            }
            let id = UniqueId::new().map_err(|e| Failure::from_error(&e))?;
            let mut out = NcclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
            for (o, b) in out.internal.iter_mut().zip(id.as_bytes()) {
                *o = *b as c_char;
            }
            // SAFETY: non-NULL, the caller's ncclUniqueId.
            unsafe { *unique_id = out };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommInitRankConfig`: joins a communicator with an `ncclConfig_t`.
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(
        comm: *mut *mut c_void,
        nranks: c_int,
        comm_id: NcclUniqueId,
        rank: c_int,
        config: *mut c_void,
    ) -> c_int {
        group_api("ncclCommInitRankConfig", || init_rank(comm, nranks, &comm_id, rank, config))
    }

    /// `ncclCommInitRank`: joins a communicator (blocking).
    fn ncclCommInitRank / pncclCommInitRank(
        comm: *mut *mut c_void,
        nranks: c_int,
        comm_id: NcclUniqueId,
        rank: c_int,
    ) -> c_int {
        group_api("ncclCommInitRank", || init_rank(comm, nranks, &comm_id, rank, std::ptr::null()))
    }

    /// `ncclCommInitAll`: `ndev` ranks in this process; `comm[i]` is rank `i`. The
    /// device list is ignored: host communicators use no devices.
    fn ncclCommInitAll / pncclCommInitAll(
        comm: *mut *mut c_void,
        ndev: c_int,
        devlist: *const c_int,
    ) -> c_int {
        api("ncclCommInitAll", || {
            if comm.is_null() {
                return Err(invalid("comm (the output array) is NULL"));
            }
            let n = usize::try_from(ndev)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| invalid(format!("ndev {ndev} must be at least 1")))?;
            // Rank i's GPU: devlist[i], or i for a NULL list (as NCCL).
            let devices: Vec<usize> = if devlist.is_null() {
                (0..n).collect()
            } else {
                // SAFETY: the caller's list has `ndev` entries.
                unsafe { std::slice::from_raw_parts(devlist, n) }
                    .iter()
                    .map(|&d| {
                        usize::try_from(d).map_err(|_| invalid(format!("devlist has GPU {d}")))
                    })
                    .collect::<Result<_, _>>()?
            };
            // Where the application uses CUDA, each rank joins with its GPU current, so
            // that device calls are tuned for the GPUs; a host-only program loads no
            // driver for this.
            let bind = |rank: usize| {
                if cuda::driver_loaded() {
                    cuda::bind_device(devices[rank])?;
                }
                Ok(())
            };
            let config = CommConfig::from_env().map_err(|e| Failure::from_error(&e))?;
            let comms = Communicator::init_all_on(n, config, &bind)
                .map_err(|e| Failure::from_error(&e))?;
            for (i, c) in comms.into_iter().enumerate() {
                let (_, ptr) = CommHandle::register(Life::Ready(c.into()), false, i, n);
                // SAFETY: the caller's array has `ndev` entries.
                unsafe { *comm.add(i) = ptr };
            }
            Ok(SUCCESS)
        })
    }

    /// `ncclCommFinalize`: after it, only `ncclCommDestroy` is allowed. Calls have all
    /// completed when they return, so nothing is left to flush.
    fn ncclCommFinalize / pncclCommFinalize(comm: *mut c_void) -> c_int {
        api("ncclCommFinalize", || {
            let handle = CommHandle::find(comm)?;
            let c = handle.communicator()?;
            *lock(&handle.life) = Life::Finalized(c);
            Ok(SUCCESS)
        })
    }

    /// `ncclCommDestroy`: releases the communicator; peers still waiting on this rank
    /// learn that it left.
    fn ncclCommDestroy / pncclCommDestroy(comm: *mut c_void) -> c_int {
        api("ncclCommDestroy", || {
            let handle = CommHandle::find(comm)?;
            if matches!(*lock(&handle.life), Life::Initializing) {
                return Err(Failure::new(
                    INVALID_USAGE,
                    "the communicator is still initialising: wait for ncclCommGetAsyncError \
                     to leave ncclInProgress (or abort it)",
                ));
            }
            CommHandle::unregister(comm);
            *lock(&handle.life) = Life::Failed(INVALID_USAGE, "destroyed".into());
            Ok(SUCCESS)
        })
    }

    /// `ncclCommAbort`: stops the communicator at once (a call blocked in another
    /// thread fails) and releases it; peers waiting on this rank fail, naming it.
    fn ncclCommAbort / pncclCommAbort(comm: *mut c_void) -> c_int {
        api("ncclCommAbort", || {
            let handle = CommHandle::find(comm)?;
            CommHandle::unregister(comm);
            let life = std::mem::replace(
                &mut *lock(&handle.life),
                Life::Failed(INVALID_USAGE, "aborted".into()),
            );
            if let Life::Ready(c) | Life::Finalized(c) = life {
                c.abort();
            }
            Ok(SUCCESS)
        })
    }

    /// `ncclCommSplit`: ranks with the same color form a new communicator ordered by
    /// key; `NCCL_SPLIT_NOCOLOR` (-1) takes part and gets NULL.
    fn ncclCommSplit / pncclCommSplit(
        comm: *mut c_void,
        color: c_int,
        key: c_int,
        newcomm: *mut *mut c_void,
        config: *mut c_void,
    ) -> c_int {
        api("ncclCommSplit", || {
            let handle = CommHandle::find(comm)?;
            if newcomm.is_null() {
                return Err(invalid("newcomm is NULL"));
            }
            let color = match color {
                -1 => None,
                c if c >= 0 => Some(c as u32),
                c => {
                    return Err(invalid(format!(
                        "color {c}: use a non-negative color or NCCL_SPLIT_NOCOLOR (-1)"
                    )));
                }
            };
            if group::in_group() {
                // Every member must take part at once; one thread driving several ranks
                // would wait for ranks it has not called yet.
                return Err(Failure::new(
                    INVALID_USAGE,
                    "ncclCommSplit inside ncclGroupStart/ncclGroupEnd is not supported: call \
                     it outside a group (one thread per rank)",
                ));
            }
            // SAFETY: NULL or the caller's initialised config.
            let settings = unsafe { handle::read_config(config) }?;
            let c = handle.communicator()?;
            let config = settings.apply(c.config().clone());
            let out = match c
                .split_with(color, key, config)
                .map_err(|e| Failure::from_error(&e))?
            {
                Some(sub) => {
                    let (rank, n) = (sub.rank(), sub.size());
                    CommHandle::register(Life::Ready(sub.into()), settings.nonblocking, rank, n).1
                }
                None => std::ptr::null_mut(),
            };
            // SAFETY: non-NULL, the caller's ncclComm_t.
            unsafe { *newcomm = out };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommShrink` (NCCL 2.27): a communicator of the ranks not in
    /// `excludeRanksList`, for going on after a rank failed; every surviving rank calls
    /// it with the same list. `NCCL_SHRINK_ABORT` (1) in `shrinkFlags` first aborts
    /// `comm`, so that calls of other threads still waiting on it fail at once.
    fn ncclCommShrink / pncclCommShrink(
        comm: *mut c_void,
        exclude_ranks_list: *mut c_int,
        exclude_ranks_count: c_int,
        newcomm: *mut *mut c_void,
        config: *mut c_void,
        shrink_flags: c_int,
    ) -> c_int {
        api("ncclCommShrink", || {
            let handle = CommHandle::find(comm)?;
            if newcomm.is_null() {
                return Err(invalid("newcomm is NULL"));
            }
            let count = usize::try_from(exclude_ranks_count).map_err(|_| {
                invalid(format!("excludeRanksCount {exclude_ranks_count} is negative"))
            })?;
            if count > 0 && exclude_ranks_list.is_null() {
                return Err(invalid(format!(
                    "excludeRanksList is NULL with excludeRanksCount {count}"
                )));
            }
            if shrink_flags & !SHRINK_ABORT != 0 {
                return Err(invalid(format!(
                    "shrinkFlags {shrink_flags:#x}: only NCCL_SHRINK_DEFAULT (0) and \
                     NCCL_SHRINK_ABORT (1) exist"
                )));
            }
            if group::in_group() {
                return Err(Failure::new(
                    INVALID_USAGE,
                    "ncclCommShrink inside ncclGroupStart/ncclGroupEnd is not supported",
                ));
            }
            let exclude: Vec<usize> = if count == 0 {
                Vec::new()
            } else {
                // SAFETY: non-NULL, and the caller's array of `count` ints.
                unsafe { std::slice::from_raw_parts(exclude_ranks_list, count) }
                    .iter()
                    .map(|&r| {
                        usize::try_from(r)
                            .map_err(|_| invalid(format!("excluded rank {r} is negative")))
                    })
                    .collect::<Result<_, _>>()?
            };
            // SAFETY: NULL or the caller's initialised config.
            let settings = unsafe { handle::read_config(config) }?;
            // A failed communicator can still shrink: it needs only its bootstrap.
            let c = handle.any_communicator()?;
            if shrink_flags & SHRINK_ABORT != 0 {
                c.abort();
            }
            let config = settings.apply(c.config().clone());
            let sub = c
                .shrink_with(&exclude, config)
                .map_err(|e| Failure::from_error(&e))?;
            let (rank, n) = (sub.rank(), sub.size());
            let out = CommHandle::register(Life::Ready(sub.into()), settings.nonblocking, rank, n).1;
            // SAFETY: non-NULL, the caller's ncclComm_t.
            unsafe { *newcomm = out };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommGetAsyncError`: `ncclInProgress` while a non-blocking init runs, then
    /// its outcome; the code of the failure once a call failed.
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(
        comm: *mut c_void,
        async_error: *mut c_int,
    ) -> c_int {
        api("ncclCommGetAsyncError", || {
            let handle = CommHandle::find(comm)?;
            if async_error.is_null() {
                return Err(invalid("asyncError is NULL"));
            }
            let (code, why) = handle.async_error_and_reason();
            if let Some(why) = why {
                // As NCCL does: ncclGetLastError then says what failed.
                set_last_error("ncclCommGetAsyncError", &why);
            }
            // SAFETY: non-NULL, the caller's ncclResult_t.
            unsafe { *async_error = code };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommCount`: the number of ranks.
    fn ncclCommCount / pncclCommCount(comm: *const c_void, count: *mut c_int) -> c_int {
        api("ncclCommCount", || {
            let handle = CommHandle::find(comm)?;
            if count.is_null() {
                return Err(invalid("count is NULL"));
            }
            // SAFETY: non-NULL, the caller's int.
            unsafe { *count = handle.nranks as c_int };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommUserRank`: this rank.
    fn ncclCommUserRank / pncclCommUserRank(comm: *const c_void, rank: *mut c_int) -> c_int {
        api("ncclCommUserRank", || {
            let handle = CommHandle::find(comm)?;
            if rank.is_null() {
                return Err(invalid("rank is NULL"));
            }
            // SAFETY: non-NULL, the caller's int.
            unsafe { *rank = handle.rank as c_int };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommCuDevice`: host communicators have no CUDA device, so this is
    /// `ncclInvalidUsage` with a message saying so.
    fn ncclCommCuDevice / pncclCommCuDevice(comm: *const c_void, device: *mut c_int) -> c_int {
        api("ncclCommCuDevice", || {
            let handle = CommHandle::find(comm)?;
            if device.is_null() {
                return Err(invalid("device is NULL"));
            }
            let ordinal = handle.communicator()?.cuda_device().ok_or_else(|| {
                Failure::new(
                    INVALID_USAGE,
                    "this communicator has no CUDA device: no CUDA context was current when \
                     it was made (call cudaSetDevice before ncclCommInitRank)",
                )
            })?;
            // SAFETY: checked non-NULL; the caller's int.
            unsafe { *device = ordinal as c_int };
            Ok(SUCCESS)
        })
    }

    /// `ncclGetErrorString`: the text of a result code.
    fn ncclGetErrorString / pncclGetErrorString(result: c_int) -> *const c_char {
        let text: &'static [u8] = match result {
            0 => b"no error\0",
            1 => b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)\0",
            2 => b"unhandled system error (run with NCCL_DEBUG=INFO for details)\0",
            3 => b"internal error - please report this issue to the ferroccl developers\0",
            4 => b"invalid argument (run with NCCL_DEBUG=WARN for details)\0",
            5 => b"invalid usage (run with NCCL_DEBUG=WARN for details)\0",
            6 => b"remote process exited or there was a network error\0",
            7 => b"NCCL operation in progress\0",
            _ => b"unknown result code\0",
        };
        text.as_ptr() as *const c_char
    }

    /// `ncclGetLastError`: the message of the last failed call on this thread ("" if
    /// none); valid until the next failure on this thread.
    fn ncclGetLastError / pncclGetLastError(comm: *mut c_void) -> *const c_char {
        let _ = comm;
        LAST_ERROR.with(|e| e.borrow().as_ptr())
    }

    /// `ncclCommRegister`: registers a buffer with the communicator's RDMA device when
    /// it has RDMA links (through a cache: a buffer inside one registered before shares
    /// its registration); otherwise records it (shared memory and TCP need none).
    fn ncclCommRegister / pncclCommRegister(
        comm: *const c_void,
        buff: *mut c_void,
        size: usize,
        handle_out: *mut *mut c_void,
    ) -> c_int {
        api("ncclCommRegister", || {
            let handle = CommHandle::find(comm)?;
            if handle_out.is_null() {
                return Err(invalid("handle is NULL"));
            }
            if buff.is_null() && size > 0 {
                return Err(invalid(format!("buff is NULL for {size} bytes")));
            }
            let communicator = handle.communicator()?;
            // SAFETY: NCCL's contract: the buffer stays allocated until
            // ncclCommDeregister (or the communicator's destruction).
            let registration = unsafe { communicator.register(buff.cast(), size) }
                .map_err(|e| Failure::new(SYSTEM_ERROR, e.to_string()))?;
            // A handle is a number that is never reused (and never a valid address).
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
            let token = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            lock(&handle.registrations).insert(token, registration);
            // SAFETY: non-NULL, the caller's void*.
            unsafe { *handle_out = token as *mut c_void };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommDeregister`: releases a registration of this communicator.
    fn ncclCommDeregister / pncclCommDeregister(comm: *const c_void, reg: *mut c_void) -> c_int {
        api("ncclCommDeregister", || {
            let handle = CommHandle::find(comm)?;
            let registration = lock(&handle.registrations).remove(&(reg as usize));
            match registration {
                Some(r) => {
                    handle
                        .communicator()?
                        .deregister(&r)
                        .map_err(|e| Failure::new(SYSTEM_ERROR, e.to_string()))?;
                    Ok(SUCCESS)
                }
                None => Err(invalid(format!(
                    "handle {reg:?} is not a registration of this communicator"
                ))),
            }
        })
    }

    /// `ncclCommWindowRegister`: makes a window of `size` bytes at `buff` (collective):
    /// on host memory they must lie in one `ncclMemAlloc` allocation, which peers in
    /// other processes then map and read in place.
    fn ncclCommWindowRegister / pncclCommWindowRegister(
        comm: *mut c_void,
        buff: *mut c_void,
        size: usize,
        win: *mut *mut c_void,
        win_flags: c_int,
    ) -> c_int {
        api("ncclCommWindowRegister", || {
            let handle = CommHandle::find(comm)?;
            let communicator = handle.communicator()?;
            let refusal = if win.is_null() {
                Some(invalid("win is NULL"))
            } else if buff.is_null() {
                Some(invalid(format!("buff is NULL for {size} bytes")))
            } else if !matches!(win_flags, 0 | 1) {
                Some(invalid(format!(
                    "winFlags {win_flags:#x}: NCCL_WIN_DEFAULT (0) or NCCL_WIN_COLL_SYMMETRIC (1)"
                )))
            } else if group::in_group() {
                Some(Failure::new(
                    INVALID_USAGE,
                    "ncclCommWindowRegister inside ncclGroupStart/ncclGroupEnd is not \
                     supported: every rank registers at once, outside a group",
                ))
            } else {
                None
            };
            if let Some(failure) = refusal {
                // The other ranks may be registering: this rank takes its part, so that
                // they fail with its reason instead of waiting for it.
                communicator.refuse_window(&failure.message);
                return Err(failure);
            }
            // SAFETY: NCCL's contract: the buffer stays allocated until
            // ncclCommWindowDeregister (the window keeps host memory mapped regardless).
            let window = unsafe { communicator.register_window(buff.cast(), size) }
                .map_err(|e| Failure::from_error(&e))?;
            let token = window.token as usize;
            lock(&handle.windows).insert(token, window);
            // SAFETY: non-NULL, the caller's ncclWindow_t.
            unsafe { *win = token as *mut c_void };
            Ok(SUCCESS)
        })
    }

    /// `ncclCommWindowDeregister`: ends a window of this communicator (collective).
    fn ncclCommWindowDeregister / pncclCommWindowDeregister(
        comm: *mut c_void,
        win: *mut c_void,
    ) -> c_int {
        api("ncclCommWindowDeregister", || {
            let handle = CommHandle::find(comm)?;
            let window = lock(&handle.windows).remove(&(win as usize)).ok_or_else(|| {
                invalid(format!("window {win:?} is not a window of this communicator"))
            })?;
            handle
                .communicator()?
                .deregister_window(window)
                .map_err(|e| Failure::from_error(&e))?;
            Ok(SUCCESS)
        })
    }

    /// `ncclMemAlloc`: zeroed device memory on the current CUDA context's GPU, as NCCL
    /// allocates it; shared host memory (a `memfd`) where no context is current (host
    /// ranks), which windows can be made of.
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
        api("ncclMemAlloc", || {
            if ptr.is_null() {
                return Err(invalid("ptr is NULL"));
            }
            if let Some(buffer) = device_allocation(size)? {
                let p = buffer.ptr() as *mut c_void;
                lock(allocations()).insert(p as usize, Allocation::Device(buffer));
                // SAFETY: non-NULL, the caller's void*.
                unsafe { *ptr = p };
                return Ok(SUCCESS);
            }
            let memory = crate::transport::window::SharedMemory::new(size)
                .map_err(|e| Failure::new(SYSTEM_ERROR, e.to_string()))?;
            let p = memory.as_ptr();
            lock(allocations()).insert(p as usize, Allocation::Host(memory));
            // SAFETY: non-NULL, the caller's void*.
            unsafe { *ptr = p as *mut c_void };
            Ok(SUCCESS)
        })
    }

    /// `ncclMemFree`: frees memory from `ncclMemAlloc` (NULL is a no-op).
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) -> c_int {
        api("ncclMemFree", || {
            if ptr.is_null() {
                return Ok(SUCCESS);
            }
            let allocation = lock(allocations()).remove(&(ptr as usize)).ok_or_else(|| {
                invalid(format!("{ptr:?} was not allocated by ncclMemAlloc (or is freed)"))
            })?;
            // Host memory stays mapped while a window of it is registered.
            drop(allocation);
            Ok(SUCCESS)
        })
    }

    /// `ncclRedOpCreatePreMulSum`: an op summing inputs each multiplied by `*scalar`
    /// first, for this communicator and data type.
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(
        op: *mut c_int,
        scalar: *mut c_void,
        datatype: c_int,
        residence: c_int,
        comm: *mut c_void,
    ) -> c_int {
        api("ncclRedOpCreatePreMulSum", || {
            let handle = CommHandle::find(comm)?;
            let dtype = dtype_of(datatype)?;
            if op.is_null() {
                return Err(invalid("op is NULL"));
            }
            let made = match residence {
                // SAFETY: the caller's scalar of `datatype` (NULL is refused inside).
                1 => UserOp::Immediate(dtype, unsafe { read_scalar(scalar, dtype) }?),
                0 => {
                    // Checked now (NULL, device memory), read at every call.
                    // SAFETY: as above.
                    unsafe { read_scalar(scalar, dtype) }?;
                    UserOp::AtCall(dtype, scalar as usize)
                }
                r => {
                    return Err(invalid(format!(
                        "residence {r} is neither ncclScalarDevice (0) nor \
                         ncclScalarHostImmediate (1)"
                    )));
                }
            };
            let mut ops = lock(&handle.user_ops);
            let index = match ops.iter().position(Option::is_none) {
                Some(i) => {
                    ops[i] = Some(made);
                    i
                }
                None => {
                    ops.push(Some(made));
                    ops.len() - 1
                }
            };
            // SAFETY: non-NULL, the caller's ncclRedOp_t.
            unsafe { *op = NUM_OPS + index as c_int };
            Ok(SUCCESS)
        })
    }

    /// `ncclRedOpDestroy`: releases an op made by `ncclRedOpCreatePreMulSum`.
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: c_int, comm: *mut c_void) -> c_int {
        api("ncclRedOpDestroy", || {
            let handle = CommHandle::find(comm)?;
            if (0..NUM_OPS).contains(&op) {
                return Err(invalid(format!("op {op} is built in and cannot be destroyed")));
            }
            let mut ops = lock(&handle.user_ops);
            let slot = usize::try_from(op - NUM_OPS)
                .ok()
                .and_then(|i| ops.get_mut(i))
                .filter(|s| s.is_some())
                .ok_or_else(|| {
                    invalid(format!("op {op} was not made on this communicator (or is destroyed)"))
                })?;
            *slot = None;
            Ok(SUCCESS)
        })
    }

    /// `ncclReduce`.
    fn ncclReduce / pncclReduce(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        op: c_int,
        root: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclReduce", || {
            let root = index_arg(root, "root")?;
            // SAFETY: the caller's buffers, as NCCL defines them for this call.
            unsafe {
                collective(comm, Collective::Reduce { root }, count, datatype, Some(op),
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclBcast`: in-place broadcast.
    fn ncclBcast / pncclBcast(
        buff: *mut c_void,
        count: usize,
        datatype: c_int,
        root: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclBcast", || {
            let root = index_arg(root, "root")?;
            // SAFETY: as for ncclBroadcast with sendbuff == recvbuff.
            unsafe {
                collective(comm, Collective::Broadcast { root }, count, datatype, None,
                    buff, buff, stream)
            }
        })
    }

    /// `ncclBroadcast`.
    fn ncclBroadcast / pncclBroadcast(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        root: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclBroadcast", || {
            let root = index_arg(root, "root")?;
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::Broadcast { root }, count, datatype, None,
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclAllReduce`.
    fn ncclAllReduce / pncclAllReduce(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        op: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclAllReduce", || {
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::AllReduce, count, datatype, Some(op),
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclReduceScatter` (`recvcount` per rank).
    fn ncclReduceScatter / pncclReduceScatter(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        recvcount: usize,
        datatype: c_int,
        op: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclReduceScatter", || {
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::ReduceScatter, recvcount, datatype, Some(op),
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclAllGather` (`sendcount` per rank).
    fn ncclAllGather / pncclAllGather(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        sendcount: usize,
        datatype: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclAllGather", || {
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::AllGather, sendcount, datatype, None,
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclAlltoAll` (NCCL 2.28): `count` elements to and from every rank.
    fn ncclAlltoAll / pncclAlltoAll(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclAlltoAll", || {
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::AllToAll, count, datatype, None,
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclGather` (NCCL 2.28).
    fn ncclGather / pncclGather(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        root: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclGather", || {
            let root = index_arg(root, "root")?;
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::Gather { root }, count, datatype, None,
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclScatter` (NCCL 2.28).
    fn ncclScatter / pncclScatter(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        root: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclScatter", || {
            let root = index_arg(root, "root")?;
            // SAFETY: the caller's buffers.
            unsafe {
                collective(comm, Collective::Scatter { root }, count, datatype, None,
                    sendbuff, recvbuff, stream)
            }
        })
    }

    /// `ncclSend`.
    fn ncclSend / pncclSend(
        sendbuff: *const c_void,
        count: usize,
        datatype: c_int,
        peer: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclSend", || {
            let peer = index_arg(peer, "peer")?;
            // SAFETY: the caller's buffer.
            unsafe {
                collective(comm, Collective::Send { peer }, count, datatype, None,
                    sendbuff, std::ptr::null_mut(), stream)
            }
        })
    }

    /// `ncclRecv`.
    fn ncclRecv / pncclRecv(
        recvbuff: *mut c_void,
        count: usize,
        datatype: c_int,
        peer: c_int,
        comm: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        group_api("ncclRecv", || {
            let peer = index_arg(peer, "peer")?;
            // SAFETY: the caller's buffer.
            unsafe {
                collective(comm, Collective::Recv { peer }, count, datatype, None,
                    std::ptr::null(), recvbuff, stream)
            }
        })
    }

    /// `ncclGroupStart`: opens a group (groups nest) on this thread.
    fn ncclGroupStart / pncclGroupStart() -> c_int {
        api("ncclGroupStart", || {
            group::start();
            Ok(SUCCESS)
        })
    }

    /// `ncclGroupEnd`: closes a group; the outermost runs everything queued in it.
    fn ncclGroupEnd / pncclGroupEnd() -> c_int {
        api("ncclGroupEnd", group::end)
    }
}
