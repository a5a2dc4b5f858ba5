"""Collective checks (SHARDWISE_DEBUG / sw.set_debug) and errors for dead or stalled ranks."""

from __future__ import annotations

import re

import pytest

from shardwise.testing import DistributedError, run_distributed
from tests.dist import debug_workers as W


@pytest.mark.parametrize(("how", "world", "at_step"), [
    ("extra", 2, 0), ("skip", 3, 0), ("branch", 2, 0), ("skip", 2, 2), ("extra", 3, 1),
])
def test_divergence_is_named_on_every_rank_within_seconds(how: str, world: int,
                                                          at_step: int) -> None:
    # The error must come from the check, not the (one minute) collective timeout: each rank
    # raised CollectiveMismatchError, which only the check raises (a timeout is a plain
    # CollectiveError). A type, not a time: no bound a loaded machine can break.
    errors = run_distributed(W.diverge, world, how, at_step, collective_timeout_s=60)
    assert errors == ["CollectiveMismatchError"] * world, errors


def test_debug_does_not_change_the_numbers() -> None:
    losses = run_distributed(W.matching_runs_pass_with_debug, 3)
    assert losses[0] == losses[1] == losses[2]


def test_debug_off_by_default_trains() -> None:
    run_distributed(W.agree_without_debug, 2)


def test_env_variable_turns_debug_on() -> None:
    with pytest.raises(DistributedError) as info:
        # No set_debug call in this worker: only the environment turns the check on.
        run_distributed(_diverge_by_env, 2, env={"SHARDWISE_DEBUG": "1"},
                        collective_timeout_s=60)
    # The check's own error, not the collective timeout's (no time bound needed).
    assert "CollectiveMismatchError" in str(info.value)


def _diverge_by_env(rank: int, world: int) -> None:
    model = W._sharded()
    if rank == 1:
        model.plan = [0, 2, 3]
    W._step(model, 0)


def test_dead_rank_error_names_the_collective_and_unit() -> None:
    with pytest.raises(DistributedError) as info:
        run_distributed(W.dies, 2, timeout_s=90, collective_timeout_s=20)
    text = str(info.value)
    # Rank 0 raised (a hang would read "ranks [0, 1] gave no result"): no time bound needed.
    assert "--- rank 0 ---" in text and "CollectiveError" in text, text
    assert re.search(r"(all_gather|reduce_scatter|all_reduce\(sum\)) for (unit '[\w.]+'|the root "
                     r"unit).* on ranks \[0, 1\]", text), text


def test_stalled_rank_fails_the_others_after_the_timeout() -> None:
    with pytest.raises(DistributedError) as info:
        run_distributed(W.stalls, 2, 12.0, timeout_s=90, collective_timeout_s=3)
    text = str(info.value)
    # Rank 0's own error names the 3 s timeout: it did not wait for the 12 s stall.
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert "CollectiveError" in rank0 and "timeout of 3 s" in rank0, text
    assert re.search(r"for (unit '[\w.]+'|the root unit)", rank0), rank0
