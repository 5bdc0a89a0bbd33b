//! `UniqueId`: the identity of a communicator to be (`ncclUniqueId`).

use ferroccl::bootstrap::UniqueId as CoreUniqueId;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{self, IntoPy};

/// The 128-byte identity of a communicator to be (`ncclUniqueId`): the address of the
/// store server that `UniqueId()` starts in this process, and a nonce. Pass it (as
/// bytes, its hex text, or pickled) to every rank.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
pub struct UniqueId(pub CoreUniqueId);

#[pymethods]
impl UniqueId {
    /// A new id; starts the rendezvous store server in this process
    /// (`ncclGetUniqueId`).
    #[new]
    fn new(py: Python<'_>) -> PyResult<Self> {
        py.detach(CoreUniqueId::new).py_err().map(UniqueId)
    }

    /// The id from its 128 bytes.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        let bytes: &[u8; ferroccl::bootstrap::UNIQUE_ID_BYTES] = data.try_into().map_err(|_| {
            errors::value_error(format!(
                "a UniqueId has {} bytes, not {}",
                ferroccl::bootstrap::UNIQUE_ID_BYTES,
                data.len()
            ))
        })?;
        CoreUniqueId::from_bytes(bytes).py_err().map(UniqueId)
    }

    /// The id from its hex text (`str(uid)`).
    #[staticmethod]
    fn from_hex(text: &str) -> PyResult<Self> {
        text.parse::<CoreUniqueId>().py_err().map(UniqueId)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.0.as_bytes())
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }

    fn __repr__(&self) -> String {
        format!("UniqueId(store at {})", self.0.store_addr())
    }

    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let class = py.get_type::<UniqueId>();
        Ok((class.getattr("from_bytes")?, (self.__bytes__(py),)))
    }
}
