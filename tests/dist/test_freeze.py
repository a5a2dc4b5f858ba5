"""Freezes compared across ranks (issue 25): under SHARDWISE_DEBUG one rank's change is an
error on every rank; the default path pays no collective for it (issue 35)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import freeze_workers as F


@pytest.mark.parametrize("world", [2, 3])
def test_freeze_on_one_rank_raises_on_every_rank(world: int) -> None:
    # Before engine/core/context.py rank 1's gloo I/O thread aborted the process (SIGABRT:
    # "Received data size doesn't match expected size"), or the ranks hung; run_distributed
    # turns either into DistributedError within the short collective timeout.
    results = run_distributed(F.freeze_on_one_rank, world, timeout_s=120.0,
                              collective_timeout_s=15.0)
    for rank, by_strategy in enumerate(results):
        for strategy, r in by_strategy.items():
            msg = r["message"]
            assert msg is not None, f"rank {rank} {strategy}: the step did not raise"
            assert msg.startswith(f"rank {rank}: ranks disagree on which parameters require "
                                  "grad"), msg
            assert "unit 'blocks.1'" in msg and F.FROZEN in msg, msg
            assert "(7 parameters): rank 1 trains 6" in msg and "requires grad on rank" in msg, msg
            assert "on every rank alike" in msg, msg
            # The job went on after the error: still matched, the same parameters everywhere.
            assert r["same"], f"rank {rank} {strategy}: ranks ended with different parameters"


@pytest.mark.parametrize("world", [2, 3])
def test_freeze_on_every_rank_alike_matches_the_reference(world: int) -> None:
    for diffs in run_distributed(F.freeze_alike_parity, world, timeout_s=180.0):
        bad = {k: v for k, v in diffs.items() if not v <= 1e-5}
        assert not bad, bad
        assert any("frozen grad blocks.0" in k for k in diffs)
        assert any(f"frozen grad {F.FROZEN}" in k for k in diffs)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("debug", [False, True])
def test_checks_only_in_debug_mode_none_alone(world: int, debug: bool) -> None:
    # Two training steps and an eval forward: two checks under debug mode at 2 ranks, none
    # on the default path (it used to issue one all-reduce every step), none alone.
    for r in run_distributed(F.checks_issued, world, debug):
        # (The layout check runs once, at the first forward.)
        assert r == ["layout check"] + (["freeze check"] * 2 if debug and world > 1 else []), r
