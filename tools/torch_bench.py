#!/usr/bin/env python3
"""``dist.all_reduce`` through ferroccl and through Gloo, side by side in one run.

    target/pyenv/bin/python tools/torch_bench.py --ranks 2,4 -b 8 -e 128M --markdown

For each rank count, backend and size (float32 sum, in place, ``async_op=False``): a
barrier, warm-up, then ``iters = clamp(1 GiB / size, 20, --max-iters)`` back-to-back
calls; time = the slowest rank's mean per call; busbw = size / time × 2(n−1)/n (the
conventions of nccl-tests and of the shared baselines' gloo_allreduce_bench.py). The
backends run interleaved per rank count, so both see the same machine.

It also times, at 8 bytes, the layers under ``dist.all_reduce`` on the same ranks:
``ferroccl.Communicator.all_reduce`` (the Python binding, no torch) and, with
``--rust-perf``, the Rust ``all_reduce_perf`` tool: their difference from the torch
figure is the cost of the torch layer and of this package's backend class.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group(args.backend)
    n = dist.get_world_size()
    times: dict[int, float] = {}
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = max(1, nbytes // 4)
        t = torch.zeros(count, dtype=torch.float32)
        iters = max(20, min(args.max_iters, (1 << 30) // max(nbytes, 1)))
        for _ in range(max(5, iters // 5)):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        times[nbytes] = (time.perf_counter() - start) / iters
        check = torch.full((count,), float(rank + 1))
        dist.all_reduce(check)
        assert check[0].item() == n * (n + 1) / 2, "wrong sum"
    binding = None
    if args.backend == "ferroccl":
        # The same 8 bytes through the Python binding alone (no torch dispatch).
        import ferroccl

        store = dist.distributed_c10d._get_default_store()
        comm = ferroccl.Communicator.from_store(torch.distributed.PrefixStore("bench", store), rank, n)
        t = torch.zeros(2, dtype=torch.float32)
        for _ in range(2000):
            comm.all_reduce(t)
        comm.barrier()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                comm.all_reduce(t)
            runs.append((time.perf_counter() - start) / 2000)
        binding = statistics.median(runs)
    dist.destroy_process_group()
    with open(os.environ["TORCH_BENCH_OUT"], "w") as f:
        json.dump({"times": times, "binding_8b": binding}, f)


def launch(args: argparse.Namespace, backend: str, ranks: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for r in range(ranks):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                WORLD_SIZE=str(ranks),
                LOCAL_RANK=str(r),
                GLOO_SOCKET_IFNAME="lo",
                TORCH_BENCH_OUT=os.path.join(tmp, f"{r}.json"),
                OMP_NUM_THREADS="1",
            )
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--backend",
                backend,
                "-b",
                str(args.min_bytes),
                "-e",
                str(args.max_bytes),
                "-f",
                str(args.factor),
                "--max-iters",
                str(args.max_iters),
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                sys.exit(f"torch_bench: a {backend} rank failed ({p.returncode})")
        per_rank = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(ranks)]
    times = {int(k): max(pr["times"][k] for pr in per_rank) for k in per_rank[0]["times"]}
    binding = per_rank[0]["binding_8b"] and max(pr["binding_8b"] for pr in per_rank)
    return {"times": times, "binding_8b": binding}


def rust_perf(path: str, ranks: int) -> float:
    out = subprocess.run(
        [
            path,
            "-np",
            str(ranks),
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "20000",
            "-w",
            "2000",
            "-a",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        cols = line.split()
        if cols and cols[0] == "8":
            return float(cols[5]) * 1e-6
    raise SystemExit("torch_bench: no 8-byte line from " + path)


def human(nbytes: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("-b", "--min-bytes", type=size, default=8)
    p.add_argument("-e", "--max-bytes", type=size, default=128 << 20)
    p.add_argument("-f", "--factor", type=int, default=4)
    p.add_argument("--max-iters", type=int, default=5000)
    p.add_argument("--backends", default="ferroccl,gloo")
    p.add_argument("--rust-perf", help="path of all_reduce_perf, to time the Rust call at 8 B too")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    backends = args.backends.split(",")
    rows = []
    overheads = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        res = {b: launch(args, b, ranks) for b in backends}
        for nbytes in sorted(res[backends[0]]["times"]):
            rows.append((ranks, nbytes, {b: res[b]["times"][nbytes] for b in backends}))
        ours = res.get("ferroccl")
        if ours and ours["binding_8b"]:
            rust = rust_perf(args.rust_perf, ranks) if args.rust_perf else None
            overheads.append((ranks, ours["times"][min(ours["times"])], ours["binding_8b"], rust))
    bus = lambda n, nb, t: nb / t * 2 * (n - 1) / n / 1e9  # noqa: E731
    cell = lambda n, nb, t: f"{t * 1e6:.1f} us" if nb < 4096 else f"{bus(n, nb, t):.2f}"  # noqa: E731
    head = ["ranks", "size"] + [b for b in backends] + [f"{backends[0]}/{b}" for b in backends[1:]]
    sep, end = ("| ", " |") if args.markdown else ("", "")
    print(sep + (" | " if args.markdown else "  ").join(head) + end)
    if args.markdown:
        print("|" + "---|" * len(head))
    for ranks, nbytes, t in rows:
        ratio = [f"{t[b] / t[backends[0]]:.1f}x" for b in backends[1:]]
        vals = [str(ranks), human(nbytes)] + [cell(ranks, nbytes, t[b]) for b in backends] + ratio
        print(sep + (" | " if args.markdown else "  ").join(vals) + end)
    print()
    print("busbw in GB/s from 4 KiB, time per call below; ratio = the other's time / ferroccl's")
    for ranks, torch_t, binding_t, rust_t in overheads:
        line = (
            f"{ranks} ranks, 8 B: dist.all_reduce {torch_t * 1e6:.2f} us, "
            f"ferroccl.Communicator.all_reduce {binding_t * 1e6:.2f} us"
        )
        if rust_t is not None:
            layers = (torch_t - rust_t) * 1e6
            line += f", Rust all_reduce_perf {rust_t * 1e6:.2f} us; torch + backend layers {layers:.2f} us"
        print(line)


if __name__ == "__main__":
    main()
