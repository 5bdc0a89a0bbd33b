//! `Work`: the handle of a call issued through the binding, and the thread that runs
//! its Python callbacks.
//!
//! A call's outcome is recorded the moment it has run (by the progress thread, or
//! before the call returns when it ran in the caller's thread). Callbacks registered
//! with `add_done_callback` (the torch backend completes its futures with them) run on
//! one notifier thread of the module, never on a communicator's progress thread: that
//! thread must not wait for the GIL while later calls queue behind it.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferroccl::pg;
use pyo3::prelude::*;

use crate::calls::Batch;

/// A failure, kept so that it can be raised again (as the same kind of exception).
#[derive(Clone, Debug)]
pub enum Failure {
    /// The call's arguments were wrong.
    Invalid(String),
    /// A deadline passed.
    Timeout(String),
    /// Anything else (a peer failed, an abort).
    Other(String),
}

impl Failure {
    /// The failure of a ferroccl error.
    pub fn of(e: &ferroccl::Error) -> Self {
        use ferroccl::Error as E;
        match e {
            E::InvalidArgument { .. } => Failure::Invalid(e.to_string()),
            E::Timeout { .. } | E::StoreTimeout { .. } | E::BootstrapTimeout { .. } => {
                Failure::Timeout(e.to_string())
            }
            _ => Failure::Other(e.to_string()),
        }
    }

    /// As a Python exception.
    pub fn to_py(&self) -> PyErr {
        match self {
            Failure::Invalid(t) => crate::errors::value_error(t.clone()),
            Failure::Timeout(t) => crate::errors::timeout_error(t.clone()),
            Failure::Other(t) => crate::errors::FerrocclError::new_err(t.clone()),
        }
    }
}

/// What the issuing side and the running side share.
#[derive(Default)]
struct Outcome {
    /// `Some` once the call has run.
    result: Option<Result<(), Failure>>,
    /// Callbacks waiting for it.
    callbacks: Vec<Py<PyAny>>,
}

type Callbacks = (Vec<Py<PyAny>>, Result<(), Failure>);

/// The notifier thread's queue (started on first use).
fn notifier() -> &'static Mutex<Sender<Callbacks>> {
    static QUEUE: OnceLock<Mutex<Sender<Callbacks>>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Callbacks>();
        let spawned = std::thread::Builder::new()
            .name("ferroccl-py-callbacks".into())
            .spawn(move || {
                for (callbacks, result) in rx {
                    // Once the interpreter is shutting down nobody waits for these.
                    let _ = Python::try_attach(|py| run_callbacks(py, callbacks, &result));
                }
            });
        if let Err(e) = spawned {
            // Callbacks will then never run; say so once rather than fail every call.
            eprintln!("ferroccl: cannot start the callback thread: {e}");
        }
        Mutex::new(tx)
    })
}

/// What a callback is called with: None on success, else the exception.
fn callback_arg(py: Python<'_>, result: &Result<(), Failure>) -> Py<PyAny> {
    match result {
        Ok(()) => py.None(),
        Err(f) => f.to_py().into_value(py).into_any(),
    }
}

fn run_callbacks(py: Python<'_>, callbacks: Vec<Py<PyAny>>, result: &Result<(), Failure>) {
    for cb in callbacks {
        if let Err(e) = cb.call1(py, (callback_arg(py, result),)) {
            // A callback's own error must not stop the others (or the thread).
            e.print(py);
        }
    }
}

/// The running side's half: records the outcome and hands waiting callbacks to the
/// notifier.
#[derive(Clone)]
pub struct Completion(Arc<Mutex<Outcome>>);

impl Completion {
    /// Records `result`.
    pub fn complete(&self, result: Result<(), Failure>) {
        let callbacks = {
            let mut o = self.0.lock().unwrap_or_else(|p| p.into_inner());
            o.result = Some(result.clone());
            std::mem::take(&mut o.callbacks)
        };
        if !callbacks.is_empty() {
            let queue = notifier().lock().unwrap_or_else(|p| p.into_inner());
            let _ = queue.send((callbacks, result));
        }
    }

    /// The `around` of a raw call that runs `batch`: its copies before and after, then
    /// the outcome.
    pub fn around(&self, batch: Arc<Batch>) -> pg::Around {
        let (before, done) = (batch.clone(), self.clone());
        pg::Around {
            before: before
                .has_copies()
                .then(|| Box::new(move || before.copy_before()) as Box<dyn FnOnce() + Send>),
            after: Some(Box::new(move |r| {
                if r.is_ok() {
                    batch.copy_after();
                }
                done.complete(r.map_err(Failure::of));
            })),
        }
    }
}

/// The handle of an issued call: `wait`, `is_completed`, `exception`, and callbacks.
#[pyclass(module = "ferroccl._ferroccl")]
pub struct Work {
    /// The process group's handle; `None` once waited for (or for a call that needed
    /// no communication).
    work: Mutex<Option<pg::Work<Arc<Batch>>>>,
    outcome: Arc<Mutex<Outcome>>,
    op: &'static str,
}

impl Work {
    /// A handle for a call about to be issued, and the half that completes it.
    pub fn pending(op: &'static str) -> (Self, Completion) {
        let outcome = Arc::new(Mutex::new(Outcome::default()));
        let work = Work {
            work: Mutex::new(None),
            outcome: outcome.clone(),
            op,
        };
        (work, Completion(outcome))
    }

    /// A call that has already finished (a call queued in a coalescing window, whose
    /// window's own `Work` is the one to wait for).
    pub fn done(op: &'static str) -> Self {
        let (w, c) = Self::pending(op);
        c.complete(Ok(()));
        w
    }

    /// Attaches the process group's handle.
    pub fn attach(&self, work: pg::Work<Arc<Batch>>) {
        *self.work.lock().unwrap_or_else(|p| p.into_inner()) = Some(work);
    }

    fn result(&self) -> Option<Result<(), Failure>> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .result
            .clone()
    }
}

#[pymethods]
impl Work {
    /// Waits until the call has run (at most `timeout` seconds, when given) and raises
    /// its error if it failed. Returns True. The GIL is released while waiting.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let taken = self.work.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(work) = taken {
            let finished = py.detach(|| match timeout {
                None => Ok(work.wait()),
                Some(t) => work
                    .wait_timeout(Duration::from_secs_f64(t.max(0.0)))
                    .map_err(Box::new),
            });
            match finished {
                // The batch (the tensors' references) is dropped here, attached.
                Ok(r) => drop(r),
                Err(work) => {
                    *self.work.lock().unwrap_or_else(|p| p.into_inner()) = Some(*work);
                    return Err(crate::errors::timeout_error(format!(
                        "{}: wait timed out after {:.3} s; the call is still running",
                        self.op,
                        timeout.unwrap_or_default()
                    )));
                }
            }
        }
        match self.result() {
            Some(Err(f)) => Err(f.to_py()),
            _ => Ok(true),
        }
    }

    /// Whether the call has run (successfully or not).
    fn is_completed(&self) -> bool {
        self.result().is_some()
    }

    /// Whether the call has run successfully.
    fn is_success(&self) -> bool {
        matches!(self.result(), Some(Ok(())))
    }

    /// The exception the call failed with, or None.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.result()
            .filter(Result::is_err)
            .map(|r| callback_arg(py, &r))
    }

    /// Calls `callback(error)` once the call has run (`error` is None on success, else
    /// the exception): at once if it has, else on ferroccl's callback thread.
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let done = {
            let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
            match &o.result {
                Some(r) => Some(r.clone()),
                None => {
                    o.callbacks.push(callback.clone_ref(py));
                    None
                }
            }
        };
        if let Some(r) = done {
            callback.call1(py, (callback_arg(py, &r),))?;
        }
        Ok(())
    }

    /// The operation's name.
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }

    fn __repr__(&self) -> String {
        let state = match self.result() {
            None => "running",
            Some(Ok(())) => "completed",
            Some(Err(_)) => "failed",
        };
        format!("<ferroccl.Work {} {state}>", self.op)
    }
}
