"""Engine hygiene (issue 25): a pure predicate, an idempotent finish, no gradient held."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import hygiene_workers as H


def test_has_unreduced_grads_is_a_pure_predicate() -> None:
    assert all(run_distributed(H.predicate_is_pure, 2))


def test_finish_reduce_is_idempotent() -> None:
    assert run_distributed(H.finish_twice_adds_once, 3) == [0.0, 0.0, 0.0]


def test_no_shard_holds_no_gradient_after_zero_grad() -> None:
    assert all(run_distributed(H.no_shard_frees_last_gradient, 2))


@pytest.mark.parametrize("world", [3, 4])
def test_fp16_reduction_divides_before_and_after_the_sum(world: int) -> None:
    # Sum-then-divide gave inf at 3 ranks (3 x 3e4 > 65504); about sqrt(N) before the sum
    # and the rest after, as FSDP2 does, keeps the mean (at 4 ranks all of it is a power of
    # two that the pack divides exactly).
    for r in run_distributed(H.fp16_reduction_stays_finite, world):
        assert r["finite"] == 1.0 and r["worst"] <= 30.0, r


def test_no_sync_reports_each_backward_once() -> None:
    for counts in run_distributed(H.no_sync_backward_events, 2):
        assert counts and set(counts.values()) == {1}, counts
