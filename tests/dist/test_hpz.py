"""hpZ: `fully_shard(m, reshard_after_forward=k)` with k a proper divisor of the shard group
([Note: hpZ] in engine/core/unit.py), against PyTorch's FSDP2 running the same code and an
unsharded reference, in one set of processes (tests/dist/hpz_workers.py).

Collectives are recorded at the dispatcher with gloo's native all-gather
(SHARDWISE_GLOO_NATIVE=1, FSDP2's own op), so each all-gather's group size (output over
input) and bytes sent per rank are seen for both systems alike.
"""

from __future__ import annotations

from typing import Any

from shardwise.testing import run_distributed
from tests.dist import hpz_workers as W

NATIVE = {"SHARDWISE_GLOO_NATIVE": "1"}
# 4 ranks, blocks at k=2: fp32; bf16 params (fp32 reduce) with CPU offload; the root at
# k=2 too; shardwise's prefetch off and set_reshard_after_forward(True) after step 0.
CASES_4: list[tuple[int, dict[str, Any]]] = [
    (2, {}), (2, {"mp": True, "offload": True}), (2, {"root_k": 2}),
    (2, {"set_true_after": 0, "prefetch": False}),
]


def _key(k: int, case: dict[str, Any]) -> str:
    return f"{k} {sorted(case.items())}"


def test_hpz_4_ranks_parity_and_gathers_within_the_block() -> None:
    results = run_distributed(W.hpz_cases, 4, CASES_4, True, env=NATIVE, timeout_s=300)
    for rank_result in results:
        for k, case in CASES_4:
            r = rank_result[_key(k, case)]
            # Parity was asserted in the worker (losses and every parameter, every step:
            # 1e-5 against FSDP2, 1e-5 against unsharded in fp32); FSDP2 is matched exactly.
            assert r["worst"]["fsdp2"] == 0.0, (case, r["worst"])
            for step, counts in enumerate(r["counts"]):
                ours, theirs = counts["shardwise"], counts["fsdp2"]
                # The same all-gathers and reduce-scatters as FSDP2, group sizes and bytes
                # included (the first forward also runs shardwise's one layout check).
                for phase in ("forward", "backward"):
                    keep = [key for key in theirs[phase] if not key.startswith("reduce")]
                    assert {key: ours[phase].get(key) for key in keep} == {
                        key: theirs[phase][key] for key in keep}, (case, step, phase)
                    assert ([key for key in ours[phase] if key.startswith("all_gather")]
                            == [key for key in theirs[phase] if key.startswith("all_gather")])
                fwd, bwd = ours["forward"], ours["backward"]
                assert fwd["all_gather/4"] == 4  # 3 blocks + the root, over all 4 ranks
                assert bwd["reduce_scatter/4"] == 4  # the reduce-scatter stays full-group
                if case.get("set_true_after", 99) < step:
                    assert "all_gather/2" not in bwd, (case, step, bwd)  # back to all ranks
                    assert bwd["all_gather/4"] == 4
                    continue
                # Backward gathers only within the 2-rank block: 3 blocks (4 with the root
                # at k=2; otherwise the root kept its parameters from forward).
                assert "all_gather/4" not in bwd, (case, step, bwd)
                assert bwd["all_gather/2"] == (4 if case.get("root_k") else 3)
    refusals = results[0]["refusals"]
    for k in (3, 0, 8):
        assert f"reshard_after_forward={k}" in refusals[f"k={k}"]
        assert "divisor of the shard group size 4" in refusals[f"k={k}"]
    assert "bool" in refusals["set 2"] and "(2)" in refusals["set 2"]


def test_hpz_int_forms_at_2_ranks_match_fsdp2() -> None:
    # At 2 ranks the only divisors are 1 (False) and 2 (True): FSDP2's int forms, with the
    # same collectives as FSDP2 and parity.
    cases: list[tuple[int, dict[str, Any]]] = [(1, {}), (2, {"root_k": 2})]
    results = run_distributed(W.hpz_cases, 2, cases, False, env=NATIVE, timeout_s=300)
    for k, case in cases:
        r = results[0][_key(k, case)]
        assert r["worst"]["fsdp2"] == 0.0
        last = r["counts"][-1]
        assert ({key: n for key, n in last["shardwise"]["backward"].items()
                 if key.startswith("all_gather")}
                == {key: n for key, n in last["fsdp2"]["backward"].items()
                    if key.startswith("all_gather")})
        assert last["shardwise"]["backward"].get("all_gather/2", 0) == (0 if k == 1 else 4)
