"""PyTorch's own distributed test suite on ferroccl and, in the same run, on Gloo.

It prints how many tests pass, fail and skip on each, with every skip reason, and
writes the same to ``target/torch-suite-report.txt``. ferroccl must have no failures:
what it cannot do is skipped with the missing capability named (``dist_suite.MISSING``
and the suite's own capability tables), never hidden.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT = HERE.parent.parent / "target" / "torch-suite-report.txt"


def start_suite(backend: str, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    """Starts the suite on ``backend``; it writes its results to the returned JUnit file."""
    xml = tmp / f"{backend}.xml"
    env = dict(os.environ, BACKEND=backend, WORLD_SIZE="3", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "dist_suite.py"],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, xml


def suite_results(proc: subprocess.Popen[str], xml: Path) -> dict:
    """Waits for a suite started by ``start_suite`` and counts its JUnit results."""
    try:
        out, _ = proc.communicate(timeout=3000)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the suite ran past 3000 s:\n{out[-3000:]}") from None
    assert xml.exists(), f"the suite wrote no results (exit {proc.returncode}):\n{out[-3000:]}"
    counts: collections.Counter[str] = collections.Counter()
    skips: collections.Counter[str] = collections.Counter()
    failed: list[str] = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "?")
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif (s := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skips[(s.get("message") or "").strip()[:140]] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "skips": skips, "failed": failed, "tail": out[-3000:]}


def test_pytorch_distributed_suite(tmp_path: Path) -> None:
    # Both at once: a run waits more than it computes (the Gloo one alone: 113 s for
    # 70 s of CPU on two cores), as the suite polls for its rank processes.
    started = {b: start_suite(b, tmp_path) for b in ("ferroccl", "gloo")}
    results = {b: suite_results(*s) for b, s in started.items()}
    lines = []
    for backend, r in results.items():
        c = r["counts"]
        lines.append(f"{backend}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        for why, n in r["skips"].most_common():
            lines.append(f"    {n:4d} skipped: {why}")
        for name in r["failed"]:
            lines.append(f"    failed: {name}")
    text = "\n".join(lines)
    print(text)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text + "\n")
    ours = results["ferroccl"]
    assert ours["counts"]["failed"] == 0, f"{ours['failed']}\n{ours['tail']}"
    assert ours["counts"]["passed"] > 50, text
