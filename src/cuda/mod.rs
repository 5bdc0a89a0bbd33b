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
//!
//! What has run where is stated in the README ("GPUs"): the kernels compile here with
//! NVRTC and their logic runs here as host C++ (`tests/kernels.rs`); nothing in this
//! module has yet run against a GPU.

pub mod nvrtc;
pub mod work;

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::sync::OnceLock;

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

/// The loaded, initialised driver: its version (e.g. 12080 for CUDA 12.8).
#[derive(Clone, Copy, Debug)]
pub struct Driver {
    /// `cuDriverGetVersion`.
    pub version: i32,
}

/// The CUDA driver, or why it cannot be used (no `libcuda.so.1`, a symbol missing,
/// `cuInit` failing — e.g. no device or a driver/kernel-module mismatch).
pub fn driver() -> Result<Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load_driver)
        .clone()
        .map_err(|what| Error::Cuda { what })
}

fn load_driver() -> std::result::Result<Driver, String> {
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
    for name in DRIVER_SYMBOLS {
        // SAFETY: a lookup by name; the pointer is not called.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!(
                "the CUDA driver (libcuda.so.1) has no {name}: it is too old for ferroccl"
            ));
        }
    }
    // SAFETY: every symbol used below exists (checked above).
    unsafe {
        check(sys::cuInit(0), "cuInit").map_err(|e| e.to_string())?;
        let mut version: c_int = 0;
        check(sys::cuDriverGetVersion(&mut version), "cuDriverGetVersion")
            .map_err(|e| e.to_string())?;
        Ok(Driver { version })
    }
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
