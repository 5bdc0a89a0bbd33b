"""Launching ranks for the Python tests: one process per rank, meeting through torch's
TCPStore (``env://``), each running one scenario of ``ranks.py`` and writing its result
as JSON. A rank that hangs is killed at the deadline, so a test fails instead of
hanging."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    """A port free now for the store to listen on, chosen below Linux's ephemeral range
    (32768-60999): a port the kernel handed out (``bind(0)``) can be given again, as
    the local end of some outgoing connection, before the store binds it."""
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


class Ranks:
    """The outcome of one launch: each rank's exit code, output and JSON result."""

    def __init__(self, codes: list[int | None], outputs: list[str], results: list[Any], seconds: float):
        self.codes = codes
        self.outputs = outputs
        self.results = results
        self.seconds = seconds

    def check(self) -> list[Any]:
        """Every rank's result, after asserting that every rank exited cleanly."""
        for r, (code, out) in enumerate(zip(self.codes, self.outputs)):
            assert code == 0, f"rank {r} exited with {code}:\n{out[-4000:]}"
        return self.results


def launch(
    scenario: str,
    world: int,
    *args: str,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> Ranks:
    """Runs ``ranks.py scenario args…`` as ``world`` ranks and collects their results.
    Runs them again on another port, up to 3 times in all, when the store could not
    listen because another process took its port meanwhile (EADDRINUSE), and, for the
    Gloo reference runs only, when a rank died in Gloo's teardown ("terminate called
    without an active exception": PyTorch's Gloo worker threads at process exit, see
    pytorch/pytorch#179291), which CI met once under load. A ferroccl run is run again
    only for a lost port."""
    for _ in range(3):
        ranks = _launch_once(scenario, world, *args, timeout=timeout, env=env)
        failed = [out for code, out in zip(ranks.codes, ranks.outputs) if code != 0]
        lost_port = any("EADDRINUSE" in out for out in failed)
        gloo_teardown = "gloo" in args and any("terminate called without an active exception" in out for out in failed)
        if not (lost_port or gloo_teardown):
            break
    return ranks


def _launch_once(
    scenario: str,
    world: int,
    *args: str,
    timeout: float,
    env: dict[str, str] | None,
) -> Ranks:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ferroccl-pytest-") as tmp:
        procs = []
        for r in range(world):
            e = dict(os.environ)
            e.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                FERROCCL_TEST_RESULT=os.path.join(tmp, f"rank{r}.json"),
                PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1",
            )
            e.update(env or {})
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "ranks.py"), scenario, *args],
                    env=e,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        start = time.monotonic()
        codes: list[int | None] = []
        outputs: list[str] = []
        for p in procs:
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n[harness: killed after {timeout} s]"
            codes.append(p.returncode)
            outputs.append(out)
        seconds = time.monotonic() - start
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            results.append(json.loads(Path(path).read_text()) if os.path.exists(path) else None)
    return Ranks(codes, outputs, results, seconds)
