"""Issue 36: pipeline parallelism x FSDP (torch.distributed.pipelining) at 4 gloo ranks.

A (pp 2, dp 2) mesh: each pipeline stage is sharded over its dp group with shardwise and,
in the same processes, with torch's FSDP2; both run the same schedule on the same weights
and data and are held against an unsharded single-process run of the whole model (losses
every step, parameters after 3 AdamW steps, to 1e-5). The pipelining stage drives FSDP
through the module methods and, after the last microbatch, by walking
`fully_shard.state(stage)._state_ctx.all_states` ([Note: pipelining] in the engine's
api/state.py; docs/parallelism.md).
"""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist import pipelining_workers as W

# gloo: shardwise moves a gather or a reduce-scatter as one all_to_all ([Note: gloo
# transport]), FSDP2 as an all_gather or a reduce_scatter; both count as one "move".
MOVES = ("all_gather", "reduce_scatter", "all_to_all")


def test_schedules_match_fsdp2_and_reference() -> None:
    """GPipe (2 microbatches), 1F1B (4) and interleaved 1F1B (two stages per rank, 4
    microbatches: UNSHARD / RESHARD actions around each stage's compute). One process group
    for the grid; a short collective timeout turns a pipeline hang into an error.

    Per step, shardwise moves parameters and gradients as often as FSDP2 and sends the same
    activations. Its only other collectives are small all-reduces, at most one per microbatch
    forward of a stage: the check that parameters kept gathered since an earlier microbatch
    (or by the schedule's UNSHARD) are not stale (docs/parallelism.md)."""
    cases = [("gpipe", 2), ("1f1b", 4), ("interleaved", 4)]
    results = run_distributed(W.parity, 4, cases, timeout_s=420, collective_timeout_s=30)
    for per_rank in results:
        assert len(per_rank) == len(cases), per_rank
        for case, got in per_rank.items():
            assert max(got["worst"].values()) <= W.TOL, (case, got)
            sw, fs = got["shardwise"], got["fsdp2"]
            assert sum(sw.get(k, 0) for k in MOVES) == sum(fs.get(k, 0) for k in MOVES), got
            assert sw.get("p2p") == fs.get("p2p"), got
            extra = set(sw) - set(MOVES) - {"p2p"}
            assert extra <= {"all_reduce"}, got
            n_microbatches = int(case.split(" x ")[1].split()[0])
            stages = 2 if case.startswith("interleaved") else 1
            assert sw.get("all_reduce", 0) <= stages * n_microbatches, got
