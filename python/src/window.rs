//! Windows from Python (`ncclMemAlloc` and `ncclCommWindowRegister` on the host):
//! [`SharedMemory`] that numpy arrays and torch tensors can live in, and the [`Window`]
//! handle `Communicator.register_window` returns. Between ranks that are processes of
//! one host, calls on window memory read the peers' buffers in place (single copy)
//! instead of passing every byte through the shared-memory FIFOs.

use std::sync::Mutex;

use ferroccl::transport::window;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPy;

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
}

impl Window {
    pub(crate) fn new(window: window::Window, nbytes: usize) -> Self {
        Window {
            window: Mutex::new(Some(window)),
            nbytes,
        }
    }

    /// The core's window, taken out (`None`: already deregistered).
    pub(crate) fn take(&self) -> Option<window::Window> {
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
