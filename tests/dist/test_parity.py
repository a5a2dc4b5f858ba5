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
