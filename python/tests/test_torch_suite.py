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


def run_suite(backend: str, tmp: Path) -> dict:
    xml = tmp / f"{backend}.xml"
    env = dict(os.environ, BACKEND=backend, WORLD_SIZE="3", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "dist_suite.py"],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
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
    return {"counts": counts, "skips": skips, "failed": failed, "tail": proc.stdout[-3000:]}


def test_pytorch_distributed_suite(tmp_path: Path) -> None:
    results = {b: run_suite(b, tmp_path) for b in ("ferroccl", "gloo")}
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
