"""Data-dependent control flow against unsharded training ([Note: lockstep], [Note:
recompute]): the randomized cases of tests/dist/review_lockstep_workers.py.

Hand-made cases, each a defect found by the generator (minimised; see the worker's `case`):
`fixed` is [call][rank] -> the experts that rank routes its tokens to.

- ckpt-same-shape-experts: activation checkpointing around an MoE layer of per-expert units.
  The recomputation gathered only the experts a rank called; with experts of one shape, rank
  0's gather of expert 0 met rank 1's of expert 2 and each computed with the other's rows:
  silently wrong gradients (inp.weight.grad off by 5e-2), no error.
- ckpt-later-layer-skipped, ckpt-layer-twice: the same where a rank has not yet run the
  backward points it skipped after the region (a later layer's expert, the layer's second
  call): the recomputation's gathers came before them on one rank, after on the other.
- block-called-twice: an MoE block (not a unit) called twice in one forward, routed anew: a
  rank whose second call began at a later expert than its first ended merged both into one
  round and visited each expert once, the other rank twice (mismatch, then a hang).
- one-unit-in-container: experts where only one is a unit formed no group: a rank sending it
  no token never gathered it (hang).
- rank-drops-all-tokens: a rank that routes no token to any expert never entered the group
  and visited none (hang).
- nested-containers: experts in lists inside a dict formed a group per list, so a rank whose
  tokens all went to one list never visited the other (hang).
- aux-in-first-micro-batch-only: no_sync, then a synced micro-batch that does not call the
  auxiliary unit, which rank 0 alone used in the first: the end of backward reduced it where
  this rank held gradients (rank 0) and not elsewhere (a hang).
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_lockstep_workers as W

HAND = {
    "ckpt-same-shape-experts": W.case(2, [dict(ckpt=True, fixed=[[[0], [2]]])]),
    "ckpt-later-layer-skipped": W.case(2, [
        dict(ckpt=True, fixed=[[[0, 1], [1]]]),
        dict(ckpt=True, hidden=[5, 3, 2], fixed=[[[0], [2]]])]),
    "ckpt-layer-twice": W.case(2, [dict(ckpt=True, twice=True, experts=4, hidden=[1, 7, 1, 2],
                                        fixed=[[[1], [0, 3]], [[2], [0]]])]),
    "block-called-twice": W.case(2, [dict(twice=True, hidden=[1, 7, 2],
                                          fixed=[[[1], [0]], [[2], [0]]])]),
    "one-unit-in-container": W.case(2, [dict(experts=2, expert_units=[False, True],
                                             fixed=[[[0], [1]]])]),
    "rank-drops-all-tokens": W.case(2, [dict(fixed=[[[], [0, 2]]])]),
    "nested-containers": W.case(2, [dict(experts=4, container="nested", hidden=[3, 1, 2, 5],
                                         fixed=[[[2, 3], [0]]])]),
    "aux-in-first-micro-batch-only": W.case(
        2, [dict(moe=False)], aux=True, micro=2, no_sync=True,
        aux_plan=[(True, [True, False]), (False, [False, False])]),
}

# Random cases (make_spec), drawn from the hunt: representative of the option space, and
# every seed that failed before the fixes above.
SEEDS = {2: (0, 1, 11, 13, 18, 26, 29, 43, 45, 72), 3: (0, 1, 2, 3), 4: (0, 1)}


def test_hand_made_cases() -> None:
    results = run_distributed(W.run_specs, 2, HAND, timeout_s=240, collective_timeout_s=20)
    bad = {name: r for name, r in results[0].items() if r}
    assert not bad, bad


@pytest.mark.parametrize("world", sorted(SEEDS))
def test_random_cases(world: int) -> None:
    specs = {f"seed {s}": W.make_spec(s, world) for s in SEEDS[world]}
    results = run_distributed(W.run_specs, world, specs, timeout_s=300, collective_timeout_s=20)
    bad = {name: r for name, r in results[0].items() if r}
    assert not bad, {name: (r, specs[name]) for name, r in bad.items()}
