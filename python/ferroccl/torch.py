"""ferroccl as a ``torch.distributed`` backend.

``init_process_group("ferroccl")`` works without importing this module: the package
declares it under torch's ``torch.distributed.backends`` entry points, and torch calls
:func:`register` the first time the name is used. ``"cpu:ferroccl"`` mixes it with
another backend for other devices.

The backend is a subclass of ``torch._C._distributed_c10d.Backend`` (the Python-backend
bridge of torch >= 2.14): torch's ``ProcessGroup`` calls these methods for every
collective, DDP, FSDP2, DTensor and the object collectives included. Each method hands
its tensors, in their own memory, to ferroccl's Rust ``ProcessGroup`` (its flight
recorder, watchdog and desync check included) and wraps the result in a ``Work``: a call
with ``async_op=False`` runs in the caller's thread; an asynchronous one runs in order on
the group's progress thread, and its future completes by itself.

CUDA tensors (not yet run on a GPU: see the README, "GPUs") follow NCCL's stream
semantics: a call is enqueued on the tensors' current stream and returns; its ``Work`` is
an event on that stream (``wait`` makes the caller's current stream wait for it).
Failures of device work surface on a later call of the group.

Everything that decides how data moves is in Rust; this module only translates torch's
arguments (options, ``ReduceOp``, lists of tensors) and makes inputs contiguous.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from . import _ferroccl

__all__ = ["FerrocclBackend", "deregister_window", "empty_shared", "register", "register_window"]

NAME = "ferroccl"


_OP_NAMES: dict[Any, str] = {}


def _reduce_op(op: Any) -> tuple[str, float | None]:
    """torch's ``ReduceOp`` (or its ``RedOpType``) as ferroccl's name and factor."""
    kind = getattr(op, "op", op)
    name = _OP_NAMES.get(kind)
    if name is None:
        name = _OP_NAMES.setdefault(kind, kind.name)
    if name != "PREMUL_SUM":
        return name, None
    factor = op.factor
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError("ferroccl: PREMUL_SUM takes one factor, not a tensor of them")
        factor = factor.item()
    return name, float(factor)


def _seconds(timeout: Any) -> float | None:
    """A torch timeout (``timedelta``; zero or negative means none) in seconds."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return secs if secs > 0 else None


def _blocking(opts: Any) -> bool:
    """Whether torch waits for the call at once (``async_op=False``): it then runs in
    the caller's thread."""
    return not getattr(opts, "asyncOp", True)


class _Staged:
    """Inputs made contiguous for a call, and outputs to copy back once it has run
    (as Gloo does for non-contiguous tensors)."""

    def __init__(self) -> None:
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def input(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def output(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return t
        staged = t.contiguous()
        self.copy_back.append((t, staged))
        return staged

    def inputs(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.input(t) for t in ts]

    def outputs(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.output(t) for t in ts]


class _Work(dist._Work):
    """torch's ``Work`` over ferroccl's: ``wait`` (with a timeout; it raises the call's
    error, naming the rank at fault) and a future that completes by itself with the
    output tensors. (torch 2.15 forwards only ``wait`` and ``get_future`` from a Python
    backend's work: ``is_completed`` on what torch hands the user stays False.)"""

    def __init__(self, work: _ferroccl.Work, result: list[torch.Tensor], staged: _Staged):
        super().__init__()
        self._work = work
        self._result = result
        self._copy_back = staged.copy_back
        self._copied = threading.Lock() if self._copy_back else None

    def _finish(self) -> None:
        if self._copied is None:
            return
        with self._copied:
            for dst, src in self._copy_back:
                dst.copy_(src)
            self._copy_back = []

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait(_seconds(timeout))
        self._finish()
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        result = self._result

        def done(error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
                return
            self._finish()
            fut.set_result(result)

        self._work.add_done_callback(done)
        return fut


class _CudaWork(dist._Work):
    """A call on CUDA tensors, enqueued on their current stream: an event recorded right
    after it. Non-contiguous outputs are copied back on the same stream at once."""

    def __init__(self, result: list[torch.Tensor], staged: _Staged, device: torch.device):
        super().__init__()
        stream = torch.cuda.current_stream(device)
        for dst, src in staged.copy_back:
            dst.copy_(src)
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._result = result
        self._device = device

    def wait(self, timeout: Any = None) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future(devices=[self._device])
        fut.set_result(self._result)
        return fut


_LIVE: set[FerrocclBackend] = set()


class FerrocclBackend(_C10dBackend):
    """A ``torch.distributed`` backend whose collectives run on ferroccl (CPU tensors, and
    CUDA tensors on their current stream)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        *,
        name: str = "default",
        pg: _ferroccl.ProcessGroup | None = None,
        options: Any = None,
    ) -> None:
        super().__init__(rank, size)
        self._options = options if options is not None else _C10dBackend.Options(NAME, timeout=timeout)
        self._timeout = timeout
        self._store = store
        self._name = name
        if pg is None:
            pg = _ferroccl.ProcessGroup(store, rank, size, name=name, timeout=_seconds(timeout))
        self._pg = pg
        self._coalescing = False
        self._window_results: list[torch.Tensor] = []
        # torch keeps only the C++ half of a Python backend in some paths (the debug
        # wrapper of TORCH_DISTRIBUTED_DEBUG=DETAIL): the Python half, whose methods the
        # C++ half calls, lives here until the group shuts down.
        _LIVE.add(self)

    # ----- what torch asks of a backend ---------------------------------------

    @property
    def options(self) -> Any:
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_coalescing(self) -> bool:
        return True

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    def _work(self, work: _ferroccl.Work, result: list[torch.Tensor], staged: _Staged) -> dist._Work:
        if self._coalescing:
            self._window_results.extend(result)
        if result and result[0].is_cuda:
            return _CudaWork(result, staged, result[0].device)
        return _Work(work, result, staged)

    # ----- collectives ----------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        ts = s.outputs(tensors)
        w = self._pg.broadcast(ts, opts.rootRank, _blocking(opts))
        return self._work(w, tensors, s)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        op, factor = _reduce_op(opts.reduceOp)
        w = self._pg.allreduce(s.outputs(tensors), op, factor, _blocking(opts))
        return self._work(w, tensors, s)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        return self.allreduce(tensors, opts)

    def allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        raise NotImplementedError("ferroccl: allreduce_sparse: sparse tensors are not supported")

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        op, factor = _reduce_op(opts.reduceOp)
        w = self._pg.reduce(s.outputs(tensors), opts.rootRank, op, factor, _blocking(opts))
        return self._work(w, tensors, s)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        if inputs and inputs[0].is_cuda:
            # Device memory is not staged in Rust: gather into one flat tensor per input,
            # then copy out, all on the current stream.
            w = None
            for lst, x in zip(output_lists, inputs):
                flat = torch.empty((len(lst), *x.shape), dtype=x.dtype, device=x.device)
                w = self._pg.all_gather_single([flat], [s.input(x)], _blocking(opts))
                for i, t in enumerate(lst):
                    t.copy_(flat[i])
            return self._work(w, [t for lst in output_lists for t in lst], s)
        outs = [s.outputs(lst) for lst in output_lists]
        w = self._pg.allgather(outs, s.inputs(inputs), _blocking(opts))
        return self._work(w, [t for lst in output_lists for t in lst], s)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist._Work:
        # Here output_lists[r][i] is input i of rank r (allgather's lists are [i][r]).
        per_input = [[per_rank[i] for per_rank in output_lists] for i in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist._Work:
        s = _Staged()
        w = self._pg.all_gather_single([s.output(output)], [s.input(input)], _blocking(opts))
        return self._work(w, [output], s)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist._Work:
        s = _Staged()
        w = self._pg.all_gather_single(s.outputs(outputs), s.inputs(inputs), _blocking(opts))
        return self._work(w, list(outputs), s)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        outs = [s.outputs(lst) for lst in output_lists]
        w = self._pg.gather(outs, s.inputs(inputs), opts.rootRank, _blocking(opts))
        return self._work(w, [t for lst in output_lists for t in lst], s)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> dist._Work:
        s = _Staged()
        ins = [s.inputs(lst) for lst in input_lists]
        w = self._pg.scatter(s.outputs(outputs), ins, opts.rootRank, _blocking(opts))
        return self._work(w, list(outputs), s)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any
    ) -> dist._Work:
        s = _Staged()
        op, factor = _reduce_op(opts.reduceOp)
        if outputs and outputs[0].is_cuda:
            # As allgather: one flat input per output, concatenated on the current stream.
            flats = [torch.cat([t.reshape(-1) for t in lst]) for lst in input_lists]
            w = self._pg.reduce_scatter_single(s.outputs(outputs), flats, op, factor, _blocking(opts))
            return self._work(w, list(outputs), s)
        ins = [s.inputs(lst) for lst in input_lists]
        w = self._pg.reduce_scatter(s.outputs(outputs), ins, op, factor, _blocking(opts))
        return self._work(w, list(outputs), s)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist._Work:
        s = _Staged()
        op, factor = _reduce_op(opts.reduceOp)
        w = self._pg.reduce_scatter_single([s.output(output)], [s.input(input)], op, factor, _blocking(opts))
        return self._work(w, [output], s)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist._Work:
        s = _Staged()
        op, factor = _reduce_op(opts.reduceOp)
        w = self._pg.reduce_scatter_single(s.outputs(outputs), s.inputs(inputs), op, factor, _blocking(opts))
        return self._work(w, list(outputs), s)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> dist._Work:
        s = _Staged()
        w = self._pg.all_to_all_single(
            s.output(output), s.input(input), list(output_split_sizes), list(input_split_sizes), _blocking(opts)
        )
        return self._work(w, [output], s)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist._Work:
        s = _Staged()
        w = self._pg.alltoall(s.outputs(outputs), s.inputs(inputs), _blocking(opts))
        return self._work(w, list(outputs), s)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist._Work:
        s = _Staged()
        w = self._pg.send(s.inputs(tensors), dst, False)
        return self._work(w, list(tensors), s)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist._Work:
        s = _Staged()
        w = self._pg.recv(s.outputs(tensors), src, False)
        return self._work(w, list(tensors), s)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist._Work:
        raise NotImplementedError(
            "ferroccl: recv from any source is not supported (NCCL has none either); name the sender"
        )

    def barrier(self, opts: Any) -> dist._Work:
        return _Work(self._pg.barrier(_blocking(opts)), [], _Staged())

    def monitored_barrier(self, opts: Any, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it within ``opts.timeout``."""
        timeout = _seconds(getattr(opts, "timeout", None)) or _seconds(self._timeout) or 1800.0
        _monitored_barrier(self._store, self.rank(), self.size(), timeout, wait_all_ranks)

    # ----- coalescing, groups, lifetime -----------------------------------------

    def start_coalescing(self) -> None:
        self._pg.start_coalescing()
        self._coalescing = True
        self._window_results = []

    def end_coalescing(self) -> dist._Work:
        self._coalescing = False
        results, self._window_results = self._window_results, []
        work = self._pg.end_coalescing(False)
        if results and results[0].is_cuda:
            return _CudaWork(results, _Staged(), results[0].device)
        return _Work(work, results, _Staged())

    def split(self, store: Any, ranks: list[int], opts: Any) -> FerrocclBackend | None:
        ranks = list(ranks)
        if opts is None:
            opts = _C10dBackend.Options(NAME, timeout=self._timeout)
        me = self.rank()
        color = min(ranks) if me in ranks else None
        key = ranks.index(me) if me in ranks else 0
        child = self._pg.split(color, key)
        if child is None:
            return None
        return FerrocclBackend(
            store, key, len(ranks), opts._timeout, name=f"{self._name}/split", pg=child, options=opts
        )

    def perform_nocolor_split(self, device: Any) -> None:
        self._pg.split(None, 0)

    def abort(self) -> None:
        self._pg.abort()

    def shutdown(self) -> None:
        self._pg.shutdown()
        _LIVE.discard(self)

    def _get_sequence_number_for_group(self) -> int:
        return self._pg.sequence_number()

    def flight_recorder(self) -> str:
        """The flight recorder as JSON text (the last calls, their state and times)."""
        return self._pg.flight_recorder()

    def register_window(self, tensor: torch.Tensor) -> _ferroccl.Window:
        """Registers ``tensor``'s memory as a window of this group (collective, in call
        order): it must lie in one :class:`ferroccl.SharedMemory` (see
        :func:`empty_shared`). Calls on it then read the peers' tensors in place."""
        return self._pg.register_window(tensor)

    def deregister_window(self, window: _ferroccl.Window) -> None:
        """Ends a window made by :meth:`register_window` (collective, in call order)."""
        self._pg.deregister_window(window)


def empty_shared(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed CPU tensor in a new :class:`ferroccl.SharedMemory`, the memory
    :func:`register_window` takes (``ncclMemAlloc``'s role; the tensor keeps the memory
    alive). ``size`` as for ``torch.empty``: integers, or one sequence of them."""
    # torch reads `size` as torch.empty does, on the meta device (nothing allocated).
    like = torch.empty(*(size or ((),)), dtype=dtype, device="meta")
    nbytes = like.numel() * like.element_size()
    import numpy  # noqa: PLC0415 (the `torch` extra installs it; needed only here)

    raw = torch.from_numpy(numpy.asarray(_ferroccl.SharedMemory(nbytes)))
    return raw[:nbytes].view(dtype).view(like.shape)


def _backend_of(group: Any) -> FerrocclBackend:
    """The ferroccl backend of ``group`` (the default group when None) for CPU tensors."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("windows: this rank is not a member of the group")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a checking one.
    backend = getattr(backend, "wrapped_pg", backend)
    if not isinstance(backend, FerrocclBackend):
        raise ValueError(
            f"the group's backend for CPU tensors is {dist.get_backend(pg)!r}, not {NAME!r}: windows are ferroccl's"
        )
    return backend


def register_window(tensor: torch.Tensor, group: Any = None) -> _ferroccl.Window:
    """Registers ``tensor`` (in :class:`ferroccl.SharedMemory`, e.g. from
    :func:`empty_shared`) as a window of ``group`` (default: the world), collective over
    it as ``ncclCommWindowRegister`` is: collectives of the group on tensors in it then
    read the peers' buffers in place (single copy) instead of through the shared-memory
    FIFOs. Ranks must register in the same order; sizes may differ."""
    return _backend_of(group).register_window(tensor)


def deregister_window(window: _ferroccl.Window, group: Any = None) -> None:
    """Ends a window made by :func:`register_window` on the same group (collective)."""
    _backend_of(group).deregister_window(window)


def _monitored_barrier(store: Any, rank: int, size: int, timeout: float, wait_all_ranks: bool) -> None:
    """Rank 0 waits for every rank's arrival key, naming those that miss the deadline;
    the others wait for rank 0's release. Keys are numbered so calls do not mix."""
    seq = store.add("ferroccl/monitored_barrier/calls/" + str(rank), 1)
    prefix = f"ferroccl/monitored_barrier/{seq}"
    store.set(f"{prefix}/arrived/{rank}", b"1")
    delta = timedelta(seconds=timeout)
    if rank != 0:
        try:
            store.wait([f"{prefix}/release"], delta)
        except Exception as e:
            raise _ferroccl.FerrocclTimeoutError(
                f"rank {rank}: monitored_barrier #{seq} timed out after {timeout:.3f} s waiting for rank 0"
            ) from e
        verdict = store.get(f"{prefix}/release")
        if verdict != b"ok":
            raise _ferroccl.FerrocclError(verdict.decode())
        return
    missing = []
    for r in range(1, size):
        try:
            store.wait([f"{prefix}/arrived/{r}"], delta if not missing else timedelta(milliseconds=1))
        except Exception:
            missing.append(r)
            if not wait_all_ranks:
                break
    if missing:
        text = (
            f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
            f"{int(timeout * 1000)} ms (ferroccl monitored_barrier #{seq})"
        )
        store.set(f"{prefix}/release", text.encode())
        raise _ferroccl.FerrocclTimeoutError(f"rank 0: {text}")
    store.set(f"{prefix}/release", b"ok")


def _create(opts: Any, backend_options: Any) -> FerrocclBackend | None:
    """torch's creator (extended API): one backend per process group."""
    if backend_options is None:
        backend_options = _C10dBackend.Options(NAME, timeout=opts.timeout)
    backend_options._timeout = opts.timeout
    backend_options.global_ranks_in_group = opts.global_ranks_in_group
    backend_options.group_name = opts.group_id
    split_from = getattr(opts, "split_from", None)
    if isinstance(split_from, FerrocclBackend):
        # torch splits only for members (the others call perform_nocolor_split).
        return split_from.split(opts.store, opts.global_ranks_in_group, backend_options)
    return FerrocclBackend(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        name=str(opts.group_id or "default"),
        options=backend_options,
    )


_registered = False


def register() -> None:
    """Registers ``"ferroccl"`` with ``torch.distributed`` (idempotent; the entry point
    torch loads by name)."""
    global _registered
    if _registered:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True
