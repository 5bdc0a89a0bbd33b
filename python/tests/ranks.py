"""One rank of a Python test (see harness.py): ``ranks.py SCENARIO [ARGS…]``.

Every scenario checks what it can on its own rank (each rank knows every rank's input,
so it computes the serial reference itself) and writes a JSON result to
``$FERROCCL_TEST_RESULT`` for the test to compare across ranks and backends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def failure(call: Callable[[], Any]) -> str | None:
    """What ``call`` raised, as ``Type: message``, or None when it returned."""
    try:
        call()
        return None
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"


def emit(result: Any) -> None:
    with open(os.environ["FERROCCL_TEST_RESULT"], "w") as f:
        json.dump(result, f)


# ----- collectives against a serial reference ---------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
COUNTS = [0, 1, 7, 131, 4099]


def data(rank: int, count: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (exact in every dtype and every order)."""
    base = torch.arange(count, dtype=torch.int64)
    vals = (base * 7 + rank * 3 + salt) % 4 + 1  # 1..4
    if dtype == torch.bool:
        return (vals + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(vals.float(), (vals + 1).float()).to(dtype)
    return vals.to(dtype)


def reference(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of every rank's input, computed serially in a wide type."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        return stack.any(0) if op in ("SUM", "MAX") else stack.all(0)
    wide = torch.complex128 if dtype.is_complex else (torch.float64 if dtype.is_floating_point else torch.int64)
    stack = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        r = stack.sum(0)
    elif op == "PRODUCT":
        r = stack.prod(0)
    elif op == "MAX":
        r = stack.max(0).values
    elif op == "MIN":
        r = stack.min(0).values
    elif op == "AVG":
        r = stack.sum(0) / len(inputs)
    elif op == "PREMUL_SUM":
        r = (stack * 2.0).sum(0)
    else:
        raise ValueError(op)
    return r.to(dtype)


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["SUM", "MAX", "MIN", "PRODUCT"]
    if dtype.is_complex:
        return ["SUM", "AVG"]
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return ["SUM", "MAX", "MIN"]
    ops = ["SUM", "PRODUCT", "MAX", "MIN"]
    if dtype.is_floating_point:
        ops += ["AVG", "PREMUL_SUM"]
    return ops


def torch_op(name: str) -> Any:
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(2.0)
    return getattr(dist.ReduceOp, name)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, want = got.float(), want.float()
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return torch.allclose(got, want.to(got.dtype), rtol=1e-2, atol=1e-2)
    return torch.equal(got, want.to(got.dtype))


def collectives(backend: str) -> None:
    """Every collective × dtype × op × count (incl. 0, 1, primes, not divisible by the
    ranks), sync and async, contiguous and not, checked against the serial reference."""
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    failures: list[str] = []
    checked = 0

    def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal checked
        checked += 1
        if got.shape != want.shape or not same(got, want):
            failures.append(f"{what}: got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")

    for dtype in DTYPES:
        for count in COUNTS:
            inputs = [data(r, count, dtype) for r in range(WORLD)]
            mine = inputs[RANK]
            for op in ops_for(dtype):
                if op == "PRODUCT" and dtype in (torch.int8, torch.uint8, torch.float16, torch.bfloat16) and WORLD > 3:
                    continue  # 4**4 overflows / rounds; covered on fewer ranks
                want = reference(op, inputs)
                t = mine.clone()
                dist.all_reduce(t, op=torch_op(op))
                expect(f"all_reduce {dtype} {op} n={count}", t, want)
                t = mine.clone()
                work = dist.all_reduce(t, op=torch_op(op), async_op=True)
                work.wait()
                expect(f"all_reduce async {dtype} {op} n={count}", t, want)
                root = count % WORLD
                t = mine.clone()
                dist.reduce(t, root, op=torch_op(op))
                expect(f"reduce root {root} {dtype} {op} n={count}", t, want if RANK == root else mine)
                out = torch.empty_like(mine)
                big = torch.cat([data(RANK, count, dtype, salt=s) for s in range(WORLD)])
                ref_rs = reference(
                    op, [torch.cat([data(r, count, dtype, salt=s) for s in range(WORLD)]) for r in range(WORLD)]
                )
                if count:
                    dist.reduce_scatter_tensor(out, big, op=torch_op(op))
                    expect(
                        f"reduce_scatter_tensor {dtype} {op} n={count}", out, ref_rs[RANK * count : (RANK + 1) * count]
                    )
                    out2 = torch.empty_like(mine)
                    dist.reduce_scatter(out2, [data(RANK, count, dtype, salt=s) for s in range(WORLD)], op=torch_op(op))
                    expect(
                        f"reduce_scatter list {dtype} {op} n={count}", out2, ref_rs[RANK * count : (RANK + 1) * count]
                    )
            # data movement
            root = (count + 1) % WORLD
            t = mine.clone()
            dist.broadcast(t, root)
            expect(f"broadcast root {root} {dtype} n={count}", t, inputs[root])
            outs = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(outs, mine)
            for r in range(WORLD):
                expect(f"all_gather list {dtype} n={count} from {r}", outs[r], inputs[r])
            flat = torch.empty(WORLD * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, mine)
            expect(f"all_gather_into_tensor {dtype} n={count}", flat, torch.cat(inputs))
            gathered = [torch.empty_like(mine) for _ in range(WORLD)] if RANK == root else None
            dist.gather(mine, gathered, dst=root)
            if RANK == root:
                for r in range(WORLD):
                    expect(f"gather {dtype} n={count} from {r}", gathered[r], inputs[r])
            out = torch.empty_like(mine)
            chunks = [data(root, count, dtype, salt=s) for s in range(WORLD)] if RANK == root else None
            dist.scatter(out, chunks, src=root)
            expect(f"scatter {dtype} n={count}", out, data(root, count, dtype, salt=RANK))
            # all-to-all: even blocks, uneven splits, lists
            n = count * WORLD
            send = torch.cat([data(RANK, count, dtype, salt=j) for j in range(WORLD)])
            recv = torch.empty(n, dtype=dtype)
            dist.all_to_all_single(recv, send)
            expect(
                f"all_to_all_single {dtype} n={count}",
                recv,
                torch.cat([data(i, count, dtype, salt=RANK) for i in range(WORLD)]),
            )
            in_splits = [(RANK + j) % 3 + (count % 2) for j in range(WORLD)]
            out_splits = [(i + RANK) % 3 + (count % 2) for i in range(WORLD)]
            send = torch.cat([data(RANK, in_splits[j], dtype, salt=j) for j in range(WORLD)])
            recv = torch.empty(sum(out_splits), dtype=dtype)
            dist.all_to_all_single(recv, send, out_splits, in_splits)
            expect(
                f"all_to_all_single uneven {dtype} n={count}",
                recv,
                torch.cat([data(i, out_splits[i], dtype, salt=RANK) for i in range(WORLD)]),
            )
            outs = [torch.empty(count, dtype=dtype) for _ in range(WORLD)]
            dist.all_to_all(outs, [data(RANK, count, dtype, salt=j) for j in range(WORLD)])
            for i in range(WORLD):
                expect(f"all_to_all list {dtype} n={count} from {i}", outs[i], data(i, count, dtype, salt=RANK))
            # point to point around the ring
            right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
            got = torch.empty_like(mine)
            if RANK % 2 == 0:
                dist.send(mine, right)
                dist.recv(got, left)
            else:
                dist.recv(got, left)
                dist.send(mine, right)
            expect(f"send/recv {dtype} n={count}", got, inputs[left])
            got = torch.empty_like(mine)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, got, left)])
            for req in reqs:
                req.wait()
            expect(f"batch_isend_irecv {dtype} n={count}", got, inputs[left])
    # non-contiguous tensors are made contiguous and copied back
    m = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (RANK + 1)
    view = m[:, ::2]
    dist.all_reduce(view)
    expect(
        "all_reduce non-contiguous",
        m[:, ::2],
        torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2] * sum(range(1, WORLD + 1)),
    )
    expect(
        "all_reduce non-contiguous leaves the rest",
        m[:, 1::2],
        torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, 1::2] * (RANK + 1),
    )
    # a future completes by itself with the outputs
    t = torch.ones(3)
    fut = dist.all_reduce(t, async_op=True).get_future()
    value = fut.wait()
    expect("future value", value[0], torch.full((3,), float(WORLD)))
    # coalesced all-reduce
    ts = [torch.full((k + 1,), float(RANK + k)) for k in range(3)]
    dist.all_reduce_coalesced(ts)
    for k, t in enumerate(ts):
        expect(f"all_reduce_coalesced {k}", t, torch.full((k + 1,), float(sum(r + k for r in range(WORLD)))))
    dist.barrier()
    dist.destroy_process_group()
    emit({"checked": checked, "failures": failures[:50], "failed": len(failures)})


def errors() -> None:
    """Calls that cannot work raise a clear error naming the call; nothing hangs and
    the group stays usable."""
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=60))
    seen = {}
    cases: dict[str, Callable[[], Any]] = {
        "band_float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        "max_complex": lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX),
        "avg_bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG),
        "sum_int16": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)),
        "gather_wrong_size": lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)),
    }
    if torch.cuda.is_available():  # pragma: no cover - no GPU in CI
        cases["cuda"] = lambda: dist.all_reduce(torch.ones(2, device="cuda"))
    for name, call in cases.items():
        seen[name] = failure(call)
    # int16 moves (broadcast) even though it cannot be reduced
    t = torch.full((3,), RANK, dtype=torch.int16)
    dist.broadcast(t, 0)
    seen["int16_broadcast"] = t.tolist()
    t = torch.ones(2)
    dist.all_reduce(t)
    seen["still_usable"] = t.tolist()
    dist.destroy_process_group()
    emit(seen)


def objects(backend: str = "ferroccl") -> None:
    """Object collectives and batch_isend_irecv."""
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": RANK, "name": f"r{RANK}" * (RANK + 1)})
    out["all_gather_object"] = gathered
    objs = [{"k": [1, 2, 3]}, "text", 42] if RANK == 1 % WORLD else [None, None, None]
    dist.broadcast_object_list(objs, src=1 % WORLD)
    out["broadcast_object_list"] = objs
    recv: list[Any] = [None]
    dist.scatter_object_list(recv, [f"for {r}" for r in range(WORLD)] if RANK == 0 else None, src=0)
    out["scatter_object_list"] = recv[0]
    g = [None] * WORLD if RANK == 0 else None
    dist.gather_object(("g", RANK), g, dst=0)
    out["gather_object"] = g
    if RANK in (0, 1):
        if RANK == 0:
            dist.send_object_list([{"hello": "from 0"}, 7], dst=1)
        else:
            lst: list[Any] = [None, None]
            dist.recv_object_list(lst, src=0)
            out["recv_object_list"] = lst
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    a, b = torch.full((5,), float(RANK)), torch.empty(5)
    c, d = torch.arange(3) + RANK, torch.empty(3, dtype=torch.int64)
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, a, right),
            dist.P2POp(dist.irecv, b, left),
            dist.P2POp(dist.irecv, d, right),
            dist.P2POp(dist.isend, c, left),
        ]
    )
    for req in reqs:
        req.wait()
    out["batch_isend_irecv"] = [b.tolist(), d.tolist()]
    dist.destroy_process_group()
    emit(out)


# ----- DDP, FSDP2, DTensor (compared with Gloo by the test) --------------------------


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def weights(m: torch.nn.Module) -> list[list[float]]:
    return [p.detach().double().flatten().tolist() for p in m.parameters()]


def ddp(backend: str, steps: str = "10") -> None:
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    net = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(int(steps)):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    w = weights(net.module)
    # Every rank done with every collective before any tears its group down (Gloo has
    # aborted a rank with "terminate called without an active exception" otherwise).
    dist.barrier()
    dist.destroy_process_group()
    emit({"weights": w})


def fsdp(backend: str, steps: str = "6") -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(int(steps)):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    full = [p.full_tensor().detach().double().flatten().tolist() for p in net.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    emit({"weights": full})


def dtensor(backend: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(7)
    full = torch.randn(8, 6)
    out: dict[str, Any] = {}
    for name, placements in {
        "shard0_rep": [Shard(0), Replicate()],
        "rep_shard1": [Replicate(), Shard(1)],
        "shard0_shard1": [Shard(0), Shard(1)],
    }.items():
        d = distribute_tensor(full, mesh, placements)
        out[f"{name}/local"] = d.to_local().flatten().tolist()
        for target_name, target in {
            "rep": [Replicate(), Replicate()],
            "shard1_shard0": [Shard(1), Shard(0)],
        }.items():
            r = d.redistribute(mesh, target)
            out[f"{name}->{target_name}"] = r.to_local().flatten().tolist()
        out[f"{name}/full"] = d.full_tensor().flatten().tolist()
    # Partial: each rank's local piece summed when made replicated or sharded
    local = torch.full((4, 4), float(RANK + 1))
    from torch.distributed.tensor import DTensor

    p = DTensor.from_local(local, mesh, [Partial(), Partial()])
    out["partial->rep"] = p.redistribute(mesh, [Replicate(), Replicate()]).to_local().flatten().tolist()
    out["partial->shard"] = p.redistribute(mesh, [Shard(0), Replicate()]).to_local().flatten().tolist()
    dist.destroy_process_group()
    emit(out)


# ----- faults ---------------------------------------------------------------------------


def leave_together(ranks: int) -> None:
    """Exits once `ranks` ranks have got here: rank 0 hosts the store, and a rank still
    reading it (a desync check, a watchdog) must not lose it to rank 0's exit."""
    store = dist.distributed_c10d._get_default_store()
    store.add("ferroccl-test/left", 1)
    if RANK == 0:
        deadline = time.monotonic() + 60
        while store.add("ferroccl-test/left", 0) < ranks and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


def fault(victim: str, timeout: str) -> None:
    """Every rank all-reduces in a loop; the victim kills itself (SIGKILL) mid-loop. The
    others must raise, naming it, within the timeout."""
    victim_rank = int(victim)
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=float(timeout)))
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    dist.barrier()

    def loop() -> None:
        for i in range(10_000):
            if RANK == victim_rank and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t)

    start = time.monotonic()
    emit({"raised": failure(loop), "after": time.monotonic() - start})
    leave_together(WORLD - 1)


def desync() -> None:
    """Rank 1 calls a collective with another count than the others: with
    FERROCCL_DESYNC_DEBUG=1 every rank raises, naming the ranks and both calls."""
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=30))
    t = torch.ones(5 if RANK == 1 else 4)
    emit({"raised": failure(lambda: dist.all_reduce(t))})
    leave_together(WORLD)


def stalled(laggard: str, timeout: str) -> None:
    """The laggard stops calling collectives (alive, but stuck elsewhere): the others'
    calls fail once the group's timeout passes (the watchdog's), naming it."""
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=float(timeout)))
    t = torch.ones(4)
    dist.all_reduce(t)
    if RANK == int(laggard):
        time.sleep(12)
        emit({"raised": None})
        leave_together(WORLD)
    start = time.monotonic()
    raised = failure(lambda: dist.all_reduce(t, async_op=True).wait())
    emit({"raised": raised, "after": time.monotonic() - start})
    leave_together(WORLD)


def waits() -> None:
    """``Work.wait(timeout)`` gives up on a call that is still running (it goes on), and
    ``monitored_barrier`` names a rank that does not arrive."""
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    t = torch.zeros(4)
    if RANK == 0:
        work = dist.irecv(t, 1)
        start = time.monotonic()
        out["early_wait"] = failure(lambda: work.wait(timedelta(seconds=0.5)))
        out["waited"] = time.monotonic() - start
        work.wait()  # rank 1 sends after 2 s
        out["received"] = t.tolist()
    elif RANK == 1:
        time.sleep(2)
        dist.send(torch.full((4,), 7.0), 0)
    dist.monitored_barrier(timeout=timedelta(seconds=10))
    out["monitored_barrier"] = "passed"
    if RANK != WORLD - 1:
        out["missing_rank"] = failure(lambda: dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True))
    emit(out)
    leave_together(WORLD)


def split() -> None:
    """With a bound device, torch makes sub-groups by splitting the default group's
    backend (``Backend.split``; the rank outside takes part with no color)."""
    dist.init_process_group("ferroccl", device_id=torch.device("cpu", 0), timeout=timedelta(seconds=60))
    g = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    if RANK < 2:
        t = torch.full((3,), float(RANK + 1))
        dist.all_reduce(t, group=g)
        out = {"sum": t.tolist(), "backend": g._get_backend(torch.device("cpu"))._name}
    dist.barrier()
    dist.destroy_process_group()
    emit(out)


def cuda() -> None:
    """Collectives on CUDA tensors (ranks share the GPUs round-robin), each checked
    against the serial reference computed on the CPU."""
    dev = torch.device("cuda", RANK % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("ferroccl", timeout=timedelta(seconds=120))
    checked: dict[str, bool] = {}
    for dtype in [torch.int32, torch.float32, torch.bfloat16]:
        count = 100_003
        inputs = [data(r, count, dtype) for r in range(WORLD)]
        x = inputs[RANK].to(dev)
        dist.all_reduce(x)
        checked[f"all_reduce {dtype}"] = same(x.cpu(), reference("SUM", inputs))
        outs = [torch.empty(count, dtype=dtype, device=dev) for _ in range(WORLD)]
        dist.all_gather(outs, inputs[RANK].to(dev))
        checked[f"all_gather {dtype}"] = all(same(o.cpu(), i) for o, i in zip(outs, inputs))
        flat = torch.empty(WORLD * count, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(flat, inputs[RANK].to(dev))
        checked[f"all_gather_into_tensor {dtype}"] = same(flat.cpu(), torch.cat(inputs))
        out = torch.empty(count // WORLD, dtype=dtype, device=dev)
        n = (count // WORLD) * WORLD
        dist.reduce_scatter_tensor(out, inputs[RANK][:n].to(dev))
        want = reference("SUM", [i[:n] for i in inputs])[RANK * (n // WORLD) : (RANK + 1) * (n // WORLD)]
        checked[f"reduce_scatter_tensor {dtype}"] = same(out.cpu(), want)
        b = inputs[RANK].to(dev)
        work = dist.broadcast(b, src=WORLD - 1, async_op=True)
        assert work is not None
        work.wait()
        checked[f"broadcast {dtype}"] = same(b.cpu(), inputs[WORLD - 1])
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    emit(checked)


def windows() -> None:
    """Collectives on buffers in ``ferroccl.SharedMemory`` registered as windows (the
    ranks are processes, so peers read them in place), on numpy arrays and a torch
    tensor over the same memory, each against the serial reference; a buffer outside
    such memory is refused on every rank, and the communicator works on after it."""
    import numpy as np

    import ferroccl

    comm = ferroccl.Communicator.from_env()
    count = (1 << 20) + 3  # 4 MiB of float32: large enough for single copy
    inputs = [data(r, count, torch.float32).numpy() for r in range(WORLD)]
    mem = ferroccl.SharedMemory(4 * count * (2 + WORLD))
    arr = np.asarray(mem).view(np.float32)
    send, recv, gathered = arr[:count], arr[count : 2 * count], arr[2 * count :]
    window = comm.register_window(arr)
    total = reference("SUM", [torch.from_numpy(x) for x in inputs]).numpy()
    checked: dict[str, Any] = {"window": repr(window), "memory": len(mem) == mem.nbytes == arr.nbytes}
    send[:] = inputs[RANK]
    comm.all_reduce(send, recv)
    checked["all_reduce"] = bool(np.array_equal(recv, total))
    recv[:] = inputs[RANK]
    comm.all_reduce(recv)
    checked["all_reduce in place"] = bool(np.array_equal(recv, total))
    tensor = torch.from_numpy(recv)
    tensor.copy_(torch.from_numpy(inputs[RANK]))
    comm.all_reduce(tensor, op="max")
    want = reference("MAX", [torch.from_numpy(x) for x in inputs])
    checked["all_reduce max on a torch tensor"] = same(tensor, want)
    comm.all_gather(send, gathered)
    checked["all_gather"] = bool(np.array_equal(gathered, np.concatenate(inputs)))
    share = count // WORLD
    comm.reduce_scatter(gathered[: share * WORLD], recv[:share])
    gathered_everywhere = np.concatenate(inputs)[: share * WORLD]
    want = WORLD * gathered_everywhere[RANK * share : (RANK + 1) * share]
    checked["reduce_scatter"] = bool(np.array_equal(recv[:share], want))
    send[:] = inputs[RANK]
    comm.broadcast(send, root=WORLD - 1)
    checked["broadcast"] = bool(np.array_equal(send, inputs[WORLD - 1]))
    comm.deregister_window(window)
    checked["deregistered"] = not window.registered
    checked["twice"] = failure(lambda: comm.deregister_window(window))
    checked["outside"] = failure(lambda: comm.register_window(np.zeros(16, np.float32)))
    small = np.full(5, float(RANK + 1), np.float32)
    comm.all_reduce(small)
    checked["after"] = small.tolist()
    emit(checked)


def torch_windows() -> None:
    """The same through ``torch.distributed`` on the ferroccl backend: tensors from
    ``ferroccl.torch.empty_shared`` registered with ``ferroccl.torch.register_window``
    (two windows, float32 and bfloat16), each collective against the serial reference,
    synchronous and asynchronous; what is refused, and the group working on after it."""
    import ferroccl.torch as ft

    dist.init_process_group("ferroccl", timeout=timedelta(seconds=60))
    count = (1 << 20) + 3  # 4 MiB of float32: large enough for single copy
    inputs = [data(r, count, torch.float32) for r in range(WORLD)]
    total = reference("SUM", inputs)
    block = ft.empty_shared(count * (2 + WORLD))
    halves = ft.empty_shared(2, count, dtype=torch.bfloat16)
    send, recv, gathered = block[:count], block[count : 2 * count], block[2 * count :]
    windows = [ft.register_window(block), ft.register_window(halves)]
    checked: dict[str, Any] = {
        "shapes": [list(halves.shape), str(halves.dtype), block.numel()],
        "zeroed": bool(torch.count_nonzero(block) == 0),
    }
    send.copy_(inputs[RANK])
    dist.all_reduce(send)
    checked["all_reduce"] = torch.equal(send, total)
    recv.copy_(inputs[RANK])
    dist.all_reduce(recv, op=dist.ReduceOp.MAX, async_op=True).wait()
    checked["all_reduce max, async"] = torch.equal(recv, reference("MAX", inputs))
    halves[0].copy_(inputs[RANK])
    dist.all_reduce(halves[0], op=dist.ReduceOp.AVG)
    checked["all_reduce avg, bfloat16"] = same(halves[0], reference("AVG", [x.bfloat16() for x in inputs]))
    send.copy_(inputs[RANK])
    dist.all_gather_into_tensor(gathered, send)
    checked["all_gather"] = torch.equal(gathered, torch.cat(inputs))
    share = count // WORLD
    dist.reduce_scatter_tensor(recv[:share], gathered[: share * WORLD])
    checked["reduce_scatter"] = torch.equal(recv[:share], WORLD * torch.cat(inputs)[RANK * share : (RANK + 1) * share])
    send.copy_(inputs[RANK])
    dist.broadcast(send, src=WORLD - 1)
    checked["broadcast"] = torch.equal(send, inputs[WORLD - 1])
    # A window is ended on the group it was made on, and nowhere else.
    sub = dist.new_group(backend="ferroccl")
    on_sub = ft.register_window(halves, group=sub)
    checked["other group"] = [failure(lambda: ft.deregister_window(on_sub)), on_sub.registered]
    ft.deregister_window(on_sub, group=sub)
    for w in windows:
        ft.deregister_window(w)
    checked["deregistered"] = [w.registered for w in windows + [on_sub]]
    checked["twice"] = failure(lambda: ft.deregister_window(windows[0]))
    # Without windows, the same call goes through the FIFOs again (the log says so).
    plain = inputs[RANK].clone()
    dist.all_reduce(plain)
    checked["plain after"] = torch.equal(plain, total)
    checked["outside"] = failure(lambda: ft.register_window(torch.zeros(16)))
    # Refused by one rank only (its tensor is strided): every rank fails at once, with
    # that rank's reason, instead of waiting for it.
    mine = block[::2] if RANK == 0 else block
    started = time.monotonic()
    checked["strided on rank 0"] = failure(lambda: ft.register_window(mine))
    checked["refused in s"] = time.monotonic() - started
    gloo = dist.new_group(backend="gloo")
    checked["gloo group"] = failure(lambda: ft.register_window(block, group=gloo))
    first = dist.new_group(ranks=[0], backend="ferroccl")
    checked["not a member"] = None if RANK == 0 else failure(lambda: ft.register_window(block, group=first))
    backend = ft._backend_of(None)
    backend.start_coalescing()
    checked["coalescing"] = failure(lambda: ft.register_window(block))
    backend.end_coalescing().wait()
    small = torch.full((5,), float(RANK + 1))
    dist.all_reduce(small)
    checked["after"] = small.tolist()
    dist.destroy_process_group()
    emit(checked)


SCENARIOS: dict[str, Callable[..., None]] = {
    "cuda": cuda,
    "windows": windows,
    "torch_windows": torch_windows,
    "split": split,
    "waits": waits,
    "desync": desync,
    "stalled": stalled,
    "collectives": collectives,
    "errors": errors,
    "objects": objects,
    "ddp": ddp,
    "fsdp": fsdp,
    "dtensor": dtensor,
    "fault": fault,
}

if __name__ == "__main__":
    try:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
