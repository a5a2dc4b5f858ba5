"""`set_requires_all_reduce(False)` under HYBRID_SHARD on a (2 replicas x 2 shards) mesh
([Note: deferred all-reduce] in engine/core/unit.py), against an accumulation that
all-reduces every micro-batch, FSDP2 deferring the same way, and the unsharded reference
(tests/dist/hsdp_defer_workers.py)."""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist import hsdp_defer_workers as W

CASES = [{}, {"mp": "fp32-reduce"}, {"mp": "bf16-reduce"}]


def test_deferred_all_reduce_parity_and_counts() -> None:
    results = run_distributed(W.defer_cases, 4, CASES, env={"SHARDWISE_GLOO_NATIVE": "1"},
                              timeout_s=300)
    for rank_result in results:
        for case in CASES:
            r = rank_result[str(sorted(case.items()))]
            # Gradients and parameters were compared in the worker every step; FSDP2's are
            # matched exactly, the accumulation dtype included.
            assert r["worst"]["fsdp2"] == 0.0, (case, r["worst"])
            if case.get("mp") == "bf16-reduce":
                # The deferred sums accumulate in bf16 (FSDP2's reduce dtype), so they are
                # not the every-micro-batch run's fp32 accumulation: the difference is real.
                assert r["worst"]["every"] > 0.0, r["worst"]
            for counts in r["all_reduces"]:
                # Three units: each all-reduces once, on the last micro-batch only.
                assert counts["defer"] == [0, 0, 3], counts
                assert counts["fsdp2"] == [0, 0, 3], counts
                assert counts["every"] == [3, 3, 3], counts
    refusal = results[0]["refusal"]
    assert "NO_SHARD" in refusal and "set_requires_gradient_sync" in refusal, refusal
