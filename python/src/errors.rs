//! ferroccl's errors as Python exceptions: the text is the Rust error's (rank, op,
//! sequence number, culprit), the class says what kind of failure it is.
//!
//! - `FerrocclError(RuntimeError)`: a collective failed (a peer died, the store broke).
//! - `FerrocclTimeoutError(FerrocclError, TimeoutError)`: a deadline passed.
//! - `InvalidArgumentError(FerrocclError, ValueError)`: the call itself was wrong.

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    ferroccl,
    FerrocclError,
    PyRuntimeError,
    "A ferroccl call failed; the message names the rank, the operation, its sequence \
     number and the rank at fault."
);

/// Python classes with two bases are made in Python (`ferroccl/__init__.py` cannot do
/// it for an extension's class either), so these two are made here at import time.
static TIMEOUT_ERROR: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();
static INVALID_ARGUMENT_ERROR: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();

/// Makes the exception classes with two bases and adds every class to `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FerrocclError", py.get_type::<FerrocclError>())?;
    let builtins = py.import("builtins")?;
    let make =
        |name: &str, other: Bound<'_, PyAny>, doc: &str| -> PyResult<Py<pyo3::types::PyType>> {
            let bases =
                pyo3::types::PyTuple::new(py, [py.get_type::<FerrocclError>().into_any(), other])?;
            let ns = pyo3::types::PyDict::new(py);
            ns.set_item("__doc__", doc)?;
            ns.set_item("__module__", "ferroccl")?;
            let class = builtins.getattr("type")?.call1((name, bases, ns))?;
            Ok(class.cast_into::<pyo3::types::PyType>()?.unbind())
        };
    let timeout = make(
        "FerrocclTimeoutError",
        py.get_type::<PyTimeoutError>().into_any(),
        "A ferroccl call or rendezvous passed its deadline; the message names the ranks \
         it waited on.",
    )?;
    let invalid = make(
        "InvalidArgumentError",
        py.get_type::<PyValueError>().into_any(),
        "A ferroccl call was given an argument that can never work (a wrong length, \
         root, type or reduction); nothing was sent.",
    )?;
    m.add("FerrocclTimeoutError", timeout.bind(py))?;
    m.add("InvalidArgumentError", invalid.bind(py))?;
    let _ = TIMEOUT_ERROR.set(py, timeout);
    let _ = INVALID_ARGUMENT_ERROR.set(py, invalid);
    Ok(())
}

fn raise(class: &pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>>, text: String) -> PyErr {
    Python::attach(|py| match class.get(py) {
        Some(c) => PyErr::from_type(c.bind(py).clone(), text),
        None => FerrocclError::new_err(text),
    })
}

/// An [`InvalidArgumentError`] with `text`.
pub fn value_error(text: String) -> PyErr {
    raise(&INVALID_ARGUMENT_ERROR, text)
}

/// A [`FerrocclTimeoutError`] with `text`.
pub fn timeout_error(text: String) -> PyErr {
    raise(&TIMEOUT_ERROR, text)
}

/// The Python exception for a ferroccl error.
pub fn to_py(e: ferroccl::Error) -> PyErr {
    use ferroccl::Error as E;
    match e {
        E::InvalidArgument { .. } | E::KeyTooLong { .. } | E::ValueTooLarge { .. } => {
            value_error(e.to_string())
        }
        E::Timeout { .. } | E::StoreTimeout { .. } | E::BootstrapTimeout { .. } => {
            timeout_error(e.to_string())
        }
        other => FerrocclError::new_err(other.to_string()),
    }
}

/// `Result` conversion for the binding's functions.
pub trait IntoPy<T> {
    /// The ferroccl error as a Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for ferroccl::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
