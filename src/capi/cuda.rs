//! The few CUDA driver calls the C API needs, loaded at run time (`libcuda.so.1`), so
//! ferroccl builds and runs where no driver is installed: whether a pointer is device
//! memory (refused until ferroccl's CUDA path exists), and synchronising a stream
//! before running on host memory in its order.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: c_uint = 2;
const CUDA_SUCCESS: c_int = 0;

struct Driver {
    pointer_attribute: unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    // Keeps the library mapped for the function pointers above.
    _lib: libloading::Library,
}

/// The driver, when `libcuda.so.1` loads and `cuInit` succeeds.
fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: loading the driver runs its initialisers, which have no
            // preconditions; each symbol is typed with the driver API's C signature.
            unsafe {
                let lib = libloading::Library::new("libcuda.so.1").ok()?;
                let init: libloading::Symbol<unsafe extern "C" fn(c_uint) -> c_int> =
                    lib.get(b"cuInit\0").ok()?;
                if init(0) != CUDA_SUCCESS {
                    return None;
                }
                let pointer_attribute = *lib
                    .get::<unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int>(
                        b"cuPointerGetAttribute\0",
                    )
                    .ok()?;
                let stream_synchronize = *lib
                    .get::<unsafe extern "C" fn(*mut c_void) -> c_int>(b"cuStreamSynchronize\0")
                    .ok()?;
                Some(Driver {
                    pointer_attribute,
                    stream_synchronize,
                    _lib: lib,
                })
            }
        })
        .as_ref()
}

/// Whether `ptr` is CUDA device memory (false where there is no driver).
pub fn is_device_pointer(ptr: *const c_void) -> bool {
    let Some(d) = driver() else {
        return false;
    };
    if ptr.is_null() {
        return false;
    }
    let mut memory_type: c_uint = 0;
    // SAFETY: the attribute query writes one `CUmemorytype` (an unsigned int) to the
    // address given; it fails without writing for pointers CUDA does not know.
    let rc = unsafe {
        (d.pointer_attribute)(
            &mut memory_type as *mut c_uint as *mut c_void,
            ATTRIBUTE_MEMORY_TYPE,
            ptr as u64,
        )
    };
    rc == CUDA_SUCCESS && memory_type == MEMORYTYPE_DEVICE
}

/// Waits for the work queued on `stream` (so a host-memory call runs in the stream's
/// order). `Err` explains why it cannot: no driver, or the driver's error code.
///
/// # Safety
/// `stream` must be a CUDA stream handle of this process (or NULL).
pub unsafe fn synchronize(stream: *mut c_void) -> Result<(), String> {
    let d = driver().ok_or_else(|| {
        "a CUDA stream was given but no CUDA driver could be loaded (libcuda.so.1); pass a \
         NULL stream with host memory"
            .to_string()
    })?;
    // SAFETY: `stream` is the caller's CUDA stream handle, passed through unchanged.
    let rc = unsafe { (d.stream_synchronize)(stream) };
    if rc == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuStreamSynchronize failed with CUDA error {rc}"))
    }
}
