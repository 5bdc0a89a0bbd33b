"""One rank of test_cuda_array.py: ``cuda_array_rank.py RANK WORLD ID_FILE``.

ferroccl.Communicator on CUDA device memory that is not torch's: buffers allocated
through the CUDA driver (the library ``FERROCCL_CUDA_DRIVER`` names, here the tests'
simulated one) and handed over by the CUDA Array Interface, as CuPy or Numba arrays
would be. Each call is enqueued on the stream the interface names; the rank waits for
that stream and checks its result against the serial reference. Prints ``OK …``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

import numpy as np

import ferroccl

RANK, WORLD, ID_FILE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
DRIVER = ctypes.CDLL(os.environ.get("FERROCCL_CUDA_DRIVER") or "libcuda.so.1", mode=ctypes.RTLD_GLOBAL)


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned CUDA error {rc}")


check(DRIVER.cuInit(0), "cuInit")
_gpus = ctypes.c_int()
check(DRIVER.cuDeviceGetCount(ctypes.byref(_gpus)), "cuDeviceGetCount")
_ctx = ctypes.c_void_p()
check(DRIVER.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), RANK % _gpus.value), "cuDevicePrimaryCtxRetain")
check(DRIVER.cuCtxSetCurrent(_ctx), "cuCtxSetCurrent")
STREAM = ctypes.c_void_p()
check(DRIVER.cuStreamCreate(ctypes.byref(STREAM), 1), "cuStreamCreate")


class DeviceArray:
    """A 1-D array in device memory, exported through ``__cuda_array_interface__``
    (``interface`` overrides entries of the dictionary it exports; ``...`` leaves one
    out)."""

    def __init__(self, count: int, dtype: Any, **interface: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.count = count
        self.ptr = ctypes.c_uint64()
        self.interface = interface
        nbytes = ctypes.c_size_t(max(1, count * self.dtype.itemsize))
        check(DRIVER.cuMemAlloc_v2(ctypes.byref(self.ptr), nbytes), "cuMemAlloc")

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        exported = {
            "shape": (self.count,),
            "typestr": self.dtype.str,
            "data": (self.ptr.value, False),
            "version": 3,
            "strides": None,
            "stream": STREAM.value,
        }
        for key, value in self.interface.items():
            if value is ...:
                del exported[key]
            else:
                exported[key] = value
        return exported

    def upload(self, host: np.ndarray) -> None:
        data = np.ascontiguousarray(host, dtype=self.dtype)
        src = data.ctypes.data_as(ctypes.c_void_p)
        rc = DRIVER.cuMemcpyHtoD_v2(ctypes.c_uint64(self.ptr.value), src, ctypes.c_size_t(data.nbytes))
        check(rc, "cuMemcpyHtoD")

    def download(self) -> np.ndarray:
        out = np.zeros(self.count, dtype=self.dtype)
        check(DRIVER.cuStreamSynchronize(STREAM), "cuStreamSynchronize")
        dst = out.ctypes.data_as(ctypes.c_void_p)
        rc = DRIVER.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(self.ptr.value), ctypes.c_size_t(out.nbytes))
        check(rc, "cuMemcpyDtoH")
        return out

    def free(self) -> None:
        check(DRIVER.cuMemFree_v2(ctypes.c_uint64(self.ptr.value)), "cuMemFree")


def data(rank: int, count: int, dtype: Any) -> np.ndarray:
    return ((np.arange(count) * 7 + rank * 3) % 5).astype(dtype)


def unique_id() -> ferroccl.UniqueId:
    if RANK == 0:
        uid = ferroccl.UniqueId()
        with open(ID_FILE + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.rename(ID_FILE + ".tmp", ID_FILE)
        return uid
    deadline = time.monotonic() + 60
    while not os.path.exists(ID_FILE):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no unique id in {ID_FILE}")
        time.sleep(0.01)
    with open(ID_FILE, "rb") as f:
        return ferroccl.UniqueId.from_bytes(f.read())


def main() -> None:
    comm = ferroccl.Communicator(unique_id(), WORLD, RANK)
    calls = 0
    for dtype in [np.float32, np.int32, np.int8, np.float64]:
        for count in [0, 1, 7, 4099]:
            inputs = [data(r, count, dtype) for r in range(WORLD)]
            total = sum(x.astype(np.int64) for x in inputs).astype(dtype) if count else inputs[0]
            send, recv = DeviceArray(count, dtype), DeviceArray(count, dtype)
            send.upload(inputs[RANK])
            comm.all_reduce(send, recv)
            assert np.array_equal(recv.download(), total), (dtype, count, "all_reduce")
            comm.all_reduce(send)  # in place
            assert np.array_equal(send.download(), total), (dtype, count, "all_reduce in place")
            send.upload(inputs[RANK])
            comm.broadcast(send, recv, root=WORLD - 1)
            assert np.array_equal(recv.download(), inputs[WORLD - 1]), (dtype, count, "broadcast")
            gathered = DeviceArray(count * WORLD, dtype)
            comm.all_gather(send, gathered)
            assert np.array_equal(gathered.download(), np.concatenate(inputs)), (dtype, count, "all_gather")
            big = [data(r, count * WORLD, dtype) for r in range(WORLD)]
            gathered.upload(big[RANK])
            comm.reduce_scatter(gathered, recv)
            want = sum(b.astype(np.int64) for b in big).astype(dtype)[RANK * count : (RANK + 1) * count]
            assert np.array_equal(recv.download(), want), (dtype, count, "reduce_scatter")
            for a in (send, recv, gathered):
                a.free()
            calls += 5
    calls += every_type(comm)
    calls += streams(comm)
    misuse(comm)
    assert comm.failure() is None, comm.failure()
    if hasattr(DRIVER, "ferroccl_simcuda_live"):
        live = (ctypes.c_uint64 * 7)()
        DRIVER.ferroccl_simcuda_live(live)
        # Every non-empty call launched the executor (host code could have read this
        # driver's device memory directly; a GPU's it could not).
        assert live[6] >= calls - 20, f"only {live[6]} kernels launched for {calls} calls"
    print(f"OK {calls} calls on CUDA Array Interface memory, GPU {RANK % _gpus.value} of {_gpus.value}")


def every_type(comm: ferroccl.Communicator) -> int:
    """Every element type the interface can name: the reducing ones all-reduce (bool as
    uint8 with SUM as MAX, complex as pairs of reals), int16 only moves."""
    calls = 0
    for dtype in [np.uint8, np.uint32, np.int64, np.uint64, np.float16, np.bool_, np.complex64, np.complex128]:
        inputs = [data(r, 9, dtype) for r in range(WORLD)]
        if dtype == np.bool_:
            want = np.logical_or.reduce(inputs)
        else:
            want = sum(inputs[1:], inputs[0]).astype(dtype)
        buf = DeviceArray(9, dtype)
        buf.upload(inputs[RANK])
        comm.all_reduce(buf)
        assert np.array_equal(buf.download(), want), (dtype, "all_reduce")
        buf.free()
        calls += 1
    moved = DeviceArray(5, np.int16)
    moved.upload(data(RANK, 5, np.int16))
    comm.broadcast(moved, root=0)
    assert np.array_equal(moved.download(), data(0, 5, np.int16)), "int16 broadcast"
    try:
        comm.all_reduce(moved)
        raise AssertionError("an int16 all-reduce was accepted")
    except ValueError as e:
        assert "int16" in str(e), e
    moved.free()
    return calls + 1


def streams(comm: ferroccl.Communicator) -> int:
    """The stream the interface names: 1 and none are the legacy default stream."""
    calls = 0
    for stream in [1, None, ...]:
        buf = DeviceArray(3, np.int32, stream=stream)
        buf.upload(data(RANK, 3, np.int32))
        comm.all_reduce(buf)
        check(DRIVER.cuCtxSynchronize(), "cuCtxSynchronize")
        assert np.array_equal(buf.download(), sum(data(r, 3, np.int32) for r in range(WORLD))), stream
        buf.free()
        calls += 1
    return calls


def misuse(comm: ferroccl.Communicator) -> None:
    """Interfaces ferroccl cannot use, each refused naming why (every rank alike, so no
    call starts)."""
    cases = [
        ({"strides": (8,)}, "strides"),
        ({"typestr": "<U4"}, "typestr"),
        ({"data": (0, True)}, "read-only"),
        ({"stream": 2}, "per-thread default stream"),
    ]
    for override, needle in cases:
        buf = DeviceArray(4, np.float32)
        if "data" in override:
            override = {"data": (buf.ptr.value, True)}
        buf.interface.update(override)
        try:
            comm.all_reduce(buf)
            raise AssertionError(f"{override} was accepted")
        except ValueError as e:
            assert needle in str(e), (override, e)
        buf.free()


main()
