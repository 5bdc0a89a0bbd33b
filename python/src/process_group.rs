//! `ProcessGroup`: the `pg` layer with torch's backend methods.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferroccl::pg::{self, PgOptions};
use pyo3::prelude::*;

use crate::buffers::Lent;
use crate::calls::{AtRoot, Batch, Builder, parse_op};
use crate::communicator::enqueue_cuda;
use crate::errors::{self, IntoPy};
use crate::window::{self, Window};
use crate::work::{Failure, Work};

/// A process group of the `pg` layer, with `torch.distributed`'s backend methods: each
/// issues its tensors' call in order and returns a `Work`; `blocking=True` runs it in
/// the caller's thread (no hand-off) and returns a completed `Work`. Inside a
/// coalescing window (`start_coalescing` … `end_coalescing`) calls are queued and run
/// together as one group.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
pub struct ProcessGroup {
    pg: Mutex<Option<Arc<pg::ProcessGroup>>>,
    /// The calls of an open coalescing window.
    coalescing: Mutex<Option<Batch>>,
    rank: usize,
    size: usize,
}

impl ProcessGroup {
    fn wrap(pg: pg::ProcessGroup) -> Self {
        ProcessGroup {
            rank: pg.rank(),
            size: pg.size(),
            pg: Mutex::new(Some(Arc::new(pg))),
            coalescing: Mutex::new(None),
        }
    }

    fn live(&self) -> PyResult<Arc<pg::ProcessGroup>> {
        self.pg
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                errors::FerrocclError::new_err(format!(
                    "rank {}: the process group has been shut down",
                    self.rank
                ))
            })
    }

    /// Refuses `what` while a coalescing window is open: its calls have not run yet, so
    /// `what` would overtake them.
    fn outside_coalescing(&self, what: &str) -> PyResult<()> {
        if self
            .coalescing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return Err(errors::value_error(format!(
                "rank {}: {what} inside a coalescing window (start_coalescing … \
                 end_coalescing) would overtake its queued calls; call it outside",
                self.rank
            )));
        }
        Ok(())
    }

    fn builder(&self) -> Builder {
        Builder {
            rank: self.rank,
            nranks: self.size,
        }
    }

    /// Issues `batch` as `op` (or queues it in the open coalescing window).
    fn issue(
        &self,
        py: Python<'_>,
        op: &'static str,
        batch: Batch,
        blocking: bool,
    ) -> PyResult<Work> {
        {
            let mut window = self.coalescing.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(w) = window.as_mut() {
                w.extend(batch);
                return Ok(Work::done(op));
            }
        }
        let pg = self.live()?;
        if let Some(device) = batch.device(op)? {
            enqueue_cuda(py, pg.communicator(), batch, device)?;
            return Ok(Work::done(op));
        }
        let (work, completion) = Work::pending(op);
        let batch = Arc::new(batch);
        let around = completion.around(batch.clone());
        let issued = py.detach(|| {
            let calls = batch.calls.clone();
            // SAFETY: the batch (kept by the Work until the calls have run) holds the
            // Python objects whose memory the calls use, with lengths the builder
            // checked; torch's backend contract hands that memory to the call until
            // its Work completes.
            unsafe { pg.issue_raw(op, calls, batch, blocking, around) }
        });
        match issued {
            Ok(w) => work.attach(w),
            // Nothing ran (the desync check failed, the group is shut down).
            Err(e) => completion.complete(Err(Failure::of(&e))),
        }
        Ok(work)
    }

    /// Issues one call per tensor of `tensors` (lent for writing when `write`), added
    /// by `add`, together as `op`.
    fn per_tensor(
        &self,
        py: Python<'_>,
        op: &'static str,
        (tensors, write): (&[Bound<'_, PyAny>], bool),
        blocking: bool,
        add: impl Fn(&Builder, &mut Batch, &Lent) -> PyResult<()>,
    ) -> PyResult<Work> {
        let mut b = Batch::default();
        let builder = self.builder();
        for t in Self::lend(tensors, &format!("{op}: tensors"), write)? {
            add(&builder, &mut b, &t)?;
        }
        self.issue(py, op, b, blocking)
    }

    fn lend<'py>(objs: &[Bound<'py, PyAny>], what: &str, write: bool) -> PyResult<Vec<Lent<'py>>> {
        objs.iter()
            .enumerate()
            .map(|(i, o)| Lent::borrow(o, &format!("{what}[{i}]"), write))
            .collect()
    }
}

/// Elements in `rows` rows of `t` (its first dimension).
fn row_elements(t: &Bound<'_, PyAny>, rows: &[i64], what: &str) -> PyResult<Vec<usize>> {
    let shape: Vec<usize> = t.getattr("shape")?.extract()?;
    let per_row = match shape.split_first() {
        Some((&first, rest)) if first > 0 => rest.iter().product::<usize>(),
        _ => 1,
    };
    rows.iter()
        .map(|&r| {
            usize::try_from(r).map(|r| r * per_row).map_err(|_| {
                errors::value_error(format!("all_to_all: {what} split size {r} is negative"))
            })
        })
        .collect()
}

#[pymethods]
impl ProcessGroup {
    /// The group of `rank` of `size` over `store` (a `torch.distributed` store, or any
    /// object with its methods). `name` names its flight-recorder dumps; `timeout`
    /// (seconds) is the watchdog's (default `FERROCCL_PG_TIMEOUT`, else 600).
    #[new]
    #[pyo3(signature = (store, rank, size, name="default", timeout=None))]
    fn new(
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        rank: usize,
        size: usize,
        name: &str,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let store: Arc<dyn ferroccl::store::Store> = Arc::new(crate::store::PyStore::new(store)?);
        let mut options = PgOptions::from_env().py_err()?;
        if let Some(t) = timeout {
            options.timeout = Duration::try_from_secs_f64(t).map_err(|_| {
                errors::value_error(format!("timeout {t} is not a number of seconds"))
            })?;
        }
        py.detach(|| pg::ProcessGroup::init_named(store, rank, size, name, options))
            .py_err()
            .map(Self::wrap)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// In-place all-reduce of each tensor.
    #[pyo3(signature = (tensors, op="sum", factor=None, blocking=false))]
    fn allreduce(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, PyAny>>,
        op: &str,
        factor: Option<f64>,
        blocking: bool,
    ) -> PyResult<Work> {
        let op = parse_op(op, factor)?;
        let name = if tensors.len() > 1 {
            "allreduce_coalesced"
        } else {
            "all_reduce"
        };
        self.per_tensor(py, name, (&tensors, true), blocking, |bu, b, t| {
            bu.all_reduce(b, t, t, op)
        })
    }

    /// In-place broadcast of each tensor from `root`.
    #[pyo3(signature = (tensors, root, blocking=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, PyAny>>,
        root: i64,
        blocking: bool,
    ) -> PyResult<Work> {
        self.per_tensor(py, "broadcast", (&tensors, true), blocking, |bu, b, t| {
            bu.broadcast(b, t, t, root)
        })
    }

    /// In-place reduce of each tensor to `root`.
    #[pyo3(signature = (tensors, root, op="sum", factor=None, blocking=false))]
    fn reduce(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, PyAny>>,
        root: i64,
        op: &str,
        factor: Option<f64>,
        blocking: bool,
    ) -> PyResult<Work> {
        let op = parse_op(op, factor)?;
        self.per_tensor(py, "reduce", (&tensors, true), blocking, |bu, b, t| {
            bu.reduce(b, t, t, root, op)
        })
    }

    /// `outputs[i][r]` = rank `r`'s `inputs[i]`.
    #[pyo3(signature = (outputs, inputs, blocking=false))]
    fn allgather(
        &self,
        py: Python<'_>,
        outputs: Vec<Vec<Bound<'_, PyAny>>>,
        inputs: Vec<Bound<'_, PyAny>>,
        blocking: bool,
    ) -> PyResult<Work> {
        let mut b = Batch::default();
        lists_match("all_gather", outputs.len(), inputs.len())?;
        for (out, input) in outputs
            .iter()
            .zip(Self::lend(&inputs, "allgather: inputs", false)?)
        {
            let out = Self::lend(out, "allgather: outputs", true)?;
            self.builder().all_gather_list(&mut b, &input, &out)?;
        }
        self.issue(py, "all_gather", b, blocking)
    }

    /// `outputs[i]` (one tensor of `size` blocks) = every rank's `inputs[i]`.
    #[pyo3(signature = (outputs, inputs, blocking=false))]
    fn all_gather_single(
        &self,
        py: Python<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Bound<'_, PyAny>>,
        blocking: bool,
    ) -> PyResult<Work> {
        let mut b = Batch::default();
        lists_match("all_gather", outputs.len(), inputs.len())?;
        let ins = Self::lend(&inputs, "all_gather_single: inputs", false)?;
        for (o, i) in Self::lend(&outputs, "all_gather_single: outputs", true)?
            .iter()
            .zip(&ins)
        {
            self.builder().all_gather(&mut b, i, o)?;
        }
        self.issue(py, "all_gather", b, blocking)
    }

    /// On `root`, `outputs[0][r]` = rank `r`'s `inputs[0]`.
    #[pyo3(signature = (outputs, inputs, root, blocking=false))]
    fn gather(
        &self,
        py: Python<'_>,
        outputs: Vec<Vec<Bound<'_, PyAny>>>,
        inputs: Vec<Bound<'_, PyAny>>,
        root: i64,
        blocking: bool,
    ) -> PyResult<Work> {
        let mut b = Batch::default();
        let ins = Self::lend(&inputs, "gather: inputs", false)?;
        for (i, input) in ins.iter().enumerate() {
            let out = match outputs.get(i) {
                Some(o) if self.rank as i64 == root => Self::lend(o, "gather: outputs", true)?,
                _ => Vec::new(),
            };
            self.builder()
                .gather(&mut b, input, AtRoot::PerRank(&out), root)?;
        }
        self.issue(py, "gather", b, blocking)
    }

    /// `outputs[0]` = block `rank` of the root's `inputs[0]` (one tensor per rank).
    #[pyo3(signature = (outputs, inputs, root, blocking=false))]
    fn scatter(
        &self,
        py: Python<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Vec<Bound<'_, PyAny>>>,
        root: i64,
        blocking: bool,
    ) -> PyResult<Work> {
        let mut b = Batch::default();
        for (i, output) in Self::lend(&outputs, "scatter: outputs", true)?
            .iter()
            .enumerate()
        {
            let ins = match inputs.get(i) {
                Some(l) if self.rank as i64 == root => Self::lend(l, "scatter: inputs", false)?,
                _ => Vec::new(),
            };
            self.builder()
                .scatter(&mut b, AtRoot::PerRank(&ins), output, root)?;
        }
        self.issue(py, "scatter", b, blocking)
    }

    /// `outputs[i]` = block `rank` of the reduction of every rank's `inputs[i]` (one
    /// tensor per rank).
    #[pyo3(signature = (outputs, inputs, op="sum", factor=None, blocking=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Vec<Bound<'_, PyAny>>>,
        op: &str,
        factor: Option<f64>,
        blocking: bool,
    ) -> PyResult<Work> {
        let op = parse_op(op, factor)?;
        lists_match("reduce_scatter", outputs.len(), inputs.len())?;
        let mut b = Batch::default();
        for (o, ins) in Self::lend(&outputs, "reduce_scatter: outputs", true)?
            .iter()
            .zip(&inputs)
        {
            let ins = Self::lend(ins, "reduce_scatter: inputs", false)?;
            self.builder().reduce_scatter_list(&mut b, &ins, o, op)?;
        }
        self.issue(py, "reduce_scatter", b, blocking)
    }

    /// `outputs[i]` = block `rank` of the reduction of every rank's `inputs[i]` (one
    /// tensor of `size` blocks).
    #[pyo3(signature = (outputs, inputs, op="sum", factor=None, blocking=false))]
    fn reduce_scatter_single(
        &self,
        py: Python<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Bound<'_, PyAny>>,
        op: &str,
        factor: Option<f64>,
        blocking: bool,
    ) -> PyResult<Work> {
        let op = parse_op(op, factor)?;
        lists_match("reduce_scatter", outputs.len(), inputs.len())?;
        let ins = Self::lend(&inputs, "reduce_scatter_single: inputs", false)?;
        let mut b = Batch::default();
        for (o, i) in Self::lend(&outputs, "reduce_scatter_single: outputs", true)?
            .iter()
            .zip(&ins)
        {
            self.builder().reduce_scatter(&mut b, i, o, op)?;
        }
        self.issue(py, "reduce_scatter", b, blocking)
    }

    /// Rows of `input` to each rank and from each rank into `output`: equal blocks, or
    /// `input_splits[j]` rows to rank `j` and `output_splits[i]` rows from rank `i`.
    #[pyo3(signature = (output, input, output_splits, input_splits, blocking=false))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_splits: Vec<i64>,
        input_splits: Vec<i64>,
        blocking: bool,
    ) -> PyResult<Work> {
        let (o, i) = (
            Lent::borrow(output, "all_to_all_single: output", true)?,
            Lent::borrow(input, "all_to_all_single: input", false)?,
        );
        let outs = (!output_splits.is_empty())
            .then(|| row_elements(output, &output_splits, "output"))
            .transpose()?;
        let ins = (!input_splits.is_empty())
            .then(|| row_elements(input, &input_splits, "input"))
            .transpose()?;
        let mut b = Batch::default();
        self.builder()
            .all_to_all(&mut b, &i, &o, ins.as_deref(), outs.as_deref())?;
        self.issue(py, "all_to_all", b, blocking)
    }

    /// `inputs[j]` to rank `j`; `outputs[i]` from rank `i`.
    #[pyo3(signature = (outputs, inputs, blocking=false))]
    fn alltoall(
        &self,
        py: Python<'_>,
        outputs: Vec<Bound<'_, PyAny>>,
        inputs: Vec<Bound<'_, PyAny>>,
        blocking: bool,
    ) -> PyResult<Work> {
        let (o, i) = (
            Self::lend(&outputs, "alltoall: outputs", true)?,
            Self::lend(&inputs, "alltoall: inputs", false)?,
        );
        let mut b = Batch::default();
        self.builder().all_to_all_list(&mut b, &i, &o)?;
        self.issue(py, "all_to_all", b, blocking)
    }

    /// Sends each tensor to `peer`.
    #[pyo3(signature = (tensors, peer, blocking=false))]
    fn send(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, PyAny>>,
        peer: i64,
        blocking: bool,
    ) -> PyResult<Work> {
        self.per_tensor(py, "send", (&tensors, false), blocking, |bu, b, t| {
            bu.send(b, t, peer)
        })
    }

    /// Receives each tensor from `peer`.
    #[pyo3(signature = (tensors, peer, blocking=false))]
    fn recv(
        &self,
        py: Python<'_>,
        tensors: Vec<Bound<'_, PyAny>>,
        peer: i64,
        blocking: bool,
    ) -> PyResult<Work> {
        self.per_tensor(py, "recv", (&tensors, true), blocking, |bu, b, t| {
            bu.recv(b, t, peer)
        })
    }

    /// Completes once every rank has called it.
    #[pyo3(signature = (blocking=false))]
    fn barrier(&self, py: Python<'_>, blocking: bool) -> PyResult<Work> {
        let mut b = Batch::default();
        self.builder().barrier(&mut b)?;
        self.issue(py, "barrier", b, blocking)
    }

    /// Opens a coalescing window: calls are queued until `end_coalescing`.
    fn start_coalescing(&self) -> PyResult<()> {
        let mut w = self.coalescing.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_some() {
            return Err(errors::value_error(
                "start_coalescing: a coalescing window is already open".into(),
            ));
        }
        *w = Some(Batch::default());
        Ok(())
    }

    /// Closes the window and issues its calls together as one group.
    #[pyo3(signature = (blocking=false))]
    fn end_coalescing(&self, py: Python<'_>, blocking: bool) -> PyResult<Work> {
        let batch = self
            .coalescing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| errors::value_error("end_coalescing without start_coalescing".into()))?;
        let name = crate::calls::batch_name(&batch.calls, "coalesced");
        self.issue(py, name, batch, blocking)
    }

    /// A group of the ranks passing the same `color`, ordered by `key` (collective over
    /// this group; `color=None` takes part and gets None).
    #[pyo3(signature = (color, key=0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i32) -> PyResult<Option<Self>> {
        let pg = self.live()?;
        py.detach(|| pg.split(color, key))
            .py_err()
            .map(|g| g.map(Self::wrap))
    }

    /// Aborts: running and later calls fail at once, and peers waiting on this rank
    /// fail naming it.
    fn abort(&self) {
        if let Ok(pg) = self.live() {
            pg.abort();
        }
    }

    /// Finishes the calls issued so far, then releases the group (later calls fail).
    fn shutdown(&self, py: Python<'_>) {
        let taken = self.pg.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(pg) = taken {
            // Destroying finishes the calls issued so far; a group still shared (a call
            // in flight on another thread holds it) is finished and left to that call.
            py.detach(move || match Arc::try_unwrap(pg) {
                Ok(pg) => drop(pg.destroy()),
                Err(pg) => pg.communicator().flush(),
            });
        }
    }

    /// The first error the group failed with, or None.
    fn failure(&self) -> Option<String> {
        self.live().ok().and_then(|pg| pg.communicator().failure())
    }

    /// Sequence number of the next collective.
    fn sequence_number(&self) -> PyResult<u64> {
        Ok(self.live()?.sequence_number())
    }

    /// Registers `buf` as a window of the group (`ncclCommWindowRegister`): collective,
    /// in call order with the group's calls. `buf` must lie in one `SharedMemory`; calls
    /// on it then read peers' buffers in place (single copy) between rank processes.
    fn register_window(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<Window> {
        self.outside_coalescing("register_window")?;
        window::register(py, self.live()?.communicator(), buf)
    }

    /// Ends a window made by `register_window` (`ncclCommWindowDeregister`):
    /// collective, in call order with the group's calls.
    fn deregister_window(&self, py: Python<'_>, window: &Window) -> PyResult<()> {
        self.outside_coalescing("deregister_window")?;
        window::deregister(py, self.live()?.communicator(), window)
    }

    /// The flight recorder as JSON text (the last calls, their state and times).
    fn flight_recorder(&self) -> PyResult<String> {
        let pg = self.live()?;
        Ok(pg
            .recorder()
            .dump(pg.name(), self.rank, None, "asked")
            .to_string())
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferroccl.ProcessGroup rank {} of {}>",
            self.rank, self.size
        )
    }
}

fn lists_match(call: &str, outputs: usize, inputs: usize) -> PyResult<()> {
    if outputs != inputs {
        return Err(errors::value_error(format!(
            "{call}: {outputs} outputs for {inputs} inputs; they must pair up"
        )));
    }
    Ok(())
}
