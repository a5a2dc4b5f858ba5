"""Engine hygiene (issue 25): a pure predicate, an idempotent finish, no gradient held."""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist import hygiene_workers as H


def test_has_unreduced_grads_is_a_pure_predicate() -> None:
    assert all(run_distributed(H.predicate_is_pure, 2))


def test_finish_reduce_is_idempotent() -> None:
    assert run_distributed(H.finish_twice_adds_once, 3) == [0.0, 0.0, 0.0]


def test_no_shard_holds_no_gradient_after_zero_grad() -> None:
    assert all(run_distributed(H.no_shard_frees_last_gradient, 2))
