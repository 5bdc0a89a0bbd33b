"""Windows from Python: ``ferroccl.SharedMemory`` registered with
``Communicator.register_window`` between ranks that are processes (``ranks.py
windows``), where peers read each other's buffers in place."""

from __future__ import annotations

import pytest

from harness import launch


@pytest.mark.parametrize("world", [2, 3])
def test_windows_of_shared_memory_between_processes(world: int) -> None:
    """Ranks as processes (``ranks.py windows``): calls on registered ``SharedMemory``
    take single copy and match the reference; plain memory is refused with its reason."""
    ranks = launch("windows", world, env={"FERROCCL_DEBUG": "INFO"})
    results = ranks.check()
    for rank, r in enumerate(results):
        for what in ["memory", "all_reduce", "all_reduce in place", "all_reduce max on a torch tensor", "all_gather"]:
            assert r[what] is True, f"rank {rank}: {what}: {r}"
        assert r["reduce_scatter"] is True and r["broadcast"] is True and r["deregistered"] is True, r
        assert r["window"].startswith("<ferroccl.Window of "), r
        assert "deregistered already" in r["twice"], r
        assert r["outside"].startswith("InvalidArgumentError"), r
        assert "not in one allocation of shared memory" in r["outside"], r
        assert r["after"] == [world * (world + 1) / 2] * 5, r
        # Peers read the window in place: the large calls took single copy.
        assert "B uses" in ranks.outputs[rank] and "SingleCopy" in ranks.outputs[rank], ranks.outputs[rank]


@pytest.mark.parametrize(("world", "debug"), [(2, "OFF"), (3, "OFF"), (2, "DETAIL")])
def test_windows_through_the_torch_backend(world: int, debug: str) -> None:
    """``ranks.py torch_windows``: ``torch.distributed`` collectives on tensors in
    registered windows take single copy and match the reference; misuse is refused on
    every rank, also when one rank alone is wrong; torch's checking wrapper
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) changes nothing."""
    ranks = launch("torch_windows", world, env={"FERROCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": debug})
    count = (1 << 20) + 3
    for rank, r in enumerate(ranks.check()):
        assert r["shapes"] == [[2, count], "torch.bfloat16", count * (2 + world)], r
        assert r["zeroed"] is True, r
        for what in ["all_reduce", "all_reduce max, async", "all_reduce avg, bfloat16", "all_gather"]:
            assert r[what] is True, f"rank {rank}: {what}: {r}"
        assert r["reduce_scatter"] is True and r["broadcast"] is True and r["plain after"] is True, r
        other, still = r["other group"]
        assert other.startswith("InvalidArgumentError") and "registered on another communicator" in other, r
        assert still is True, r
        assert r["deregistered"] == [False, False, False], r
        assert "deregistered already" in r["twice"], r
        assert "not in one allocation of shared memory" in r["outside"], r
        refused = r["strided on rank 0"]
        assert "registering a window: rank 0: " in refused and "not contiguous" in refused, r
        assert r["refused in s"] < 30, r
        assert "'gloo'" in r["gloo group"] and "not 'ferroccl'" in r["gloo group"], r
        if rank > 0:
            assert "not a member of the group" in r["not a member"], r
        assert "inside a coalescing window" in r["coalescing"], r
        assert r["after"] == [world * (world + 1) / 2] * 5, r
        # The 4 MiB all-reduce read the peers in place while the windows were live, and
        # went through the FIFOs once they were gone.
        marker = f"all_reduce of {4 * count} B uses "
        plans = [line.split(marker)[1] for line in ranks.outputs[rank].splitlines() if marker in line]
        assert any("SingleCopy" in p for p in plans) and "Simple" in plans[-1], plans
