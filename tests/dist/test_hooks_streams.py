"""Issue 41 part 3: hooks as FSDP2 has them (tests/dist/hooks_streams_workers.py)."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import run_distributed
from tests.dist import hooks_streams_workers as W

TOL = 1e-5


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_in_backward_equals_fsdp2_and_unsharded(world: int) -> None:
    """PyTorch's optimizer-in-backward recipe: a per-parameter AdamW stepped from the
    parameter's post-accumulate-grad hook. FSDP2 runs the hooks on each sharded parameter
    after writing its reduced gradient; shardwise ran none (the model never trained) and,
    under NO_SHARD, ran them on the local gradient before the all-reduce."""
    impls = ["unsharded", "fsdp2", "shardwise", "shardwise NO_SHARD"]
    for got in run_distributed(W.run_all, world, "optimizer_in_backward", impls,
                               timeout_s=180):
        ref = got["unsharded"]
        for impl in impls[1:]:
            r = got[impl]
            assert r["calls"] == W.STEPS * r["n_params"], (impl, r["calls"], r["n_params"])
            assert r["grads_left"] == 0, impl
            assert r["params"].keys() == ref["params"].keys()
            assert _close(r["params"], ref["params"]) < TOL, impl
        assert _close(got["shardwise"]["params"], got["fsdp2"]["params"]) < TOL


@pytest.mark.parametrize("world", [2, 3])
def test_extension_hooks_patched_after_the_first_step_are_used(world: int) -> None:
    """Hooks patched onto the shards after the first step gather from the next step on:
    shardwise asks each shard at every gather (FSDP2's `all_gather_inputs` asks there too,
    but torch 2.13's FSDP2 sets up the hooks' state at lazy init only and raises
    AttributeError '_extensions_data' when they appear later, so it is not run here).
    Before, shardwise asked at the first forward only and never called them."""
    for got in run_distributed(W.run_all, world, "extension_patched", ["shardwise"],
                               timeout_s=180):
        ours = got["shardwise"]
        # Steps 2 and 3: the four block weights, gathered in forward and again in backward.
        assert ours["pre"] == ours["post"] == 2 * 4 * 2, ours
        assert _close(ours["params"], got["unsharded"]["params"]) < TOL



@pytest.mark.parametrize("world", [2, 3])
def test_unused_gradient_counts_of_a_failed_backward_are_dropped(world: int) -> None:
    """A backward that raised left its unused-gradient records (count tensors kept for the
    end of backward), and `reset_iter_state` kept them: the next step added them to its
    own counts, so a parameter no rank used kept a zero gradient instead of None."""
    for got in run_distributed(W.stale_unused_counts, world, "reset_iter_state"):
        assert got["raised"], got
        assert got["extra grad"] is None, got
        assert got["diff"] < TOL, got


@pytest.mark.xfail(strict=True, reason="open: after a backward that raised past every unit's "
                   "post-backward, the next step's gradients differ from unsharded (0.9) unless "
                   "reset_iter_state is called; not yet understood")
def test_a_failed_backward_leaves_no_gradient_in_the_next_step() -> None:
    """Without reset_iter_state, the next forward finished the failed backward's pending
    reductions: their gradients landed in `.grad` after the user's zero_grad. Now the next
    forward drops them, as reset_iter_state does."""
    for got in run_distributed(W.stale_unused_counts, 2, "none"):
        assert got["extra grad"] is None, got
        assert got["diff"] < TOL, got
