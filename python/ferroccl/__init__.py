"""ferroccl: collective communication from scratch in Rust, from Python.

- :class:`Communicator`: NCCL's API (``ncclCommInitRank``, all-reduce, broadcast, reduce,
  all-gather, reduce-scatter, all-to-all, gather, scatter, send/recv, groups, split,
  abort) on numpy arrays, any C-contiguous buffer, and CPU torch tensors, in their own
  memory. Calls block with the GIL released.
- :class:`SharedMemory` and :meth:`Communicator.register_window`: buffers that ranks in
  other processes of the host read in place (``ncclMemAlloc``, windows).
- :mod:`ferroccl.torch`: the ``torch.distributed`` backend, ``init_process_group("ferroccl")``.

Errors are :class:`FerrocclError` (a ``RuntimeError``) whose text names the rank, the
operation, its sequence number and the rank at fault;
:class:`FerrocclTimeoutError` and :class:`InvalidArgumentError` are its kinds for passed
deadlines and wrong arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._ferroccl import (
    Communicator,
    FerrocclError,
    FerrocclTimeoutError,
    InvalidArgumentError,
    ProcessGroup,
    SharedMemory,
    UniqueId,
    Window,
    Work,
    __version__,
)

__all__ = [
    "Communicator",
    "FerrocclError",
    "FerrocclTimeoutError",
    "InvalidArgumentError",
    "ProcessGroup",
    "SharedMemory",
    "UniqueId",
    "Window",
    "Work",
    "__version__",
    "group",
]


@contextlib.contextmanager
def group(comm: Communicator) -> Iterator[Communicator]:
    """Runs the calls made on ``comm`` inside the block together, as NCCL's
    ``ncclGroupStart`` … ``ncclGroupEnd``: a send and a receive between two ranks in one
    group cannot wait on each other. Nothing runs if the block raises."""
    comm.group_start()
    try:
        yield comm
    except BaseException:
        comm.group_discard()
        raise
    comm.group_end()
