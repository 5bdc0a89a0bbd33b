//! `ferroccl._ferroccl`: ferroccl's Rust core as a Python extension module.
//!
//! - `Communicator`: the NCCL-shaped API (`ncclCommInitRank`, collectives,
//!   send/recv, groups, split, abort) on buffers Python lends: numpy arrays, anything
//!   with the buffer protocol, CPU torch tensors. Calls block, in the caller's thread,
//!   with the GIL released.
//! - `ProcessGroup`: the `pg` layer (flight recorder, watchdog, desync check) with
//!   torch's backend methods, each returning a `Work` (`work.rs`); `ferroccl.torch` wraps
//!   it as a `torch.distributed` backend.
//!
//! The binding decides nothing itself beyond turning Python objects into ferroccl's
//! calls (`calls.rs`); algorithms, protocols, transports and errors are the core's.

#![warn(missing_docs)]

mod buffers;
mod calls;
mod errors;
mod store;
mod work;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferroccl::Communicator as CoreCommunicator;
use ferroccl::bootstrap::{Bootstrap, UniqueId as CoreUniqueId};
use ferroccl::comm::CommConfig;
use ferroccl::pg::{self, PgOptions};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use buffers::Lent;
use calls::{AtRoot, Batch, Builder, parse_op};
use errors::IntoPy;
use work::{Failure, Work};

/// The 128-byte identity of a communicator to be (`ncclUniqueId`): the address of the
/// store server that `UniqueId()` starts in this process, and a nonce. Pass it (as
/// bytes, its hex text, or pickled) to every rank.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
struct UniqueId(CoreUniqueId);

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

/// One rank's communicator: NCCL's API on buffers Python lends (numpy arrays, any
/// C-contiguous buffer, CPU torch tensors). Every call blocks until this rank's part
/// is done, with the GIL released; inside `with comm.group():` calls are queued and
/// run together when the block ends (as between `ncclGroupStart` and `ncclGroupEnd`).
#[pyclass(module = "ferroccl._ferroccl", frozen)]
struct Communicator {
    comm: Arc<CoreCommunicator>,
    /// Calls queued inside `group()` blocks, and how deep the blocks are nested.
    group: Mutex<(usize, Batch)>,
}

/// Enqueues `batch`, on CUDA memory of `device`, on torch's current stream of that
/// device (for tensors) or the stream `__cuda_array_interface__` memory names, and
/// returns (NCCL's stream semantics: the memory holds the result once that stream gets
/// there). Failures of the device work surface on a later call.
fn enqueue_cuda(
    py: Python<'_>,
    comm: &CoreCommunicator,
    batch: Batch,
    device: usize,
) -> PyResult<()> {
    let stream: usize = match batch.stream {
        Some(s) => s,
        None => py
            .import("torch")?
            .getattr("cuda")?
            .call_method1("current_stream", (device,))?
            .getattr("cuda_stream")?
            .extract()?,
    };
    let held = &batch;
    let r = py.detach(|| {
        // The tensors' device, current for this call only (torch's own current device
        // is left as it was).
        let _current = ferroccl::cuda::Context::primary(device)?.push()?;
        // SAFETY: the batch's calls were checked against the tensors' lengths by the
        // builder. The tensors are used on their current stream, in its order: torch's
        // caching allocator reuses their memory, once freed, only for work queued after
        // this call on the same stream.
        unsafe { comm.enqueue_device(held.raw_calls(), stream as *mut std::ffi::c_void) }
    });
    drop(batch);
    r.py_err()
}

impl Communicator {
    fn wrap(comm: CoreCommunicator) -> Self {
        Communicator {
            comm: Arc::new(comm),
            group: Mutex::new((0, Batch::default())),
        }
    }

    fn builder(&self) -> Builder {
        Builder {
            rank: self.comm.rank(),
            nranks: self.comm.size(),
        }
    }

    /// Runs `batch` now, or queues it inside a group.
    fn run(&self, py: Python<'_>, batch: Batch) -> PyResult<()> {
        {
            let mut g = self.group.lock().unwrap_or_else(|p| p.into_inner());
            if g.0 > 0 {
                g.1.extend(batch);
                return Ok(());
            }
        }
        self.run_now(py, batch)
    }

    fn run_now(&self, py: Python<'_>, batch: Batch) -> PyResult<()> {
        let comm = &self.comm;
        if let Some(device) = batch.device(crate::calls::batch_name(&batch.calls, "call"))? {
            return enqueue_cuda(py, comm, batch, device);
        }
        let r = py.detach(|| {
            batch.copy_before();
            // SAFETY: the batch holds the Python objects whose memory its calls use,
            // checked against the calls' lengths by the builder; the GIL is released
            // but the caller is blocked in this call, as NCCL's blocking contract asks.
            let r = unsafe { comm.group_raw(&batch.calls) };
            if r.is_ok() {
                batch.copy_after();
            }
            r
        });
        drop(batch);
        r.py_err()
    }
}

impl Communicator {
    /// Runs a call that reads all of `send` and writes `recv`, added by `add`.
    fn send_recv(
        &self,
        py: Python<'_>,
        call: &str,
        (send, recv): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
        add: impl FnOnce(&Builder, &mut Batch, &Lent, &Lent) -> PyResult<()>,
    ) -> PyResult<()> {
        let input = Lent::borrow(send, &format!("{call}: send"), false)?;
        let output = Lent::borrow(recv, &format!("{call}: recv"), true)?;
        let mut b = Batch::default();
        add(&self.builder(), &mut b, &input, &output)?;
        self.run(py, b)
    }
}

#[pymethods]
impl Communicator {
    /// Joins the communicator named by `uid` as `rank` of `nranks`
    /// (`ncclCommInitRank`); settings come from the environment.
    #[new]
    fn init_rank(py: Python<'_>, uid: &UniqueId, nranks: usize, rank: usize) -> PyResult<Self> {
        let id = uid.0;
        py.detach(|| CoreCommunicator::init_rank(&id, nranks, rank))
            .py_err()
            .map(Self::wrap)
    }

    /// `env://` initialisation from the launcher's variables (ferrorun, torchrun, srun,
    /// mpirun).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Self> {
        py.detach(CoreCommunicator::from_env)
            .py_err()
            .map(Self::wrap)
    }

    /// Meets the other ranks on `store` (a `torch.distributed` store, or any object with
    /// its `set`/`get`/`add`/`check`/`wait` methods) as `rank` of `size`.
    #[staticmethod]
    fn from_store(
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        rank: usize,
        size: usize,
    ) -> PyResult<Self> {
        let store: Arc<dyn ferroccl::store::Store> = Arc::new(store::PyStore::new(store)?);
        py.detach(|| -> ferroccl::Result<CoreCommunicator> {
            let config = CommConfig::from_env()?;
            let boot = Bootstrap::new(store, rank, size, &config.bootstrap)?;
            CoreCommunicator::from_bootstrap(boot, config)
        })
        .py_err()
        .map(Self::wrap)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.comm.size()
    }

    /// `recv = op(send of every rank)`; in place on `send` when `recv` is None.
    /// `op`: sum, prod, max, min, avg, premul_sum (with `factor`).
    #[pyo3(signature = (send, recv=None, op="sum", factor=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: &str,
        factor: Option<f64>,
    ) -> PyResult<()> {
        let op = parse_op(op, factor)?;
        let input = Lent::borrow(send, "all_reduce: send", recv.is_none())?;
        let output = match recv {
            Some(r) => Lent::borrow(r, "all_reduce: recv", true)?,
            None => Lent::borrow(send, "all_reduce: send", true)?,
        };
        let mut b = Batch::default();
        self.builder().all_reduce(&mut b, &input, &output, op)?;
        self.run(py, b)
    }

    /// The root's `send` into every rank's `recv` (in place on `send` when `recv` is
    /// None).
    #[pyo3(signature = (send, recv=None, root=0))]
    fn broadcast(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: i64,
    ) -> PyResult<()> {
        let input = Lent::borrow(send, "broadcast: send", recv.is_none())?;
        let output = Lent::borrow(recv.unwrap_or(send), "broadcast: recv", true)?;
        let mut b = Batch::default();
        self.builder().broadcast(&mut b, &input, &output, root)?;
        self.run(py, b)
    }

    /// The root's `recv = op(send of every rank)` (in place on `send` when `recv` is
    /// None).
    #[pyo3(signature = (send, recv=None, op="sum", root=0, factor=None))]
    fn reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: &str,
        root: i64,
        factor: Option<f64>,
    ) -> PyResult<()> {
        let op = parse_op(op, factor)?;
        let input = Lent::borrow(send, "reduce: send", recv.is_none())?;
        let output = Lent::borrow(recv.unwrap_or(send), "reduce: recv", true)?;
        let mut b = Batch::default();
        self.builder().reduce(&mut b, &input, &output, root, op)?;
        self.run(py, b)
    }

    /// `recv` = every rank's `send`, concatenated by rank.
    fn all_gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.send_recv(py, "all_gather", (send, recv), |bu, b, i, o| {
            bu.all_gather(b, i, o)
        })
    }

    /// `recv` = block `rank` of `op(send of every rank)`; `send` has `size` blocks.
    #[pyo3(signature = (send, recv, op="sum", factor=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        factor: Option<f64>,
    ) -> PyResult<()> {
        let op = parse_op(op, factor)?;
        self.send_recv(py, "reduce_scatter", (send, recv), |bu, b, i, o| {
            bu.reduce_scatter(b, i, o, op)
        })
    }

    /// Block `j` of `send` to rank `j`; block `i` of `recv` from rank `i`.
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.send_recv(py, "all_to_all", (send, recv), |bu, b, i, o| {
            bu.all_to_all(b, i, o, None, None)
        })
    }

    /// The root's `recv` = every rank's `send`, concatenated by rank (`recv` is only
    /// needed on the root).
    #[pyo3(signature = (send, recv=None, root=0))]
    fn gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: i64,
    ) -> PyResult<()> {
        let input = Lent::borrow(send, "gather: send", false)?;
        let mut b = Batch::default();
        let builder = self.builder();
        match recv {
            Some(r) if builder.rank as i64 == root => {
                let output = Lent::borrow(r, "gather: recv", true)?;
                builder.gather(&mut b, &input, AtRoot::Flat(Some(&output)), root)?;
            }
            _ => builder.gather(&mut b, &input, AtRoot::Flat(None), root)?,
        }
        self.run(py, b)
    }

    /// Block `r` of the root's `send` into rank `r`'s `recv` (`send` is only read on
    /// the root).
    #[pyo3(signature = (send, recv, root=0))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        root: i64,
    ) -> PyResult<()> {
        let output = Lent::borrow(recv, "scatter: recv", true)?;
        let mut b = Batch::default();
        let builder = self.builder();
        match send {
            Some(s) if builder.rank as i64 == root => {
                let input = Lent::borrow(s, "scatter: send", false)?;
                builder.scatter(&mut b, AtRoot::Flat(Some(&input)), &output, root)?;
            }
            _ => builder.scatter(&mut b, AtRoot::Flat(None), &output, root)?,
        }
        self.run(py, b)
    }

    /// Sends `buf` to `peer`, which posts a matching `recv`.
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: i64) -> PyResult<()> {
        let lent = Lent::borrow(buf, "send: buf", false)?;
        let mut b = Batch::default();
        self.builder().send(&mut b, &lent, peer)?;
        self.run(py, b)
    }

    /// Receives into `buf` from `peer`.
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: i64) -> PyResult<()> {
        let lent = Lent::borrow(buf, "recv: buf", true)?;
        let mut b = Batch::default();
        self.builder().recv(&mut b, &lent, peer)?;
        self.run(py, b)
    }

    /// Returns once every rank has called it.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let mut b = Batch::default();
        self.builder().barrier(&mut b)?;
        self.run(py, b)
    }

    /// Starts a group (`ncclGroupStart`): calls are queued until the matching
    /// `group_end`. `with comm.group():` does both.
    fn group_start(&self) {
        self.group.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
    }

    /// Ends a group (`ncclGroupEnd`); the outermost end runs every queued call
    /// together.
    fn group_end(&self, py: Python<'_>) -> PyResult<()> {
        let batch = {
            let mut g = self.group.lock().unwrap_or_else(|p| p.into_inner());
            if g.0 == 0 {
                return Err(errors::value_error("group_end without group_start".into()));
            }
            g.0 -= 1;
            if g.0 > 0 {
                return Ok(());
            }
            std::mem::take(&mut g.1)
        };
        self.run_now(py, batch)
    }

    /// Leaves a group without running what it queued (the block raised); the
    /// outermost discard drops the queued calls.
    fn group_discard(&self) -> PyResult<()> {
        let mut g = self.group.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 == 0 {
            return Err(errors::value_error(
                "group_discard without group_start".into(),
            ));
        }
        g.0 -= 1;
        if g.0 == 0 {
            g.1 = Batch::default();
        }
        Ok(())
    }

    /// Splits the communicator (`ncclCommSplit`): ranks with the same `color` form a
    /// new one, ordered by `key`; `color=None` takes part without joining one (and
    /// gets None). Collective over this communicator.
    #[pyo3(signature = (color, key=0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i32) -> PyResult<Option<Self>> {
        let comm = &self.comm;
        py.detach(|| comm.split(color, key))
            .py_err()
            .map(|c| c.map(Self::wrap))
    }

    /// Aborts (`ncclCommAbort`): calls running on other threads and later ones fail, and
    /// peers waiting on this rank fail naming it.
    fn abort(&self) {
        self.comm.abort();
    }

    /// The first error this communicator failed with, or None
    /// (`ncclCommGetAsyncError`).
    fn failure(&self) -> Option<String> {
        self.comm.failure()
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferroccl.Communicator rank {} of {}>",
            self.comm.rank(),
            self.comm.size()
        )
    }
}

/// A process group of the `pg` layer, with `torch.distributed`'s backend methods: each
/// issues its tensors' call in order and returns a `Work`; `blocking=True` runs it in
/// the caller's thread (no hand-off) and returns a completed `Work`. Inside a
/// coalescing window (`start_coalescing` … `end_coalescing`) calls are queued and run
/// together as one group.
#[pyclass(module = "ferroccl._ferroccl", frozen)]
struct ProcessGroup {
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
        let store: Arc<dyn ferroccl::store::Store> = Arc::new(store::PyStore::new(store)?);
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
        let name = calls::batch_name(&batch.calls, "coalesced");
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

/// The extension module.
#[pymodule]
fn _ferroccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<UniqueId>()?;
    m.add_class::<Communicator>()?;
    m.add_class::<ProcessGroup>()?;
    m.add_class::<Work>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
