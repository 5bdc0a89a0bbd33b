"""ferroccl.Communicator on CUDA device memory one level below torch (whose CUDA runtime
cannot run on a simulated driver): rank processes allocate through the CUDA driver and
pass their buffers by the CUDA Array Interface (cuda_array_rank.py). Under ``cargo test``
the driver is the tests' simulated one (``FERROCCL_TEST_SIM_ENV``, set by
tests/python.rs), and the ranks on one GPU reach each other's FIFOs through CUDA IPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def simulated_driver_env() -> dict[str, str]:
    text = os.environ.get("FERROCCL_TEST_SIM_ENV")
    if not text:
        pytest.skip("no GPU here and no simulated driver given: run through `cargo test` (tests/python.rs builds it)")
    env: dict[str, str] = json.loads(text)
    return env


@pytest.mark.parametrize(("world", "gpus"), [(2, 2), (3, 1)])
def test_collectives_on_cuda_array_interface_memory(world: int, gpus: int) -> None:
    env = dict(os.environ)
    env.update(simulated_driver_env())
    env["FERROCCL_SIM_GPUS"] = str(gpus)
    with tempfile.TemporaryDirectory(prefix="ferroccl-cai-") as tmp:
        id_file = os.path.join(tmp, "id")
        procs = [
            subprocess.Popen(
                [sys.executable, str(HERE / "cuda_array_rank.py"), str(r), str(world), id_file],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world)
        ]
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append((p.returncode, out))
    for r, (code, out) in enumerate(outputs):
        assert code == 0 and "OK 92 calls" in out, f"rank {r} exited with {code}:\n{out[-4000:]}"
