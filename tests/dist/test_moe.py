"""Mixture of experts with routing that differs by rank ([Note: data-dependent units] in
engine/core/context.py, docs/moe.md)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import moe_workers as M

# Skewed routing (some expert gets no token on some rank): per-layer units and 3-D experts
# keep every rank's collectives alike, and match unsharded training.
SKEWED = {2: (False, ("layers", "stacked")),
          3: (True, ("layers", "stacked", "stacked-grad-op"))}
HF_ALL = (("mixtral", "layers"), ("mixtral", "experts"), ("qwen2_moe", "layers"),
          ("qwen2_moe", "experts"))
HF = {2: HF_ALL, 3: (("mixtral", "layers"), ("qwen2_moe", "layers"))}
PER_EXPERT = ("experts", "experts+layers", "experts-grad-op")


@pytest.mark.parametrize("world", [2, 3])
def test_skewed_routing_per_layer_units_and_3d_experts(world: int) -> None:
    debug, cases = SKEWED[world]
    run_distributed(M.hand_moe, world, debug, cases, timeout_s=300)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape", ["list", "nested", "twice"])
def test_per_expert_units_every_rank_runs_match_unsharded(world: int, shape: str) -> None:
    # Per-expert units in every position (their container under a non-unit, under a unit,
    # kept gathered; a dict of lists; the MoE layer called twice per forward) where every
    # rank routes tokens to every expert: the same collectives everywhere, parity.
    run_distributed(M.hand_moe, world, False, PER_EXPERT, True, shape == "nested",
                    shape == "twice", timeout_s=300)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("units,nested", [("experts", False), ("experts+layers", False),
                                          ("experts", True)])
def test_per_expert_units_skipped_by_routing_are_named(world: int, units: str,
                                                       nested: bool) -> None:
    # A rank that sends no token to an expert unit would issue other collectives than its
    # peers (they used to abort in gloo or pair the wrong experts). That rank now raises
    # before its next collective, naming the unit and the fix; its peers, left waiting in a
    # collective it will not join, get a CollectiveError at the collective timeout.
    results = run_distributed(M.skewed_experts_refused, world, units, nested, timeout_s=120,
                              collective_timeout_s=5)
    named = [r for r in results if r["type"] == "RuntimeError"]
    assert named, results
    for r in named:
        assert "did not run in this call of" in r["message"], r
        assert "experts" in r["message"] and "docs/moe.md" in r["message"], r
    # Every rank stopped with an error: none went on with wrong numbers.
    assert all(r["type"] in ("RuntimeError", "CollectiveError") for r in results), results


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
