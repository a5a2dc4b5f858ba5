"""Mixture of experts with routing that differs by rank ([Note: lockstep] in schedule.py)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import moe_workers as M

HAND = {2: (False, ("layers", "experts", "stacked")),
        3: (True, ("layers", "experts+layers", "experts-grad-op", "stacked-grad-op"))}
HF_ALL = (("mixtral", "layers"), ("mixtral", "experts"), ("qwen2_moe", "layers"),
          ("qwen2_moe", "experts"))
HF = {2: HF_ALL, 3: (("mixtral", "layers"), ("qwen2_moe", "layers"))}


@pytest.mark.parametrize("world", [2, 3])
def test_hand_written_moe_per_layer_per_expert_and_3d(world: int) -> None:
    # Per-expert units: a rank that routes no token to an expert still gathers and reduces
    # it in lockstep; without (2 ranks) and with (3 ranks) SHARDWISE_DEBUG's fingerprints.
    debug, cases = HAND[world]
    run_distributed(M.hand_moe, world, debug, cases, timeout_s=300)


@pytest.mark.parametrize("world", [2, 3])
def test_hf_mixtral_and_qwen2_moe(world: int) -> None:
    results = run_distributed(M.hf_moe, world, HF[world], timeout_s=300)
    for key in (f"{kind}/{units}" for kind, units in HF[world]):
        used = [r[f"{key}/used"] for r in results]
        assert all(len(u) == 4 for u in used), used  # 2 steps x 2 layers
        # Some rank sent no token to some expert that another rank used, at most steps.
        differ = sum(len({tuple(u[i]) for u in used}) > 1 and any(
            len(u[i]) < 5 for u in used) for i in range(4))
        assert differ >= 3, (key, used)


@pytest.mark.parametrize("world", [2, 3])
def test_unit_without_gradient_on_some_ranks_reduces_in_lockstep(world: int) -> None:
    run_distributed(M.no_grad_on_some_ranks, world)
