//! `Communicator`: the NCCL-shaped API on buffers Python lends.

use std::sync::{Arc, Mutex};

use ferroccl::Communicator as CoreCommunicator;
use ferroccl::bootstrap::Bootstrap;
use ferroccl::comm::CommConfig;
use pyo3::prelude::*;

use crate::buffers::Lent;
use crate::calls::{AtRoot, Batch, Builder, parse_op};
use crate::errors::{self, IntoPy};
use crate::unique_id::UniqueId;
use crate::window::{self, Window};

/// One rank's communicator: NCCL's API on buffers Python lends (numpy arrays, any
/// C-contiguous buffer, CPU torch tensors). Every call blocks until this rank's part
/// is done, with the GIL released; inside `with comm.group():` calls are queued and
/// run together when the block ends (as between `ncclGroupStart` and `ncclGroupEnd`).
#[pyclass(module = "ferroccl._ferroccl", frozen)]
pub struct Communicator {
    comm: Arc<CoreCommunicator>,
    /// Calls queued inside `group()` blocks, and how deep the blocks are nested.
    group: Mutex<(usize, Batch)>,
}

/// Enqueues `batch`, on CUDA memory of `device`, on torch's current stream of that
/// device (for tensors) or the stream `__cuda_array_interface__` memory names, and
/// returns (NCCL's stream semantics: the memory holds the result once that stream gets
/// there). Failures of the device work surface on a later call.
pub(crate) fn enqueue_cuda(
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
        let store: Arc<dyn ferroccl::store::Store> = Arc::new(crate::store::PyStore::new(store)?);
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

    /// Registers `buf` as a window (`ncclCommWindowRegister`): collective, in call
    /// order. `buf` must lie in one `SharedMemory` (host memory; sizes may differ across
    /// ranks); ranks that are other processes of the host then read it in place. Fails
    /// on every rank, naming the rank, if any rank's buffer is not such memory.
    fn register_window(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<Window> {
        window::register(py, &self.comm, buf)
    }

    /// Ends a window made by `register_window` (`ncclCommWindowDeregister`):
    /// collective, in call order.
    fn deregister_window(&self, py: Python<'_>, window: &Window) -> PyResult<()> {
        window::deregister(py, &self.comm, window)
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
