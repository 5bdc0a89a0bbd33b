//! Windows from Python (`ncclMemAlloc` and `ncclCommWindowRegister` on the host):
//! [`SharedMemory`] that numpy arrays and torch tensors can live in, and the [`Window`]
//! handle `Communicator.register_window` returns. Between ranks that are processes of
//! one host, calls on window memory read the peers' buffers in place (single copy)
//! instead of passing every byte through the shared-memory FIFOs.

use std::sync::{Arc, Mutex, Weak};

use ferroccl::Communicator;
use ferroccl::transport::window;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffers::Lent;
use crate::errors::{self, IntoPy};

/// Registers `buf` as a window of `comm` (`ncclCommWindowRegister`): collective, in call
/// order, for `Communicator.register_window` and `ProcessGroup.register_window` alike.
/// A `buf` this rank cannot lend fails the registration on every rank, with its reason.
pub(crate) fn register(
    py: Python<'_>,
    comm: &Arc<Communicator>,
    buf: &Bound<'_, PyAny>,
) -> PyResult<Window> {
    let lent = match Lent::borrow(buf, "register_window: buf", true) {
        Ok(lent) => lent,
        // This rank still takes its part, so that the others fail with its reason
        // rather than wait for it until the timeout.
        Err(e) => {
            let why = e.to_string();
            return Err(py.detach(|| comm.refuse_window(&why))).py_err();
        }
    };
    // Memory outside a SharedMemory (CUDA memory included) is refused by the core, on
    // every rank, naming the rank.
    let (addr, nbytes) = (lent.ptr as usize, lent.bytes);
    // SAFETY: the window keeps the allocation the bytes lie in mapped (the core checks
    // they lie in one) until it is deregistered, so a peer never reads unmapped memory;
    // what the bytes hold while calls run is the caller's, as for any call's buffers.
    let window = py
        .detach(|| unsafe { comm.register_window(addr as *mut u8, nbytes) })
        .py_err()?;
    Ok(Window {
        window: Mutex::new(Some(window)),
        nbytes,
        comm: Arc::downgrade(comm),
    })
}

/// Ends `window` on `comm` (`ncclCommWindowDeregister`): collective, in call order. A
/// second deregistration, or one on another communicator than the window's, is refused
/// and leaves the window as it was.
pub(crate) fn deregister(
    py: Python<'_>,
    comm: &Arc<Communicator>,
    window: &Window,
) -> PyResult<()> {
    if !std::ptr::eq(window.comm.as_ptr(), Arc::as_ptr(comm)) {
        return Err(errors::value_error(
            "deregister_window: the window was registered on another communicator (or \
             process group); deregister it there"
                .into(),
        ));
    }
    let Some(w) = window.take() else {
        return Err(errors::value_error(
            "deregister_window: the window was deregistered already".into(),
        ));
    };
    py.detach(|| comm.deregister_window(w)).py_err()
}

/// `nbytes` zeroed bytes that every process of the host can map: the memory windows
/// are made of. numpy sees it through `__array_interface__`
/// (`numpy.asarray(mem).view(numpy.float32)`; torch: `torch.from_numpy` of that), and
/// the array keeps it alive.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
pub struct SharedMemory {
    memory: window::SharedMemory,
    /// The size asked for (the mapping has at least one byte).
    nbytes: usize,
}

#[pymethods]
impl SharedMemory {
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        Ok(SharedMemory {
            memory: window::SharedMemory::new(nbytes).py_err()?,
            nbytes,
        })
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// numpy's array interface (version 3): `nbytes` writable unsigned bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.nbytes,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.memory.as_ptr() as usize, false))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.nbytes
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferroccl.SharedMemory of {} bytes at {:#x}>",
            self.nbytes,
            self.memory.as_ptr() as usize
        )
    }
}

/// A registered window (`Communicator.register_window`); it keeps its memory mapped
/// for the peers until `Communicator.deregister_window`.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
pub struct Window {
    /// `None` once deregistered.
    window: Mutex<Option<window::Window>>,
    nbytes: usize,
    /// The communicator it was registered on (not kept alive by it).
    comm: Weak<Communicator>,
}

impl Window {
    /// The core's window, taken out (`None`: already deregistered).
    fn take(&self) -> Option<window::Window> {
        self.window.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

#[pymethods]
impl Window {
    /// The size of the registered memory in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Whether it is still registered.
    #[getter]
    fn registered(&self) -> bool {
        self.window
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn __repr__(&self) -> String {
        let state = if self.registered() {
            "registered"
        } else {
            "deregistered"
        };
        format!("<ferroccl.Window of {} bytes, {state}>", self.nbytes)
    }
}
