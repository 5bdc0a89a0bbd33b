//! The one door to the GPU: the CUDA driver and NVRTC through cudarc, loaded at run time.
//!
//! ferroccl builds with no CUDA toolkit and runs where there is no driver: cudarc is used
//! with dynamic loading, and every entry here first checks that the library is present
//! and has the symbols ferroccl calls ([`driver`], [`nvrtc::compiler`]). A missing driver
//! or compiler is an [`Error::Cuda`] naming what is missing, never a panic (cudarc
//! panics on a missing library or symbol; a panic across the C ABI would abort the
//! user's process).
//!
//! - [`nvrtc`] compiles `kernels/*.cu` for a device's compute capability, caching each
//!   cubin per architecture.
//! - [`work`] lays a [`Plan`](crate::plan::Plan) out as the device executor
//!   (`kernels/executor.cu`) reads it: the same plan the host engine, the simulator and
//!   the visualizer consume, in a flat `#[repr(C)]` form.
//! - [`tuning`] chooses the channels and cost model of device calls from the GPUs.
//! - The engine's device side (`engine::device`) enqueues plans on device memory on the
//!   caller's stream (NCCL's stream semantics), over the FIFOs of `transport::cuda_ipc`;
//!   both sit above this module, which is the one door to the driver.
//! - The RAII wrappers here ([`DeviceBuffer`], [`ImportedBuffer`], [`MappedHostBuffer`],
//!   [`Event`], [`Function`]) are the only places that call the driver for them.
//!
//! What has run where is stated in the README ("GPUs"): the kernels compile here with
//! NVRTC and their logic runs here as host C++ (`tests/kernels.rs`); nothing that calls
//! the driver has yet run against a GPU (`tests/gpu.rs` is ready for one).

pub mod nvrtc;
pub mod tuning;
pub mod work;

use std::collections::HashMap;
use std::ffi::{CStr, c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Driver symbols ferroccl calls, checked once so that an old driver is an error and
/// not cudarc's panic on the first call of a missing one.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuPointerGetAttribute",
    "cuStreamSynchronize",
    "cuGetErrorString",
];

/// The first of `names` that `lib` does not export (cudarc panics when it calls one).
pub(crate) fn missing_symbol<'a>(lib: &libloading::Library, names: &[&'a str]) -> Option<&'a str> {
    // SAFETY: lookups by name; no pointer is called.
    names
        .iter()
        .copied()
        .find(|name| unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err())
}

/// The loaded, initialised driver: its version (e.g. 12080 for CUDA 12.8).
#[derive(Clone, Debug)]
pub struct Driver {
    /// `cuDriverGetVersion`.
    pub version: i32,
    /// `Some(description)` when it is the simulated driver of ferroccl's tests
    /// (`FERROCCL_CUDA_DRIVER`), which runs kernels on host threads: never a GPU.
    pub simulated: Option<String>,
}

/// The variable that names a CUDA driver library to load instead of the system's
/// `libcuda.so.1` (the tests' simulated driver, `tests/simcuda/`).
pub const DRIVER_VARIABLE: &str = "FERROCCL_CUDA_DRIVER";

/// The symbol by which the simulated driver says what it is.
const SIMULATED_MARK: &str = "ferroccl_simcuda_describe";

/// The driver, once loaded (or why it could not be).
static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

/// Whether a CUDA driver is loaded in this process already (by ferroccl, or by the
/// application: the CUDA runtime, torch, a C program), without loading one.
pub fn driver_loaded() -> bool {
    if let Some(loaded) = DRIVER.get() {
        return loaded.is_ok();
    }
    let chosen = std::env::var(DRIVER_VARIABLE)
        .ok()
        .filter(|p| !p.is_empty());
    chosen
        .iter()
        .map(String::as_str)
        .chain(["libcuda.so.1", "libcuda.so"])
        .any(|name| {
            // SAFETY: RTLD_NOLOAD only looks for a library already loaded; nothing runs.
            unsafe {
                libloading::os::unix::Library::open(
                    Some(name),
                    libloading::os::unix::RTLD_LAZY | libc::RTLD_NOLOAD,
                )
            }
            .is_ok()
        })
}

/// The CUDA driver, or why it cannot be used (no `libcuda.so.1`, a symbol missing,
/// `cuInit` failing — e.g. no device or a driver/kernel-module mismatch).
pub fn driver() -> Result<Driver> {
    DRIVER
        .get_or_init(load_driver)
        .clone()
        .map_err(|what| Error::Cuda { what })
}

fn load_driver() -> std::result::Result<Driver, String> {
    let chosen = std::env::var_os(DRIVER_VARIABLE).filter(|p| !p.is_empty());
    if let Some(path) = &chosen {
        // Loaded by path and kept loaded: cudarc's lookup by name then finds this library
        // (glibc matches the name against the SONAME of what is already loaded).
        // SAFETY: loading a driver library runs its initialisers, which have no
        // preconditions.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => std::mem::forget(lib),
            Err(e) => {
                return Err(format!(
                    "{DRIVER_VARIABLE}={}: {e}",
                    std::path::Path::new(path).display()
                ));
            }
        }
    }
    // SAFETY: probing for the library only dlopens candidates by name.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "no CUDA driver: libcuda.so.1 could not be loaded (no NVIDIA driver is \
                    installed here)"
                .into(),
        );
    }
    // SAFETY: the library is present (checked above), so `culib` returns it; `get` only
    // looks a symbol up.
    let lib = unsafe { sys::culib() };
    if let Some(name) = missing_symbol(lib, DRIVER_SYMBOLS) {
        return Err(format!(
            "the CUDA driver (libcuda.so.1) has no {name}: it is too old for ferroccl"
        ));
    }
    let simulated = simulated_description(lib);
    if let (Some(path), None) = (&chosen, &simulated) {
        return Err(format!(
            "{DRIVER_VARIABLE}={} was loaded, but the CUDA driver this process uses is \
             not ferroccl's simulated driver (the variable names only that one; a real \
             driver is found as libcuda.so.1), or another libcuda was loaded before \
             ferroccl looked",
            std::path::Path::new(path).display()
        ));
    }
    if let Some(what) = &simulated {
        tracing::info!("CUDA driver: SIMULATED, {what} (not a GPU)");
    }
    // SAFETY: every symbol used below exists (checked above).
    unsafe {
        check(sys::cuInit(0), "cuInit").map_err(|e| e.to_string())?;
        let mut version: c_int = 0;
        check(sys::cuDriverGetVersion(&mut version), "cuDriverGetVersion")
            .map_err(|e| e.to_string())?;
        Ok(Driver { version, simulated })
    }
}

/// What the simulated driver says it is, when `lib` is that driver.
fn simulated_description(lib: &libloading::Library) -> Option<String> {
    type Describe = unsafe extern "C" fn() -> *const std::ffi::c_char;
    // SAFETY: the simulated driver exports this symbol with this signature; a real
    // driver does not export it.
    let describe = unsafe { lib.get::<Describe>(SIMULATED_MARK.as_bytes()) }.ok()?;
    // SAFETY: a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(describe()) };
    Some(text.to_string_lossy().into_owned())
}

/// Turns a driver result into `Ok` or an [`Error::Cuda`] naming the call and the error.
///
/// # Safety
/// The driver must be loaded with `cuGetErrorString` present (as [`driver`] checks).
unsafe fn check(rc: sys::CUresult, call: &str) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it NULL).
    let name = if unsafe { sys::cuGetErrorString(rc, &mut text) } == sys::CUresult::CUDA_SUCCESS
        && !text.is_null()
    {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{rc:?}")
    };
    Err(Error::Cuda {
        what: format!("{call} failed: {name}"),
    })
}

/// Number of CUDA devices (0 where there is no usable driver).
pub fn device_count() -> usize {
    if driver().is_err() {
        return 0;
    }
    let mut n: c_int = 0;
    // SAFETY: the driver is loaded and initialised; the call writes one int.
    match unsafe { check(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount") } {
        Ok(()) => n.max(0) as usize,
        Err(_) => 0,
    }
}

/// The compute capability `(major, minor)` of device `ordinal`.
pub fn compute_capability(ordinal: usize) -> Result<(u32, u32)> {
    driver()?;
    let mut major: c_int = 0;
    let mut minor: c_int = 0;
    let dev = ordinal as sys::CUdevice;
    // SAFETY: the driver is loaded and initialised; each call writes one int.
    unsafe {
        check(
            sys::cuDeviceGetAttribute(
                &mut major,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
            "cuDeviceGetAttribute(compute capability major)",
        )?;
        check(
            sys::cuDeviceGetAttribute(
                &mut minor,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                dev,
            ),
            "cuDeviceGetAttribute(compute capability minor)",
        )?;
    }
    Ok((major as u32, minor as u32))
}

/// How processes may share a GPU (`CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeMode {
    /// Any number of processes (their kernels time-slice unless MPS runs them together).
    Default,
    /// One process's contexts at a time.
    ExclusiveProcess,
    /// No contexts at all.
    Prohibited,
}

/// The compute mode of device `ordinal`.
pub fn compute_mode(ordinal: usize) -> Result<ComputeMode> {
    driver()?;
    let mut mode: c_int = 0;
    // SAFETY: the driver is loaded and initialised; the call writes one int.
    unsafe {
        check(
            sys::cuDeviceGetAttribute(
                &mut mode,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
                ordinal as sys::CUdevice,
            ),
            "cuDeviceGetAttribute(compute mode)",
        )?
    };
    Ok(match mode {
        2 => ComputeMode::Prohibited,
        3 => ComputeMode::ExclusiveProcess,
        _ => ComputeMode::Default,
    })
}

/// Whether an MPS control daemon seems to run for this user (its pipe directory:
/// `CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`, holds its `control` pipe).
pub fn mps_running() -> bool {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp/nvidia-mps"));
    dir.join("control").exists()
}

/// Where a buffer lives, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerKind {
    /// Ordinary host memory (or memory CUDA does not know).
    Host,
    /// Device memory (`CU_MEMORYTYPE_DEVICE`), including managed memory.
    Device,
}

/// What kind of memory `ptr` is: [`PointerKind::Host`] where there is no driver (a
/// process without CUDA has no device memory).
pub fn pointer_kind(ptr: *const c_void) -> PointerKind {
    if ptr.is_null() || driver().is_err() {
        return PointerKind::Host;
    }
    let mut memory_type: c_uint = 0;
    // SAFETY: the driver is loaded; the attribute query writes one `CUmemorytype` (an
    // unsigned int) and fails without writing for pointers CUDA does not know.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            &mut memory_type as *mut c_uint as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    if rc == sys::CUresult::CUDA_SUCCESS
        && memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as c_uint
    {
        PointerKind::Device
    } else {
        PointerKind::Host
    }
}

/// The GPU whose memory `ptr` is (an error for memory the driver does not know as
/// device memory).
pub fn pointer_device(ptr: u64) -> Result<usize> {
    driver()?;
    if pointer_kind(ptr as *const c_void) != PointerKind::Device {
        return Err(Error::invalid(format!(
            "{ptr:#x} is not CUDA device memory"
        )));
    }
    let mut ordinal: c_int = 0;
    // SAFETY: the driver is loaded; the attribute query writes one int.
    unsafe {
        check(
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut c_int as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr as sys::CUdeviceptr,
            ),
            "cuPointerGetAttribute(device ordinal)",
        )?
    };
    Ok(ordinal as usize)
}

/// Waits for the work queued on `stream`, so that a host-memory call runs in the
/// stream's order.
///
/// # Safety
/// `stream` must be a CUDA stream handle of this process (or NULL, the legacy default
/// stream).
pub unsafe fn synchronize(stream: *mut c_void) -> Result<()> {
    if let Err(Error::Cuda { what }) = driver() {
        return Err(Error::Cuda {
            what: format!(
                "a CUDA stream was given but it cannot be waited on: {what}; pass a NULL \
                 stream with host memory"
            ),
        });
    }
    // SAFETY: the driver is loaded; `stream` is the caller's handle, passed through.
    unsafe {
        check(
            sys::cuStreamSynchronize(stream as sys::CUstream),
            "cuStreamSynchronize",
        )
    }
}

// ----- what a launch needs (checked on first use, apart from the basic symbols) -----

/// Driver symbols the device path calls (memory, IPC, modules, launches, events).
const RUNTIME_SYMBOLS: &[&str] = &[
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceGet",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamGetCtx",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemsetD8Async",
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuMemcpyDtoH_v2",
    "cuStreamIsCapturing",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuDeviceGetP2PAttribute",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetPCIBusId",
];

/// The driver, with every symbol the device path calls, and the context current on this
/// thread (the caller's, as with NCCL). Returns the device of that context. No context is
/// made here: a rank that uses GPU 3 must not get one on GPU 0 (a context takes hundreds
/// of MiB of that GPU's memory), so a thread with none is an error saying so.
pub fn runtime() -> Result<usize> {
    runtime_symbols()?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: every symbol is present (checked above); the calls write one handle or int.
    unsafe {
        check(sys::cuCtxGetCurrent(&mut ctx), "cuCtxGetCurrent")?;
        if ctx.is_null() {
            return Err(no_context());
        }
        let mut dev: sys::CUdevice = 0;
        check(sys::cuCtxGetDevice(&mut dev), "cuCtxGetDevice")?;
        Ok(dev as usize)
    }
}

/// The driver, with every symbol the device path calls (checked once).
fn runtime_symbols() -> Result<()> {
    static CHECKED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    driver()?;
    CHECKED
        .get_or_init(|| {
            // SAFETY: the library is loaded (driver() succeeded); lookups only.
            let lib = unsafe { sys::culib() };
            match missing_symbol(lib, RUNTIME_SYMBOLS) {
                Some(name) => Err(format!(
                    "the CUDA driver (libcuda.so.1) has no {name}: it is too old for \
                     ferroccl's device path"
                )),
                None => Ok(()),
            }
        })
        .clone()
        .map_err(|what| Error::Cuda { what })
}

/// Whether the loaded driver has `name` (for calls newer than the oldest driver ferroccl
/// runs on).
fn has_symbol(name: &str) -> bool {
    // SAFETY: the library is loaded (callers reached the driver first); lookup only.
    let lib = unsafe { sys::culib() };
    missing_symbol(lib, &[name]).is_none()
}

fn no_context() -> Error {
    Error::Cuda {
        what: "no CUDA context is current on this thread: make the rank's GPU current first \
               (cudaSetDevice, torch.cuda.set_device, or cuCtxSetCurrent)"
            .into(),
    }
}

/// The context current on this thread, if any (none is made).
pub fn current_context() -> Result<Option<Context>> {
    runtime_symbols()?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the runtime symbols are present; the call writes one handle.
    unsafe { check(sys::cuCtxGetCurrent(&mut ctx), "cuCtxGetCurrent")? };
    Ok((!ctx.is_null()).then_some(Context(ctx)))
}

/// Makes device `ordinal`'s primary context (the one the CUDA runtime, and so torch,
/// uses) current on this thread, for threads of ferroccl's own (the perf tools' ranks).
pub fn bind_device(ordinal: usize) -> Result<()> {
    let ctx = Context::primary(ordinal).map_err(|e| match compute_mode(ordinal) {
        Ok(mode @ (ComputeMode::ExclusiveProcess | ComputeMode::Prohibited)) => Error::Cuda {
            what: format!(
                "{e}: GPU {ordinal} is in {mode:?} compute mode, so this process cannot \
                 have a context on it (another process holds it, or none may): run one \
                 rank process per GPU, or set the default compute mode \
                 (nvidia-smi -c DEFAULT)"
            ),
        },
        _ => e,
    })?;
    // SAFETY: a live context handle.
    unsafe { check(sys::cuCtxSetCurrent(ctx.0), "cuCtxSetCurrent") }
}

/// A CUDA context (a handle; the context belongs to whoever made it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context(sys::CUcontext);

// SAFETY: a context handle may be made current on any thread of the process.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// The handle as a number (to tell contexts apart, e.g. as a key).
    pub fn key(&self) -> usize {
        self.0 as usize
    }

    /// The context current on this thread (after [`runtime`] made sure there is one).
    pub fn current() -> Result<Self> {
        runtime()?;
        // SAFETY: NULL asks for the current context.
        unsafe { Self::of_stream(std::ptr::null_mut()) }
    }

    /// Device `ordinal`'s primary context (retained: it lives as long as the process).
    pub fn primary(ordinal: usize) -> Result<Self> {
        runtime_symbols()?;
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the runtime symbols are present; each call writes one handle.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal as c_int), "cuDeviceGet")?;
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
        }
        Ok(Context(ctx))
    }

    /// The context work on `stream` runs in: the stream's own for a stream, the one
    /// current on this thread for NULL (the legacy default stream), as NCCL takes it.
    ///
    /// # Safety
    /// `stream` is a CUDA stream of this process (or NULL).
    pub unsafe fn of_stream(stream: *mut c_void) -> Result<Self> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is loaded by whoever calls (runtime() checked the symbols);
        // the call writes one handle.
        unsafe {
            if stream.is_null() {
                check(sys::cuCtxGetCurrent(&mut ctx), "cuCtxGetCurrent")?;
            } else {
                check(
                    sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx),
                    "cuStreamGetCtx",
                )?;
            }
        }
        if ctx.is_null() {
            return Err(no_context());
        }
        Ok(Context(ctx))
    }

    /// Makes this context current on this thread until the guard is dropped (then the
    /// thread's previous context is current again).
    pub fn push(&self) -> Result<ContextGuard> {
        // SAFETY: a live context handle; popped by the guard.
        unsafe { check(sys::cuCtxPushCurrent_v2(self.0), "cuCtxPushCurrent")? };
        Ok(ContextGuard(()))
    }

    /// The device this context is on.
    pub fn device(&self) -> Result<usize> {
        let _g = self.push()?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: this context is current; the call writes one int.
        unsafe { check(sys::cuCtxGetDevice(&mut dev), "cuCtxGetDevice")? };
        Ok(dev as usize)
    }
}

/// A context made current by [`Context::push`]; popped on drop.
#[derive(Debug)]
pub struct ContextGuard(());

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut ctx) };
    }
}

/// Lets the current context's kernels reach memory of device `peer` (in this process),
/// as ranks of one process on different GPUs need; a no-op for the same device.
pub fn enable_peer_access(peer: usize) -> Result<()> {
    let here = runtime()?;
    if here == peer {
        return Ok(());
    }
    let mut can: c_int = 0;
    let peer_ctx = Context::primary(peer)?;
    // SAFETY: the runtime symbols are present; the calls take handles and write an int.
    unsafe {
        check(
            sys::cuDeviceCanAccessPeer(&mut can, here as sys::CUdevice, peer as sys::CUdevice),
            "cuDeviceCanAccessPeer",
        )?;
        if can == 0 {
            return Err(Error::Cuda {
                what: format!(
                    "GPU {here} cannot access GPU {peer}'s memory (no P2P between them); \
                     ranks of one process on these two GPUs cannot share FIFOs"
                ),
            });
        }
        match sys::cuCtxEnablePeerAccess(peer_ctx.0, 0) {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            rc => check(rc, "cuCtxEnablePeerAccess"),
        }
    }
}

/// Device memory from `cuMemAlloc`, zeroed, freed on drop. Such memory can be exported
/// to other processes with CUDA IPC.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    /// Made current to free it (the dropping thread may have no context).
    ctx: Context,
}

impl DeviceBuffer {
    /// `bytes` of device memory on the current context's device, zeroed before this
    /// returns. (`cuMemsetD8` would return before the memory is zero and run on the
    /// legacy stream: a peer could write a FIFO it was given before the zeroing lands.
    /// The memset runs on a private stream and is waited for.)
    pub fn zeroed(bytes: usize) -> Result<Self> {
        let ctx = Context::current()?;
        let mut ptr: sys::CUdeviceptr = 0;
        let stream = Stream::new()?;
        // SAFETY: the runtime symbols are present and a context is current.
        unsafe {
            check(sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)), "cuMemAlloc")?;
            let b = DeviceBuffer { ptr, bytes, ctx };
            check(
                sys::cuMemsetD8Async(ptr, 0, bytes.max(1), stream.0),
                "cuMemsetD8Async",
            )?;
            stream.synchronize()?;
            Ok(b)
        }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The CUDA IPC handle that lets another process map this memory.
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: a live allocation from cuMemAlloc; the call writes the handle.
        unsafe {
            check(
                sys::cuIpcGetMemHandle(&mut handle, self.ptr),
                "cuIpcGetMemHandle",
            )?
        };
        Ok(handle.reserved.map(|b| b as u8))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _g = self.ctx.push();
        // SAFETY: allocated by cuMemAlloc and freed once, in its context. Errors (a
        // context already destroyed at exit) leave nothing to do.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Another process's device memory, mapped from its IPC handle; unmapped on drop.
#[derive(Debug)]
pub struct ImportedBuffer {
    ptr: u64,
    ctx: Context,
}

impl ImportedBuffer {
    /// Maps the memory of `handle` (with peer access enabled lazily when it lives on
    /// another GPU).
    pub fn open(handle: &[u8; 64]) -> Result<Self> {
        let ctx = Context::current()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the runtime symbols are present and a context is current; the call
        // writes one device address.
        unsafe {
            check(
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
                ),
                "cuIpcOpenMemHandle",
            )?;
        }
        Ok(ImportedBuffer { ptr, ctx })
    }

    /// The device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for ImportedBuffer {
    fn drop(&mut self) {
        let _g = self.ctx.push();
        // SAFETY: mapped by cuIpcOpenMemHandle and unmapped once, in its context.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// Page-locked host memory mapped into the device's address space (the abort word and
/// lane statuses: the host writes or reads it while a kernel runs), zeroed.
#[derive(Debug)]
pub struct MappedHostBuffer {
    host: *mut u8,
    device: u64,
    bytes: usize,
    ctx: Context,
}

// SAFETY: the buffer is plain memory; who reads and writes it when is the user's
// (ferroccl's launcher's) business, through volatile or atomic accesses.
unsafe impl Send for MappedHostBuffer {}
// SAFETY: sharing hands out the same two addresses; the accesses through them are
// volatile (the abort word, lane statuses), as above.
unsafe impl Sync for MappedHostBuffer {}

impl MappedHostBuffer {
    /// `bytes` of zeroed page-locked host memory, mapped for the device.
    pub fn zeroed(bytes: usize) -> Result<Self> {
        let ctx = Context::current()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: the runtime symbols are present and a context is current.
        unsafe {
            check(
                sys::cuMemHostAlloc(&mut host, bytes.max(1), sys::CU_MEMHOSTALLOC_DEVICEMAP),
                "cuMemHostAlloc",
            )?;
            std::ptr::write_bytes(host as *mut u8, 0, bytes.max(1));
            // Owns the allocation from here on: an error below frees it once, and
            // success fills in the device address of this same value (building a new
            // value from it with `..b` would drop `b`, freeing the memory returned).
            let mut b = MappedHostBuffer {
                host: host as *mut u8,
                device: 0,
                bytes,
                ctx,
            };
            check(
                sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0),
                "cuMemHostGetDevicePointer",
            )?;
            b.device = device;
            Ok(b)
        }
    }

    /// The host address.
    pub fn host(&self) -> *mut u8 {
        self.host
    }

    /// The device address of the same memory.
    pub fn device(&self) -> u64 {
        self.device
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for MappedHostBuffer {
    fn drop(&mut self) {
        let _g = self.ctx.push();
        // SAFETY: allocated by cuMemHostAlloc and freed once, in its context.
        let _ = unsafe { sys::cuMemFreeHost(self.host as *mut c_void) };
    }
}

/// Whether GPU `a`'s kernels can reach GPU `b`'s memory (P2P); `true` for one GPU.
pub fn can_access_peer(a: usize, b: usize) -> Result<bool> {
    if a == b {
        return Ok(true);
    }
    runtime_symbols()?;
    let mut can: c_int = 0;
    // SAFETY: the runtime symbols are present; the call writes one int.
    unsafe {
        check(
            sys::cuDeviceCanAccessPeer(&mut can, a as sys::CUdevice, b as sys::CUdevice),
            "cuDeviceCanAccessPeer",
        )?
    };
    Ok(can != 0)
}

/// Whether P2P between GPUs `a` and `b` has native atomics: NVLink has them, PCIe P2P
/// does not (`CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`).
pub fn native_atomics(a: usize, b: usize) -> Result<bool> {
    runtime_symbols()?;
    let mut v: c_int = 0;
    // SAFETY: the driver is loaded; the call writes one int.
    unsafe {
        check(
            sys::cuDeviceGetP2PAttribute(
                &mut v,
                sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                a as sys::CUdevice,
                b as sys::CUdevice,
            ),
            "cuDeviceGetP2PAttribute(native atomics)",
        )?
    };
    Ok(v != 0)
}

/// What a communicator's initialisation learns of the GPU whose context is current on
/// the initialising thread ([`current_gpu`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuIdentity {
    /// The GPU's UUID: the same in every process, however `CUDA_VISIBLE_DEVICES`
    /// numbers it there.
    pub uuid: [u8; 16],
    /// Its ordinal in this process.
    pub ordinal: usize,
    /// Its SM count.
    pub sms: usize,
    /// Its PCI bus id (`0000:3b:00.0`), to find its NVLinks in NVML's view.
    pub bus_id: String,
}

/// The GPU of the context current on this thread, when a CUDA driver is loaded in this
/// process already and a context is current (a process that never touched CUDA does
/// not load a driver for this, and a thread without a context says nothing).
pub fn current_gpu() -> Option<GpuIdentity> {
    if !driver_loaded() || runtime_symbols().is_err() {
        return None;
    }
    let ordinal = runtime().ok()?;
    gpu_identity(ordinal).ok()
}

/// [`GpuIdentity`] of GPU `ordinal`.
pub fn gpu_identity(ordinal: usize) -> Result<GpuIdentity> {
    runtime_symbols()?;
    let dev = ordinal as sys::CUdevice;
    let mut uuid = sys::CUuuid_st { bytes: [0; 16] };
    let mut sms: c_int = 0;
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: the driver is loaded; the calls write a UUID, an int and at most 64 bytes.
    unsafe {
        check(sys::cuDeviceGetUuid_v2(&mut uuid, dev), "cuDeviceGetUuid")?;
        check(
            sys::cuDeviceGetAttribute(
                &mut sms,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                dev,
            ),
            "cuDeviceGetAttribute(SM count)",
        )?;
        check(
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev),
            "cuDeviceGetPCIBusId",
        )?;
    }
    // SAFETY: NUL-terminated by the driver within the buffer.
    let bus_id = unsafe { CStr::from_ptr(bus.as_ptr()) }.to_string_lossy();
    Ok(GpuIdentity {
        uuid: uuid.bytes.map(|b| b as u8),
        ordinal,
        sms: sms.max(1) as usize,
        bus_id: crate::topo::pci::normalise_bus_id(&bus_id),
    })
}

/// Host memory of someone else's (a shared-memory segment) registered as page-locked and
/// mapped for every context's device (`cuMemHostRegister`, portable and device-mapped);
/// unregistered on drop. The memory must outlive this value.
#[derive(Debug)]
pub struct RegisteredHost {
    host: *mut u8,
    device: u64,
    ctx: Context,
}

// SAFETY: a registration of memory shared on purpose; accesses go through the FIFO
// protocol (atomics, and slots handed to one side at a time).
unsafe impl Send for RegisteredHost {}

impl RegisteredHost {
    /// Registers `bytes` at `host` in the current context.
    ///
    /// # Safety
    /// `host .. host + bytes` is mapped memory that stays mapped until this value is
    /// dropped.
    pub unsafe fn new(host: *mut u8, bytes: usize) -> Result<Self> {
        let ctx = Context::current()?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: the caller's mapping; the runtime symbols are present.
        unsafe {
            check(
                sys::cuMemHostRegister_v2(
                    host as *mut c_void,
                    bytes,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                ),
                "cuMemHostRegister",
            )?;
            // From here on a failure unregisters (the value's drop).
            let mut registered = RegisteredHost {
                host,
                device: 0,
                ctx,
            };
            check(
                sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0),
                "cuMemHostGetDevicePointer",
            )?;
            registered.device = device;
            Ok(registered)
        }
    }

    /// The address kernels use.
    pub fn device(&self) -> u64 {
        self.device
    }
}

impl Drop for RegisteredHost {
    fn drop(&mut self) {
        let _g = self.ctx.push();
        // SAFETY: registered by cuMemHostRegister and unregistered once, in its context.
        let _ = unsafe { sys::cuMemHostUnregister(self.host as *mut c_void) };
    }
}

/// A CUDA event (no timing), destroyed on drop.
#[derive(Debug)]
pub struct Event(sys::CUevent, Context);

// SAFETY: CUDA events may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: the driver's event calls are thread-safe; the handle is not mutated.
unsafe impl Sync for Event {}

impl Event {
    /// A new event recorded on `stream` now.
    ///
    /// # Safety
    /// `stream` is a CUDA stream of the current context (or NULL).
    pub unsafe fn record(stream: *mut c_void) -> Result<Self> {
        let ctx = Context::current()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the runtime symbols are present; `stream` is the caller's.
        unsafe {
            check(
                sys::cuEventCreate(
                    &mut e,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
                ),
                "cuEventCreate",
            )?;
            let event = Event(e, ctx);
            check(
                sys::cuEventRecord(e, stream as sys::CUstream),
                "cuEventRecord",
            )?;
            Ok(event)
        }
    }

    /// Whether the work before the event has finished.
    pub fn done(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            // SAFETY: the driver is loaded.
            rc => unsafe { check(rc, "cuEventQuery") }.map(|_| false),
        }
    }

    /// Makes `stream` wait (on the device) for the work before the event.
    ///
    /// # Safety
    /// `stream` is a CUDA stream of the current context (or NULL).
    pub unsafe fn make_wait(&self, stream: *mut c_void) -> Result<()> {
        // SAFETY: a live event; the caller's stream.
        unsafe {
            check(
                sys::cuStreamWaitEvent(stream as sys::CUstream, self.0, 0),
                "cuStreamWaitEvent",
            )
        }
    }

    /// Blocks until the work before the event has finished.
    pub fn wait(&self) -> Result<()> {
        // SAFETY: a live event.
        unsafe { check(sys::cuEventSynchronize(self.0), "cuEventSynchronize") }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _g = self.1.push();
        // SAFETY: created by cuEventCreate and destroyed once, in its context.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// A kernel of a loaded cubin.
#[derive(Clone, Copy, Debug)]
pub struct Function(sys::CUfunction);

// SAFETY: a function handle may be launched from any thread of the process.
unsafe impl Send for Function {}
// SAFETY: as above; launching does not mutate the handle.
unsafe impl Sync for Function {}

impl Function {
    /// Loads `source`, compiled for the current device's architecture, and returns its
    /// entry point `entry`, its code on the GPU. Each (source, entry, context) is loaded
    /// once per process and stays loaded.
    ///
    /// With lazy loading (`CUDA_MODULE_LOADING=LAZY`, the default since CUDA 12.2) a
    /// module's kernels reach the GPU at their first launch, and that load may wait for
    /// every stream of the context. A kernel of one rank that waits for another rank's
    /// kernel, whose first launch waits for the context, never ends: on an H100 the
    /// second of two ranks on one GPU hung there. So the function is loaded here, with
    /// `cuFuncLoad` (CUDA 12.4 and later drivers; older ones load at
    /// `cuModuleGetFunction`), and callers load before they launch anything that could
    /// wait (see `engine::device::load_executor`).
    pub fn load(source: &nvrtc::KernelSource, entry: &str) -> Result<Self> {
        type Loaded = Mutex<HashMap<(&'static str, String, usize), Function>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let device = runtime()?;
        // A module belongs to a context: keyed by the current one.
        // SAFETY: NULL asks for the current context.
        let ctx = unsafe { Context::of_stream(std::ptr::null_mut())? };
        let key = (source.name, entry.to_string(), ctx.0 as usize);
        let loaded = LOADED.get_or_init(Default::default);
        let mut loaded = loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = loaded.get(&key) {
            return Ok(*f);
        }
        let arch = compute_capability(device)?;
        nvrtc::check_driver_supports(nvrtc::compiler()?.version, driver()?.version)?;
        let cubin = nvrtc::cubin(source, arch)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        let name = std::ffi::CString::new(entry).map_err(|_| Error::invalid("entry name"))?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: the runtime symbols are present; the image is a cubin for this
        // device's architecture; the name is NUL-terminated.
        unsafe {
            check(
                sys::cuModuleLoadData(&mut module, cubin.image.as_ptr() as *const c_void),
                "cuModuleLoadData",
            )?;
            check(
                sys::cuModuleGetFunction(&mut f, module, name.as_ptr()),
                "cuModuleGetFunction",
            )?;
            if has_symbol("cuFuncLoad") {
                check(sys::cuFuncLoad(f), "cuFuncLoad")?;
            }
        }
        loaded.insert(key, Function(f));
        Ok(Function(f))
    }

    /// Launches `blocks` × `threads` on `stream` with the kernel's parameters at `params`
    /// (one pointer per parameter, as `cuLaunchKernel` takes them).
    ///
    /// # Safety
    /// `params` must match the kernel's signature; everything they point to on the device
    /// must stay valid until the launch completes; `stream` is a stream of the current
    /// context (or NULL).
    pub unsafe fn launch(
        &self,
        blocks: u32,
        threads: u32,
        stream: *mut c_void,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            check(
                sys::cuLaunchKernel(
                    self.0,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream as sys::CUstream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel",
            )
        }
    }
}

/// A CUDA stream that does not synchronise with the legacy default stream, destroyed on
/// drop.
#[derive(Debug)]
pub struct Stream(sys::CUstream, Context);

// SAFETY: a stream handle may be used from any thread of the process.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing does not mutate the handle.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on the current context.
    pub fn new() -> Result<Self> {
        let ctx = Context::current()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the runtime symbols are present and a context is current.
        unsafe {
            check(
                sys::cuStreamCreate(
                    &mut s,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
                ),
                "cuStreamCreate",
            )?;
        }
        Ok(Stream(s, ctx))
    }

    /// The handle, as the C APIs take it.
    pub fn handle(&self) -> *mut c_void {
        self.0 as *mut c_void
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream of this process.
        unsafe { synchronize(self.handle()) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _g = self.1.push();
        // SAFETY: created by cuStreamCreate and destroyed once, in its context.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// Whether `stream` is being captured into a CUDA graph (the legacy default stream never
/// is).
///
/// # Safety
/// `stream` is a CUDA stream of this process (or NULL).
pub unsafe fn is_capturing(stream: *mut c_void) -> Result<bool> {
    if stream.is_null() {
        return Ok(false);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream (the caller's); the call writes one enum value.
    unsafe {
        check(
            sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status),
            "cuStreamIsCapturing",
        )?
    };
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Copies `bytes` from device memory to host memory and waits for the copy (which
/// runs on the legacy stream: synchronise the streams that wrote `src` first).
///
/// # Safety
/// `src` is device memory of at least `bytes`; `dst` is valid for writes of `bytes`.
pub unsafe fn copy_from_device(dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe {
        check(
            sys::cuMemcpyDtoH_v2(dst as *mut c_void, src, bytes),
            "cuMemcpyDtoH",
        )
    }
}

/// Copies `bytes` from host memory to device memory in `stream`'s order.
///
/// # Safety
/// `src` must stay valid until the copy completes on the stream (page-locked memory
/// for an asynchronous copy); `dst` is device memory of at least `bytes`.
pub unsafe fn copy_to_device_async(
    dst: u64,
    src: *const u8,
    bytes: usize,
    stream: *mut c_void,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe {
        check(
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream as sys::CUstream),
            "cuMemcpyHtoDAsync",
        )
    }
}
