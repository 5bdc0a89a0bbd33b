"""Type stubs of ferroccl's extension module (see the package docstring)."""

from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import TypeAlias

__version__: str

Buffer: TypeAlias = Any
"""A torch tensor (CPU, or CUDA: enqueued on torch's current stream), any C-contiguous
object with the CUDA Array Interface (CuPy, Numba: enqueued on the stream it names, the
legacy default stream when it names none), or any C-contiguous object with the buffer
protocol (numpy arrays, bytearray, memoryview); its own memory is used, nothing is
copied."""

class FerrocclError(RuntimeError):
    """A ferroccl call failed; the message names the rank, the operation, its sequence
    number and the rank at fault."""

class FerrocclTimeoutError(FerrocclError, TimeoutError):
    """A call or rendezvous passed its deadline; the message names the ranks waited on."""

class InvalidArgumentError(FerrocclError, ValueError):
    """A call was given an argument that can never work; nothing was sent."""

class UniqueId:
    """The 128-byte identity of a communicator to be (``ncclUniqueId``)."""

    def __init__(self) -> None:
        """A new id; starts the rendezvous store server in this process."""

    @staticmethod
    def from_bytes(data: bytes) -> UniqueId: ...
    @staticmethod
    def from_hex(text: str) -> UniqueId: ...
    def __bytes__(self) -> bytes: ...

class Communicator:
    """One rank's communicator: NCCL's API on buffers Python lends. Calls block with the
    GIL released; inside ``with ferroccl.group(comm):`` they run together at the end."""

    def __init__(self, uid: UniqueId, nranks: int, rank: int) -> None:
        """Joins the communicator named by ``uid`` (``ncclCommInitRank``)."""

    @staticmethod
    def from_env() -> Communicator:
        """``env://`` initialisation (ferrorun, torchrun, srun, mpirun)."""

    @staticmethod
    def from_store(store: Any, rank: int, size: int) -> Communicator:
        """Meets the other ranks on a ``torch.distributed`` store (or any object with its
        methods)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def all_reduce(
        self, send: Buffer, recv: Buffer | None = None, op: str = "sum", factor: float | None = None
    ) -> None:
        """``recv = op(send of every rank)``; in place when ``recv`` is None. ``op``: sum,
        prod, max, min, avg, premul_sum (with ``factor``)."""

    def broadcast(self, send: Buffer, recv: Buffer | None = None, root: int = 0) -> None: ...
    def reduce(
        self, send: Buffer, recv: Buffer | None = None, op: str = "sum", root: int = 0, factor: float | None = None
    ) -> None: ...
    def all_gather(self, send: Buffer, recv: Buffer) -> None: ...
    def reduce_scatter(self, send: Buffer, recv: Buffer, op: str = "sum", factor: float | None = None) -> None: ...
    def all_to_all(self, send: Buffer, recv: Buffer) -> None: ...
    def gather(self, send: Buffer, recv: Buffer | None = None, root: int = 0) -> None: ...
    def scatter(self, send: Buffer | None, recv: Buffer, root: int = 0) -> None: ...
    def send(self, buf: Buffer, peer: int) -> None: ...
    def recv(self, buf: Buffer, peer: int) -> None: ...
    def barrier(self) -> None: ...
    def group_start(self) -> None: ...
    def group_end(self) -> None: ...
    def group_discard(self) -> None: ...
    def split(self, color: int | None, key: int = 0) -> Communicator | None: ...
    def register_window(self, buf: Buffer) -> Window:
        """Registers ``buf`` as a window (``ncclCommWindowRegister``): collective, in call
        order. ``buf`` must lie in one :class:`SharedMemory` (sizes may differ across
        ranks); ranks that are other processes of the host then read it in place. Fails
        on every rank, naming the rank, if any rank's buffer is not such memory."""

    def deregister_window(self, window: Window) -> None:
        """Ends a window (``ncclCommWindowDeregister``): collective, in call order."""

    def abort(self) -> None: ...
    def failure(self) -> str | None: ...

class SharedMemory:
    """``nbytes`` zeroed bytes that every process of the host can map (``ncclMemAlloc``
    on the host): the memory windows are made of. numpy sees it through
    ``__array_interface__`` (``numpy.asarray(mem).view(numpy.float32)``; torch:
    ``torch.from_numpy`` of that), and the array keeps it alive."""

    def __init__(self, nbytes: int) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

class Window:
    """A registered window (:meth:`Communicator.register_window`); it keeps its memory
    mapped for the peers until :meth:`Communicator.deregister_window`."""

    @property
    def nbytes(self) -> int: ...
    @property
    def registered(self) -> bool: ...

class Work:
    """The handle of an issued call."""

    def wait(self, timeout: float | None = None) -> bool:
        """Waits (at most ``timeout`` seconds) and raises the call's error if it failed."""

    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def add_done_callback(self, callback: Callable[[BaseException | None], object]) -> None:
        """Calls ``callback(error)`` once the call has run (at once if it has)."""

    @property
    def op(self) -> str: ...

class ProcessGroup:
    """The ``pg`` layer (flight recorder, watchdog, desync check) with torch's backend
    methods; ``ferroccl.torch`` wraps it."""

    def __init__(
        self, store: Any, rank: int, size: int, name: str = "default", timeout: float | None = None
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def allreduce(
        self, tensors: Sequence[Buffer], op: str = "sum", factor: float | None = None, blocking: bool = False
    ) -> Work: ...
    def broadcast(self, tensors: Sequence[Buffer], root: int, blocking: bool = False) -> Work: ...
    def reduce(
        self, tensors: Sequence[Buffer], root: int, op: str = "sum", factor: float | None = None, blocking: bool = False
    ) -> Work: ...
    def allgather(
        self, outputs: Sequence[Sequence[Buffer]], inputs: Sequence[Buffer], blocking: bool = False
    ) -> Work: ...
    def all_gather_single(
        self, outputs: Sequence[Buffer], inputs: Sequence[Buffer], blocking: bool = False
    ) -> Work: ...
    def gather(
        self, outputs: Sequence[Sequence[Buffer]], inputs: Sequence[Buffer], root: int, blocking: bool = False
    ) -> Work: ...
    def scatter(
        self, outputs: Sequence[Buffer], inputs: Sequence[Sequence[Buffer]], root: int, blocking: bool = False
    ) -> Work: ...
    def reduce_scatter(
        self,
        outputs: Sequence[Buffer],
        inputs: Sequence[Sequence[Buffer]],
        op: str = "sum",
        factor: float | None = None,
        blocking: bool = False,
    ) -> Work: ...
    def reduce_scatter_single(
        self,
        outputs: Sequence[Buffer],
        inputs: Sequence[Buffer],
        op: str = "sum",
        factor: float | None = None,
        blocking: bool = False,
    ) -> Work: ...
    def all_to_all_single(
        self,
        output: Buffer,
        input: Buffer,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        blocking: bool = False,
    ) -> Work: ...
    def alltoall(self, outputs: Sequence[Buffer], inputs: Sequence[Buffer], blocking: bool = False) -> Work: ...
    def send(self, tensors: Sequence[Buffer], peer: int, blocking: bool = False) -> Work: ...
    def recv(self, tensors: Sequence[Buffer], peer: int, blocking: bool = False) -> Work: ...
    def barrier(self, blocking: bool = False) -> Work: ...
    def start_coalescing(self) -> None: ...
    def end_coalescing(self, blocking: bool = False) -> Work: ...
    def split(self, color: int | None, key: int = 0) -> ProcessGroup | None: ...
    def abort(self) -> None: ...
    def shutdown(self) -> None: ...
    def failure(self) -> str | None: ...
    def sequence_number(self) -> int: ...
    def flight_recorder(self) -> str: ...
    def register_window(self, buf: Buffer) -> Window:
        """Registers ``buf`` (in one :class:`SharedMemory`) as a window of the group:
        collective, in call order with the group's calls; refused inside a coalescing
        window."""

    def deregister_window(self, window: Window) -> None:
        """Ends a window made by :meth:`register_window`: collective, in call order."""
