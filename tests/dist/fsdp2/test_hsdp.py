"""Port of upstream TestFullyShardHSDPTraining.test_train_parity_hsdp: a 2-D
(replicate, shard) mesh passed to fully_shard. Upstream's mesh at 4 ranks is (2, 2), run here
with upstream's whole grid (CPU offload without pinned memory only, as upstream on CPU);
at 2 and 3 ranks the degenerate meshes (world, 1) (pure replication: no shard group to gather
over) and (1, world) (one replica) run a smaller grid.

accumulation_vs_fsdp2 runs one script (gradient accumulation with the knobs that touch the
reduction: no sync, parameters kept, bf16/fp32 mixed precision, all-reduce hooks, forced
sums, torch's clip_grad_norm_) through torch's FSDP2 and through shardwise on the same
mesh and compares every number.

Left out: TestFullyShardHSDP3DTraining and TestFullyShardNDTraining (3-D meshes with TP and
pipeline dims; FSDP x TP has its own tests in tests/dist/test_tp.py).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import hsdp_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]
KNOBS = ["nosync", "nosync+keep", "mp+nosync+keep", "hook+nosync", "forcesum+hook", "clip"]

CASES: list[Case] = [
    *grid("train_parity_hsdp", W.train_parity_hsdp, worlds=(4,), mesh=["hsdp"],
          reshard_after_forward=BOOLS, ac=BOOLS, mlp_dim=[3, 16, 17], sync_at_last=BOOLS,
          offload=[False]),
    *grid("train_parity_hsdp", W.train_parity_hsdp, worlds=(4,), mesh=["hsdp"],
          reshard_after_forward=BOOLS, ac=[False], mlp_dim=[3, 17], sync_at_last=BOOLS,
          offload=[True]),
    *grid("train_parity_hsdp", W.train_parity_hsdp, worlds=(2, 3),
          mesh=["hsdp_rep", "hsdp_shard"], reshard_after_forward=BOOLS, ac=BOOLS,
          mlp_dim=[3, 17], sync_at_last=BOOLS, offload=[False]),
    *grid("accumulation_vs_fsdp2", W.accumulation_vs_fsdp2, worlds=(4,), mesh=["hsdp"],
          knobs=KNOBS),
    *grid("accumulation_vs_fsdp2", W.accumulation_vs_fsdp2, worlds=(2,),
          mesh=["hsdp_rep", "hsdp_shard"], knobs=KNOBS),
    *grid("accumulation_vs_fsdp2", W.accumulation_vs_fsdp2, worlds=(3,), mesh=["world"],
          knobs=KNOBS),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_hsdp(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
