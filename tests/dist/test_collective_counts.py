"""The default path pays what FSDP2 pays (issue 35): one training step of a GPT with
per-layer units issues exactly the collectives PyTorch's FSDP2 issues for the same model,
and nothing per step that FSDP2 does not (no agreement all-reduce, no barrier).

The step counted is the third (after two warm-up steps), forward + backward + AdamW step,
at 2 and 3 ranks, on reduced shapes of the benchmark models ('small': 4 blocks, bench30m: 10;
collective_count_workers.PRESETS). Each count is taken twice, from the torch.distributed
functions and from the backend's ops in a profiler trace, and the two must agree.
"""

from __future__ import annotations

import functools

import pytest

from shardwise.testing import run_distributed
from tests.dist import collective_count_workers as W

PRESETS = tuple(W.PRESETS)
# shardwise's strategy -> the FSDP2 configuration that does the same (the blocks' units).
PAIRS = {"shardwise": "fsdp2",
         "shardwise SHARD_GRAD_OP": "fsdp2 reshard_after_forward=False"}
Counts = dict[str, dict[str, dict[str, int]]]


def _run(world: int, runs: list[tuple[str, str, bool]], env: dict[str, str]) -> Counts:
    per_rank = run_distributed(W.step_counts, world, runs, env=env, timeout_s=300)
    # Every rank issues every collective: the ranks' counts are one count.
    for r, got in enumerate(per_rank[1:], start=1):
        assert got == per_rank[0], f"rank {r} counted {got}, rank 0 {per_rank[0]}"
    counts: Counts = per_rank[0]
    for name, c in counts.items():
        assert c["python"] == c["c10d"], (
            f"{name} at {world} ranks: torch.distributed calls {c['python']} and backend ops "
            f"{c['c10d']} differ: a collective escaped one of the two counts")
    return counts


@functools.cache
def _counts(world: int) -> Counts:
    """FSDP2 and shardwise in one set of processes; shardwise with gloo's native all-gather /
    reduce-scatter (SHARDWISE_GLOO_NATIVE=1) and with its default all-to-all transport."""
    runs = [(s, p, True) for p in PRESETS for s in PAIRS.values()]
    runs += [(s, p, native) for p in PRESETS for s in PAIRS for native in (True, False)]
    return _run(world, runs, {})


def _get(counts: Counts, system: str, preset: str, native: bool = True) -> dict[str, int]:
    return counts[W.key(system, preset, native)]["python"]


def _differences(fsdp2: dict[str, int], ours: dict[str, int]) -> list[str]:
    return [f"{kind}: FSDP2 {fsdp2.get(kind, 0)}, shardwise {ours.get(kind, 0)}"
            for kind in sorted(set(fsdp2) | set(ours)) if fsdp2.get(kind, 0) != ours.get(kind, 0)]


def _report(counts: Counts) -> str:
    return "; ".join(f"{name}: {c['python']}" for name, c in counts.items())


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_counts_are_the_expected_ones(world: int) -> None:
    # The instrument works: FSDP2's counts are what its design says, per unit and pass.
    # n blocks + the root (kept from forward to backward): all-gathers 2n + 1 (forward n + 1,
    # backward n) with resharding, n + 1 without; one reduce-scatter per unit.
    counts = _counts(world)
    for preset in PRESETS:
        n = W.PRESETS[preset].n_layer
        got = _get(counts, "fsdp2", preset)
        assert got == {"all_gather": 2 * n + 1, "reduce_scatter": n + 1}, _report(counts)
        got = _get(counts, "fsdp2 reshard_after_forward=False", preset)
        assert got == {"all_gather": n + 1, "reduce_scatter": n + 1}, _report(counts)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("system", list(PAIRS))
def test_native_collectives_equal_fsdp2_per_kind(world: int, system: str) -> None:
    counts = _counts(world)
    for preset in PRESETS:
        ours = _get(counts, system, preset)
        theirs = _get(counts, PAIRS[system], preset)
        assert not _differences(theirs, ours), (
            f"{system} vs {PAIRS[system]}, {preset} at {world} ranks: "
            f"{_differences(theirs, ours)} (all counts: {_report(counts)})")
        assert "all_reduce" not in ours and "barrier" not in ours, _report(counts)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("system", list(PAIRS))
def test_all_to_all_transport_issues_as_many_collectives_as_fsdp2(world: int,
                                                                   system: str) -> None:
    # gloo's default transport moves each all-gather and each reduce-scatter as one
    # all_to_all ([Note: gloo transport]): one collective per FSDP2 collective, no other kind.
    counts = _counts(world)
    for preset in PRESETS:
        ours = _get(counts, system, preset, native=False)
        theirs = _get(counts, PAIRS[system], preset)
        assert ours == {"all_to_all": sum(theirs.values())}, (
            f"{system}, {preset} at {world} ranks: {ours}, FSDP2 {theirs} "
            f"(all counts: {_report(counts)})")


# [Note: coalesced units]: the default budget (4 MiB) against each unit alone. Both presets'
# units (blocks of ~110 KB and the root) make one group. Per step: one all-gather in forward,
# one in backward (the blocks': the root stays gathered from forward; none under
# SHARD_GRAD_OP), one reduce-scatter.
COALESCED = {
    ("shardwise coalesced", "small"): {"all_gather": 2, "reduce_scatter": 1},
    ("shardwise coalesced", "bench30m"): {"all_gather": 2, "reduce_scatter": 1},
    ("shardwise SHARD_GRAD_OP coalesced", "small"): {"all_gather": 1, "reduce_scatter": 1},
    ("shardwise SHARD_GRAD_OP coalesced", "bench30m"): {"all_gather": 1,
                                                         "reduce_scatter": 1},
}


@functools.cache
def _coalesced(world: int) -> Counts:
    runs = [(s, p, True) for s, p in COALESCED]
    runs += [(s, p, False) for s, p in COALESCED]
    return _run(world, runs, {})


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_small_units_issue_one_collective_per_group(world: int) -> None:
    counts = _coalesced(world)
    for (system, preset), want in COALESCED.items():
        assert _get(counts, system, preset) == want, (system, preset, _report(counts))
        # gloo's all-to-all transport: the same collectives, each one all_to_all.
        assert _get(counts, system, preset, native=False) == {
            "all_to_all": sum(want.values())}, (system, preset, _report(counts))


def test_debug_mode_adds_its_checks_and_the_comparison_sees_them() -> None:
    # The checks FSDP2 does not make live in SHARDWISE_DEBUG=1: there they are counted (the
    # freeze check's all-reduce, a fingerprint all-gather per collective, engine/comm/work.py),
    # so the comparison above is one that can fail.
    counts = _run(2, [("shardwise", "small", True)], {"SHARDWISE_DEBUG": "1"})
    ours = _get(counts, "shardwise", "small")
    theirs = _get(_counts(2), "fsdp2", "small")
    assert _differences(theirs, ours), (ours, theirs)
    assert ours.get("all_reduce") == 1, ours  # the freeze check, once per step
    assert ours["all_gather"] > theirs["all_gather"], ours


# --- issue 41 part 3 ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_accumulation_recipe_issues_fsdp2s_collectives_per_micro_batch(world: int,
                                                                        hsdp: bool) -> None:
    """FSDP2's accumulation recipe (set_requires_gradient_sync(last) and
    set_reshard_after_backward(last), 3 micro-batches): per micro-batch, exactly FSDP2's
    collectives. Before, every micro-batch after the first paid one all-reduce (the ranks
    agreeing that the kept parameters were not stale) and a torch.equal per parameter. FSDP
    (n blocks resharded after forward, every unit kept after backward but the last):
    2n + 1 all-gathers in the first micro-batch, n (backward's) in the others, one
    reduce-scatter per unit in the last; HSDP on a (world, 1) mesh: all-reduces only."""
    per_rank = run_distributed(W.accumulation_counts, world, ["fsdp2", "shardwise"], hsdp,
                               timeout_s=300)
    for got in per_rank:
        assert got["shardwise"] == got["fsdp2"], got
    n = W.PRESETS["small"].n_layer
    got = per_rank[0]["fsdp2"]
    if hsdp:
        assert got == [{}, {}, {"all_reduce": n + 1}], got
    else:
        assert got == [{"all_gather": 2 * n + 1}, {"all_gather": n},
                       {"all_gather": n, "reduce_scatter": n + 1}], got


@pytest.mark.parametrize("world", [2, 3])
def test_per_layer_moe_recipe_counts(world: int) -> None:
    """docs/moe.md's per-layer recipe with an expert that gets no token on each rank (FSDP2
    cannot run it: a size mismatch in its reduce-scatter). shardwise's step: the root and 2
    layer units, all resharded after forward (the root explicitly), 3 + 3 all-gathers and 3
    reduce-scatters, nothing else; the unused-
    gradient flags stay on the device (before: a flags tensor made from a host list per
    bucket), and the counts are read at the end of backward, once per unit where this rank
    missed a gradient (FSDP2 has no such read: it cannot run the case)."""
    for got in run_distributed(W.moe_layer_counts, world, timeout_s=300):
        assert got["counts"] == {"all_gather": 6, "reduce_scatter": 3}, got
        assert got["c10d"] == got["counts"], got
        # One read per layer unit that missed a gradient, at the end of backward.
        assert 1 <= got["host_reads"] <= 2 and got["host_lists_to_device"] == 0, got
