"""The ranks agree which units any of them hooked for backward (hooked_agreement_workers.py).

[Note: hooked agreement] in engine/schedule_lockstep.py: a unit whose outputs need a gradient
on some ranks only gathers in backward on every rank, in lockstep; a unit hooked on no rank
gathers on none. Before it, the first hung (its pre-backward point was recorded only where
hooked: tests/dist/test_review_leftovers.py); recording the point on every grad-enabled call
instead gathered the second in every backward.
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import hooked_agreement_workers as W

TOL = 1e-5


def _check(res: dict, world: int, strategy: str, what: str) -> None:
    assert res["grad"] <= TOL and res["params"] <= TOL, (what, res)
    assert not res["none"], (what, res["none"])  # None gradients exactly where the reference's
    before = False
    for step, counts in enumerate(res["gathers"]):
        for name in W.NOWHERE:
            assert counts[name] == 0, (what, step, counts)
        if strategy == "FULL_SHARD":
            # m is hooked on some rank at steps 0, 1 and 3 (first call) and 0, 2, 3 (second).
            used = W.uses(step, world).any(dim=0)
            hooked = bool(used[0] or (used[1] and what == "twice+ckpt"))
            if hooked:
                assert counts["m"] > 0, (what, step, counts)
            else:
                # Before the answer is in, the last block's point prefetches as the last
                # agreement said: m, hooked at the step before, is gathered once in vain
                # (not at one rank: nothing is agreed, nothing predicted).
                assert counts["m"] <= int(before and what == "prefetch"), (what, step, counts)
            assert counts["b"] > 0, (what, step, counts)
            before = hooked


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("world", [2, 3])
def test_hooked_on_some_ranks_gathers_everywhere_hooked_on_none_nowhere(
        world: int, strategy: str) -> None:
    """m is used by rank 0 alone, by all but rank 0, by none, by all (and, called twice, in
    another pattern); f0, f1 (frozen, inputs need no gradient) and idle (used by no rank)
    are hooked nowhere. Every gradient (None alike) and parameter matches the unsharded
    reference to 1e-5 at every step; the units hooked nowhere are never gathered in
    backward; every rank gathers the same units the same number of times. With prefetch,
    and without it with m called twice and b activation-checkpointed. SHARDWISE_DEBUG
    turns ranks whose collectives differ into an error naming the collective at once."""
    results = run_distributed(W.strategies, world, strategy, timeout_s=240,
                              collective_timeout_s=20, env={"SHARDWISE_DEBUG": "1"})
    for what in ("prefetch", "twice+ckpt"):
        for res in results:
            _check(res[what], world, strategy, what)
        # Lockstep: the same backward gathers on every rank, whatever its data.
        assert all(r[what]["gathers"] == results[0][what]["gathers"] for r in results), what


@pytest.mark.parametrize("world,strategy", [(1, "FULL_SHARD"), (3, "NO_SHARD")])
def test_one_rank_and_no_shard(world: int, strategy: str) -> None:
    """Nothing to agree with one rank (this rank's own flags decide), nor a collective
    gather under NO_SHARD (the reductions still come in lockstep): parity as above."""
    for res in run_distributed(W.train, world, strategy, timeout_s=180,
                               collective_timeout_s=20):
        _check(res, world, strategy, "prefetch")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_no_sync_micro_batches_and_a_forward_without_backward(strategy: str) -> None:
    """A grad-enabled forward with no backward before each step (its agreement is dropped
    at the next forward), then no_sync micro-batches using m on different ranks."""
    for res in run_distributed(W.micro_batches, 3, strategy, timeout_s=180,
                               collective_timeout_s=20):
        assert res["grad"] <= TOL and res["params"] <= TOL and res["none"] == 0, res


def test_freeze_on_one_rank_still_raises_on_every_rank() -> None:
    """The freeze check rides with the agreement and is waited for later in backward (the
    first step past the root's pre-backward); a freeze on rank 1 alone still raises on
    every rank with the check's account, and the job goes on in step."""
    for rank, res in enumerate(run_distributed(W.freeze_on_one_rank, 3, timeout_s=180,
                                               collective_timeout_s=20)):
        m = res["messages"]
        assert m[0] is None and m[2] is None and m[3] is None, m
        assert m[1] is not None and m[1].startswith(
            f"rank {rank}: ranks disagree on which parameters require grad"), m
        assert "unit 'b'" in m[1] and "b.0.weight requires grad on ranks [0, 2], not on " \
            "rank 1" in m[1], m[1]
        assert res["same"] and res["finite"], res
