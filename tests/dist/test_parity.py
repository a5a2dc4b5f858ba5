"""Sharded training equals unsharded training: every strategy x policy, world sizes 1-4.

Each worker returns the largest difference of every parameter and every gradient from the
unsharded reference, at every step ("rank 1 lm/FULL_SHARD/size step 2 grad blocks.0.up.weight");
the assertions are here.
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist.parity import changing_order, grid, holdings, prefetch_off_and_on

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
POLICIES = ["none", "transformer", "size", "callable"]
TOL = 1e-5


def off(diffs: dict[str, float]) -> dict[str, float]:
    """The differences past the tolerance (NaN included); a frozen parameter must not move
    at all."""
    return {k: v for k, v in diffs.items() if not v < TOL or ("frozen" in k and v != 0.0)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_grid(world: int) -> None:
    results = run_distributed(grid, world, ["mlp", "lm"], STRATEGIES, POLICIES)
    assert len(results[0]) == 3 * 4 + 3 * 3  # lm: 4 policies, mlp: 3 (no transformer)
    diffs = {f"rank {r} {case} {k}": v for r, res in enumerate(results)
             for case, d in res.items() for k, v in d.items()}
    assert not off(diffs)
    # Gradients and parameters were both compared, at every step and after the last one.
    assert any(" grad " in k for k in diffs) and any(" param " in k for k in diffs)
    assert any("after the last step param" in k for k in diffs)


@pytest.mark.parametrize("world", [2, 3])
def test_parity_with_prefetch_off_and_on(world: int) -> None:
    # TinyLM's dims (vocab 11, d 6, up 19 rows, a 0-d gate) divide by neither 2 nor 3.
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        results = run_distributed(prefetch_off_and_on, world, strategy)
        for r, res in enumerate(results):
            assert not off(res["diffs off"]), (strategy, r)
            assert not off(res["diffs on"]), (strategy, r)
            assert res["prefetches off"] == 0, (strategy, r)
            assert res["off vs on"] == 0.0, (strategy, r)  # prefetching moves only timing
        if strategy == "FULL_SHARD":
            assert results[0]["prefetches on"] > 0  # prefetching was on, and did something


@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_order_changes_between_steps(world: int) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for res in run_distributed(changing_order, world, strategy):
            assert not off(res["diffs"]), strategy
            # The recorded order followed the blocks' order of each step.
            assert len({tuple(r) for r in res["recorded"]}) > 1, res["recorded"]
            if strategy == "FULL_SHARD":
                assert res["prefetches"] > 0, "no all-gather was ever prefetched"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_holds_about_one_nth(world: int) -> None:
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
    assert not off({f"rank {r} {case} {k}": v for r, res in enumerate(results)
                    for case, d in res.items() for k, v in d.items()})
