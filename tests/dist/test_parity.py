"""Sharded training equals unsharded training: every strategy x policy, world sizes 1-4."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist.parity import grid

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
POLICIES = ["none", "transformer", "size", "callable"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_grid(world: int) -> None:
    results = run_distributed(grid, world, ["mlp", "lm"], STRATEGIES, POLICIES)
    worst = max(max(r.values()) for r in results)
    assert worst < 1e-5
    assert len(results[0]) == 3 * 4 + 3 * 3  # lm: 4 policies, mlp: 3 (no transformer)


@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_order_changes_between_steps(world: int) -> None:
    from tests.dist.parity import changing_order

    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert max(run_distributed(changing_order, world, strategy)) < 1e-5


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_holds_about_one_nth(world: int) -> None:
    from tests.dist.parity import holdings

    res = run_distributed(holdings, world)
    total = res[0]["total"]
    # Shards partition every parameter exactly: nothing lost, nothing held twice.
    assert sum(r["local"] for r in res) == total
    for r in res:
        # dim-0 padding can give a rank up to one extra row per parameter
        assert r["local"] <= total / world * 1.25, r
        # AdamW: exp_avg + exp_avg_sq per trainable shard; gradients only for those.
        assert r["state"] == 2 * r["trainable"] and r["grads"] == r["trainable"], r


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_native_collectives_agree(world: int) -> None:
    # The same grid over gloo's own all_gather/reduce_scatter instead of all-to-all.
    results = run_distributed(grid, world, ["lm"], ["FULL_SHARD", "SHARD_GRAD_OP"],
                              ["transformer"], env={"SHARDWISE_GLOO_NATIVE": "1"})
    assert max(max(r.values()) for r in results) < 1e-5
