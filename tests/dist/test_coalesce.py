"""Small units share collectives ([Note: coalesced units] in engine/core/schedule.py, issue 43
part 2): one all-gather and one reduce-scatter per group of consecutive small units, with the
same numbers as each unit alone and as unsharded training.

One run of processes per world size trains every case at three budgets (0: each unit alone;
1,500 bytes: several groups, the big block alone; the default 4 MiB: one group) on blocks
whose sizes divide by neither 2 nor 3.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from shardwise.testing import run_distributed
from tests.dist import coalesce_workers as W

CASES = ["mlp", "grad_op", "frozen", "no_sync", "checkpoint", "twice"]
TOL = 1e-5
ROOT_AND_SMALL = ["<root>", "blocks.0", "blocks.1", "blocks.2"]
TAIL = ["blocks.4", "blocks.5", "blocks.6"]
EVERY = ["<root>", *(f"blocks.{i}" for i in range(7))]


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    return run_distributed(W.coalesce_cases, world, CASES, timeout_s=600)


def _counts(log: list[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, _ in log:
        out[op] = out.get(op, 0) + 1
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_coalesced_training_equals_alone_and_unsharded(world: int, case: str) -> None:
    for rank, res in enumerate(_results(world)):
        r = res[case]
        for budget in ("0", str(W.BUDGET), "None"):
            assert r[budget]["worst"] < TOL, (case, budget, rank, r[budget]["worst"])
            assert not r[budget]["frozen moved"], (case, budget, r[budget]["frozen moved"])
        # The same sums of the same numbers, only in other places of the buffers: equal bits.
        assert r["alone vs coalesced"] == 0.0, (case, rank)
        assert r["0"]["groups"] == [], case


@pytest.mark.parametrize("world", [2, 3])
def test_groups_follow_the_budget_and_the_order(world: int) -> None:
    res = _results(world)[0]
    # The big block (about 2 KB gathered) is over 1,500 bytes: alone, and it cuts the run.
    for case in ("mlp", "grad_op", "frozen", "no_sync", "checkpoint"):
        assert res[case][str(W.BUDGET)]["groups"] == [ROOT_AND_SMALL, TAIL], case
        assert res[case]["None"]["groups"] == [EVERY], case
    # A unit that runs twice in a forward stays alone; its neighbours still group.
    for budget in (str(W.BUDGET), "None"):
        groups = res["twice"][budget]["groups"]
        assert groups and all("extra" not in g for g in groups), groups


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_per_step(world: int) -> None:
    res = _results(world)[0]
    # 7 blocks and the root, all resharded after forward (reshard_after_forward=True given
    # to the root too): alone, 8 + 8 all-gathers and 8 reduce-scatters; one group: one
    # all-gather each way, one reduction.
    assert _counts(res["mlp"]["0"]["last step"]) == {"all_gather": 16, "reduce_scatter": 8}
    assert _counts(res["mlp"]["None"]["last step"]) == {"all_gather": 2, "reduce_scatter": 1}
    # Two groups and the big block: 3 gathers forward, 3 backward, 3 reductions.
    assert _counts(res["mlp"][str(W.BUDGET)]["last step"]) == {"all_gather": 6,
                                                               "reduce_scatter": 3}
    # Kept from forward to backward: forward's gathers only.
    assert _counts(res["grad_op"]["None"]["last step"]) == {"all_gather": 1,
                                                            "reduce_scatter": 1}
    # Gradient accumulation: the first micro-batch reduces nothing, the last once.
    assert _counts(res["no_sync"]["None"]["last step"])["reduce_scatter"] == 1


def test_every_rank_issues_the_same_collectives_under_debug() -> None:
    # SHARDWISE_DEBUG's fingerprints compare each collective across ranks before issuing it:
    # a group cut or issued differently on one rank would raise here.
    logs = run_distributed(W.debug_run, 3, timeout_s=300)
    assert logs[0] == logs[1] == logs[2]


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_that_runs_the_units_in_another_order(world: int) -> None:
    """Groups are cut from the first step's order; a later step that skips a member, runs
    them in reverse or stops halfway still trains as unsharded does, and leaves no member
    gathered."""
    res = run_distributed(W.changing_order, world, ["skip", "reverse", "tail"],
                          timeout_s=600)
    for rank_res in res:
        for key, r in rank_res.items():
            assert r["worst"] < TOL, (key, r)
            assert r["left unsharded"] == [], (key, r)
