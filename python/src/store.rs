//! A Python store (`torch.distributed.Store`: `TCPStore`, `FileStore`, `HashStore`,
//! `PrefixStore`, or any object with their methods) as a ferroccl [`Store`], so that
//! ranks meet on the store torch hands the backend, not on a second one.
//!
//! Every call attaches to the interpreter for as long as the Python method runs; torch's
//! store methods release the GIL while they block, so a rank waiting in `get` does not
//! stop the others' Python threads. Once the interpreter is shutting down, calls fail
//! with an error instead of attaching.

use std::sync::Mutex;
use std::time::Duration;

use ferroccl::Error;
use ferroccl::store::Store;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A Python store object behind ferroccl's [`Store`] trait.
pub struct PyStore {
    store: Py<PyAny>,
    /// The store's own timeout, read once (torch's stores keep one per object).
    timeout: Mutex<Duration>,
}

impl PyStore {
    /// Wraps `store`, reading its `timeout` (a `timedelta`) when it has one.
    pub fn new(store: &Bound<'_, PyAny>) -> PyResult<Self> {
        let timeout = match store.getattr("timeout") {
            Ok(t) => seconds(&t)?,
            Err(_) => ferroccl::store::DEFAULT_TIMEOUT,
        };
        Ok(PyStore {
            store: store.clone().unbind(),
            timeout: Mutex::new(timeout),
        })
    }

    /// Runs `f` on the store with the interpreter attached; a Python exception becomes
    /// an error naming the operation (a timeout, when torch says so, names `keys`).
    fn call<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        f: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> ferroccl::Result<T> {
        let attached = Python::try_attach(|py| {
            f(self.store.bind(py)).map_err(|e| {
                let text = e.to_string();
                let timed_out = e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py)
                    || text.to_ascii_lowercase().contains("timeout")
                    || text.to_ascii_lowercase().contains("timed out");
                (timed_out, text)
            })
        });
        match attached {
            Some(Ok(v)) => Ok(v),
            Some(Err((true, _))) => Err(Error::StoreTimeout {
                op,
                waited: self.timeout(),
                missing: keys.iter().map(|k| k.to_string()).collect(),
            }),
            Some(Err((false, text))) => Err(Error::io(
                format!("Python store: {op}({keys:?})"),
                std::io::Error::other(text),
            )),
            None => Err(Error::io(
                format!("Python store: {op}({keys:?})"),
                std::io::Error::other("the Python interpreter is shutting down"),
            )),
        }
    }
}

/// Seconds of a `timedelta` (or of a number).
fn seconds(t: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let secs: f64 = match t.call_method0("total_seconds") {
        Ok(s) => s.extract()?,
        Err(_) => t.extract()?,
    };
    Ok(Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX))
}

fn timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    py.import("datetime")?.getattr("timedelta")?.call1((
        0,
        d.as_secs().min(86_400 * 999_999),
        d.subsec_micros(),
    ))
}

fn bytes_of(v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = v.extract::<String>() {
        return Ok(s.into_bytes());
    }
    v.extract::<Vec<u8>>()
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> ferroccl::Result<()> {
        self.call("set", &[key], |s| {
            s.call_method1("set", (key, PyBytes::new(s.py(), value)))
                .map(drop)
        })
    }

    fn get(&self, key: &str) -> ferroccl::Result<Vec<u8>> {
        self.call("get", &[key], |s| bytes_of(&s.call_method1("get", (key,))?))
    }

    fn add(&self, key: &str, delta: i64) -> ferroccl::Result<i64> {
        self.call("add", &[key], |s| {
            s.call_method1("add", (key, delta))?.extract()
        })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> ferroccl::Result<Vec<u8>> {
        self.call("compare_set", &[key], |s| {
            let py = s.py();
            bytes_of(&s.call_method1(
                "compare_set",
                (key, PyBytes::new(py, expected), PyBytes::new(py, desired)),
            )?)
        })
    }

    fn check(&self, keys: &[&str]) -> ferroccl::Result<bool> {
        self.call("check", keys, |s| {
            s.call_method1("check", (PyList::new(s.py(), keys)?,))?
                .extract()
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> ferroccl::Result<()> {
        self.call("wait", keys, |s| {
            let py = s.py();
            s.call_method1("wait", (PyList::new(py, keys)?, timedelta(py, timeout)?))
                .map(drop)
        })
        .map_err(|e| match e {
            Error::StoreTimeout { op, missing, .. } => Error::StoreTimeout {
                op,
                waited: timeout,
                missing,
            },
            other => other,
        })
    }

    fn delete(&self, key: &str) -> ferroccl::Result<bool> {
        self.call("delete_key", &[key], |s| {
            s.call_method1("delete_key", (key,))?.extract()
        })
    }

    fn num_keys(&self) -> ferroccl::Result<usize> {
        self.call("num_keys", &[], |s| s.call_method0("num_keys")?.extract())
    }

    fn multi_get(&self, keys: &[&str]) -> ferroccl::Result<Vec<Vec<u8>>> {
        self.call("multi_get", keys, |s| {
            let values = s.call_method1("multi_get", (PyList::new(s.py(), keys)?,))?;
            values.try_iter()?.map(|v| bytes_of(&v?)).collect()
        })
    }

    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> ferroccl::Result<()> {
        self.call("multi_set", keys, |s| {
            let py = s.py();
            let values: Vec<Bound<'_, PyBytes>> =
                values.iter().map(|v| PyBytes::new(py, v)).collect();
            s.call_method1(
                "multi_set",
                (PyList::new(py, keys)?, PyList::new(py, values)?),
            )
            .map(drop)
        })
    }

    fn append(&self, key: &str, value: &[u8]) -> ferroccl::Result<()> {
        self.call("append", &[key], |s| {
            s.call_method1("append", (key, PyBytes::new(s.py(), value)))
                .map(drop)
        })
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
        let _ = self.call("set_timeout", &[], |s| {
            s.call_method1("set_timeout", (timedelta(s.py(), timeout)?,))
                .map(drop)
        });
    }
}
