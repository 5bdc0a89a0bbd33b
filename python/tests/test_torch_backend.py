"""ferroccl under torch.distributed: every collective against a serial reference, DDP,
FSDP2 and DTensor against Gloo, object collectives, clear errors, and a killed rank.

The rank scripts never import ferroccl: ``init_process_group("ferroccl")`` finds the
backend through the package's ``torch.distributed.backends`` entry point."""

from __future__ import annotations

import math

import pytest

from harness import launch


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_matches_the_serial_reference(world: int) -> None:
    results = launch("collectives", world, "ferroccl").check()
    for rank, r in enumerate(results):
        assert r["failed"] == 0, f"rank {rank}: {r['failures']}"
        assert r["checked"] > 1500, r


def assert_close(a: list[list[float]], b: list[list[float]], what: str) -> None:
    assert len(a) == len(b), what
    for pa, pb in zip(a, b):
        assert len(pa) == len(pb), what
        for x, y in zip(pa, pb):
            assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6), f"{what}: {x} vs {y}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("scenario", "steps"), [("ddp", 10), ("fsdp", 6)])
def test_training_matches_gloo(scenario: str, steps: int, world: int) -> None:
    # DDP, and FSDP2 (fully_shard): the same model, data and steps on both backends.
    ours = launch(scenario, world, "ferroccl", str(steps)).check()
    gloo = launch(scenario, world, "gloo", str(steps)).check()
    for r in range(1, world):
        assert ours[r]["weights"] == ours[0]["weights"], f"rank {r} differs bitwise from rank 0"
    assert_close(ours[0]["weights"], gloo[0]["weights"], f"ferroccl vs gloo after {steps} {scenario} steps")


def test_dtensor_redistribute_on_a_2x2_mesh_like_gloo() -> None:
    ours = launch("dtensor", 4, "ferroccl").check()
    gloo = launch("dtensor", 4, "gloo").check()
    for r in range(4):
        assert ours[r].keys() == gloo[r].keys()
        for k in ours[r]:
            assert_close([ours[r][k]], [gloo[r][k]], f"rank {r} {k}")
    # Partial placements were summed: every rank contributed rank + 1.
    assert set(ours[0]["partial->rep"]) == {1.0 + 2.0 + 3.0 + 4.0}


@pytest.mark.parametrize("backend", ["ferroccl", "cpu:ferroccl"])
def test_object_collectives_and_batch_isend_irecv(backend: str) -> None:
    world = 3
    results = launch("objects", world, backend).check()
    for rank, r in enumerate(results):
        assert r["all_gather_object"] == [{"rank": q, "name": f"r{q}" * (q + 1)} for q in range(world)]
        assert r["broadcast_object_list"] == [{"k": [1, 2, 3]}, "text", 42]
        assert r["scatter_object_list"] == f"for {rank}"
        left, right = (rank - 1) % world, (rank + 1) % world
        assert r["batch_isend_irecv"] == [[float(left)] * 5, [right, right + 1, right + 2]]
    assert results[0]["gather_object"] == [["g", q] for q in range(world)]
    assert results[1]["recv_object_list"] == [{"hello": "from 0"}, 7]


def test_bad_calls_raise_clear_errors_and_leave_the_group_usable() -> None:
    for r in launch("errors", 2).check():
        assert "BAND" in r["band_float"] and "bitwise" in r["band_float"], r
        assert "MAX" in r["max_complex"] and "complex" in r["max_complex"], r
        assert "AVG" in r["avg_bool"] and "bool" in r["avg_bool"], r
        assert "int16" in r["sum_int16"] and "all_reduce" in r["sum_int16"], r
        assert r["gather_wrong_size"] is not None, r
        assert r["int16_broadcast"] == [0, 0, 0]
        assert r["still_usable"] == [2.0, 2.0]


def test_a_killed_rank_makes_every_other_rank_raise_naming_it() -> None:
    world, victim, timeout = 3, 1, 30
    ranks = launch("fault", world, str(victim), str(timeout), timeout=120)
    assert ranks.codes[victim] == -9
    for r in range(world):
        if r == victim:
            continue
        assert ranks.codes[r] == 0, ranks.outputs[r][-3000:]
        res = ranks.results[r]
        assert res["raised"] is not None, f"rank {r} did not notice"
        assert f"rank {victim}" in res["raised"], res
        assert res["after"] < timeout, res


def test_desync_debug_names_the_ranks_and_both_calls() -> None:
    ranks = launch("desync", 3, env={"FERROCCL_DESYNC_DEBUG": "1"}, timeout=120)
    for r, res in enumerate(ranks.check()):
        assert res["raised"] is not None, f"rank {r} did not notice"
        text = res["raised"]
        assert "[1]" in text and "count 5" in text and "count 4" in text, text


def test_a_stalled_rank_is_named_by_the_watchdog() -> None:
    ranks = launch("stalled", 3, "2", "3", timeout=120)
    for r, res in enumerate(ranks.check()[:2]):
        assert res["raised"] is not None, f"rank {r} did not notice"
        assert "2" in res["raised"] and "timed out" in res["raised"], res
        assert res["after"] < 15, res


def test_wait_with_a_timeout_and_monitored_barrier() -> None:
    world = 3
    res = launch("waits", world, timeout=120).check()
    assert res[0]["early_wait"] is not None and "timed out" in res[0]["early_wait"], res[0]
    assert 0.4 < res[0]["waited"] < 2.0, res[0]
    assert res[0]["received"] == [7.0] * 4
    assert all(r["monitored_barrier"] == "passed" for r in res)
    # The last rank skipped the second barrier: rank 0 names it, the others hear why.
    assert f"Ranks {world - 1}" in res[0]["missing_rank"] or f"{world - 1}" in res[0]["missing_rank"], res[0]
    assert res[1]["missing_rank"] is not None, res[1]


def test_sub_groups_split_from_a_bound_default_group() -> None:
    res = launch("split", 3).check()
    for r in (0, 1):
        assert res[r]["sum"] == [3.0] * 3
        assert res[r]["backend"].endswith("/split"), res[r]
    assert res[2] == {}
