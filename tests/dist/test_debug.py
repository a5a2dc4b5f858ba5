"""Collective checks (SHARDWISE_DEBUG / sw.set_debug) and errors for dead or stalled ranks."""

from __future__ import annotations

import re
import time

import pytest

from shardwise.testing import DistributedError, run_distributed
from tests.dist import debug_workers as W


@pytest.mark.parametrize(("how", "world", "at_step"), [
    ("extra", 2, 0), ("skip", 3, 0), ("branch", 2, 0), ("skip", 2, 2), ("extra", 3, 1),
])
def test_divergence_is_named_on_every_rank_within_seconds(how: str, world: int,
                                                          at_step: int) -> None:
    # The collective timeout is a minute: the error must come from the check, not a timeout.
    elapsed = run_distributed(W.diverge, world, how, at_step, collective_timeout_s=60)
    assert max(elapsed) < 10, elapsed


def test_debug_does_not_change_the_numbers() -> None:
    losses = run_distributed(W.matching_runs_pass_with_debug, 3)
    assert losses[0] == losses[1] == losses[2]


def test_debug_off_by_default_trains() -> None:
    run_distributed(W.agree_without_debug, 2)


def test_env_variable_turns_debug_on() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        # No set_debug call in this worker: only the environment turns the check on.
        run_distributed(_diverge_by_env, 2, env={"SHARDWISE_DEBUG": "1"},
                        collective_timeout_s=60)
    assert "CollectiveMismatchError" in str(info.value)
    assert time.monotonic() - started < 60


def _diverge_by_env(rank: int, world: int) -> None:
    model = W._sharded()
    if rank == 1:
        model.plan = [0, 2, 3]
    W._step(model, 0)


def test_dead_rank_error_names_the_collective_and_unit() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(W.dies, 2, timeout_s=90, collective_timeout_s=20)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "CollectiveError" in text, text
    assert re.search(r"(all_gather|reduce_scatter|all_reduce\(sum\)) for (unit '[\w.]+'|the root "
                     r"unit).* on ranks \[0, 1\]", text), text
    assert time.monotonic() - started < 60


def test_stalled_rank_fails_the_others_after_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(W.stalls, 2, 12.0, timeout_s=90, collective_timeout_s=3)
    text = str(info.value)
    rank0 = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert "CollectiveError" in rank0 and "timeout of 3 s" in rank0, text
    assert re.search(r"for (unit '[\w.]+'|the root unit)", rank0), rank0
    assert time.monotonic() - started < 60
