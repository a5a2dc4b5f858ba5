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
          ("qwen2_moe", "experts"), ("mixtral", "per-expert"), ("qwen2_moe", "per-expert"))
HF = {2: HF_ALL, 3: (("mixtral", "layers"), ("qwen2_moe", "layers"), ("mixtral", "per-expert"),
                     ("qwen2_moe", "per-expert"))}
PER_EXPERT = ("experts", "experts+layers", "experts-grad-op")


@pytest.mark.parametrize("world", [2, 3])
def test_skewed_routing_per_layer_units_and_3d_experts(world: int) -> None:
    debug, cases = SKEWED[world]
    run_distributed(M.hand_moe, world, debug, cases, timeout_s=300)


# A mismatch between the ranks' collectives fails within seconds, not at 60 s.
FAST = dict(timeout_s=300, collective_timeout_s=20)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape", ["list", "nested", "twice"])
def test_per_expert_units_skipped_by_routing_match_unsharded(world: int, shape: str) -> None:
    # Per-expert units (their container under a non-unit layer, under a unit layer, kept
    # gathered; a dict of lists; the MoE layer called twice per forward), with routing that
    # leaves some expert without tokens on some rank at every step: the first expert and the
    # last on rank 0, expert r on rank r. They used to be refused on one rank while the others
    # waited in that expert's all-gather ([Note: data-dependent units]). Now every rank gathers
    # and reduces every expert once per call of its holder, in container order: parity in
    # parameters and gradients, and the same decisions on every rank.
    results = run_distributed(M.hand_moe, world, False, PER_EXPERT, False, shape == "nested",
                              shape == "twice", **FAST)
    for units in PER_EXPERT:
        logs = [r[f"{units}/log"] for r in results]
        assert len(logs[0]) == 2 and all(logs[0]), logs[0]
        for r, log in enumerate(logs[1:], start=1):
            assert log == logs[0], (units, r, log, logs[0])
        # Each expert reduces once per holder call (twice per forward in "twice").
        reduces = sum(1 for what, u in logs[0][1] if what == "reduce" and "experts" in u)
        assert reduces == 2 * M.E * (2 if shape == "twice" else 1), (units, logs[0][1])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape", ["frozen", "rounds"])
def test_per_expert_units_reduced_late_or_in_rounds(world: int, shape: str) -> None:
    # "frozen": layer 0's MoE gets a frozen embedding's output, so no expert's post-backward
    # runs in backward: every rank reduces its experts in the final callback, in reverse
    # forward order, the skipped ones too. "rounds": the layer stack runs twice per forward
    # (a holder calling its container's members again): two rounds on every rank.
    frozen, rounds = shape == "frozen", 2 if shape == "rounds" else 1
    results = run_distributed(M.hand_moe, world, False, ("experts", "experts+layers"), False,
                              False, False, frozen, rounds, **FAST)
    for units in ("experts", "experts+layers"):
        logs = [r[f"{units}/log"] for r in results]
        for r, log in enumerate(logs[1:], start=1):
            assert log == logs[0], (units, r, log, logs[0])
        reduces = sum(1 for what, u in logs[0][1] if what == "reduce" and "experts" in u)
        assert reduces == 2 * M.E * rounds, (units, logs[0][1])


@pytest.mark.parametrize("world", [2, 3])
def test_per_expert_units_every_rank_runs_match_unsharded(world: int) -> None:
    # Every rank routes tokens to every expert: no stand-in, the same parity.
    run_distributed(M.hand_moe, world, False, ("experts+layers",), True, **FAST)


def test_unit_in_two_containers_is_refused_on_every_rank() -> None:
    # A position the groups cannot follow is refused by the structure, on every rank alike,
    # at the first forward, before any rank gathers for it.
    results = run_distributed(M.refused_positions, 2, timeout_s=120, collective_timeout_s=10)
    for r in results:
        assert r["type"] == "RuntimeError", results
        assert "member of two containers" in r["message"] and "a.1" in r["message"], r


@pytest.mark.parametrize("world", [2, 3])
def test_hf_mixtral_and_qwen2_moe(world: int) -> None:
    # "per-expert": one unit per expert (transformers 4's layout), each layer, the root.
    results = run_distributed(M.hf_moe, world, HF[world], **FAST)
    for key in (f"{kind}/{units}" for kind, units in HF[world]):
        used = [r[f"{key}/used"] for r in results]
        assert all(len(u) == 4 for u in used), used  # 2 steps x 2 layers
        # Some rank sent no token to some expert that another rank used, at most steps.
        differ = sum(len({tuple(u[i]) for u in used}) > 1 and any(
            len(u[i]) < 5 for u in used) for i in range(4))
        assert differ >= 3, (key, used)
