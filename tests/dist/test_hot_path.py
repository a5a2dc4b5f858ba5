"""Issue 43 part 1: the per-step host work of a unit, cut to per-layout lists and one op per
bucket (unit.py's `UnitHot` / `BucketHot`, the fused gradient pack, the gradient face), with
the gradients' semantics unchanged: accumulation without zero_grad, in-place zeros, None
after zero_grad, requires_grad flips between steps, a shard rebuilt after the lists exist."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import hot_path_workers as W


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_match_the_unsharded_model(world: int) -> None:
    for diffs in run_distributed(W.semantics, world, timeout_s=180.0):
        bad = {k: v for k, v in diffs.items() if not v <= 1e-6}
        assert not bad, bad
        assert any(k.startswith("frozen 1.0.weight none") for k in diffs), diffs
        assert any(k.startswith("unfrozen 1.0.weight") and "none" not in k for k in diffs)


@pytest.mark.parametrize("world", [1, 2])
def test_a_rebuilt_shard_remakes_the_lists_and_is_gathered(world: int) -> None:
    for r in run_distributed(W.rebuilt_shard_is_gathered, world, timeout_s=180.0):
        assert r["output"] <= 1e-6, r
        assert r["remade"] == 2, r


def test_one_rank_gathers_reduces_and_frees_nothing() -> None:
    """A one-rank mesh: no copy, concatenation or allocation of parameters or gradients in a
    step (FSDP2 copies each shard in and each gradient out), the same numbers as unsharded."""
    (r,) = run_distributed(W.one_rank_moves_nothing, 1, timeout_s=180.0)
    assert r["moved"] == {}, r["moved"]
    assert r["shared"] and all(r["shared"]), r
    assert r["storage_kept"], r
    assert all(v <= 1e-6 for v in r["grads"].values()), r["grads"]
    assert r["out"] <= 1e-6, r
