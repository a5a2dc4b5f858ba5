"""Port of upstream TestFullyShardGradientAccumulation (test_fully_shard_training.py) and the
older test_fully_shard_grad_acc.py: the axes the first port (test_training.py) left out.

Grid as upstream's, with upstream's skips: reshard_after_backward=False only with
reshard_after_forward=False and mode "all"/"root_only"; CPU offload only with
reshard_after_forward=True. reshard_after_forward's int form is taken at the shard-group
size ("int", FSDP2's True), at 1 ("int1", FSDP2's False) and, at 4 ranks on the 1-D mesh,
at upstream's proper divisor 2 ("k2", hpZ: every backward all-gather within a 2-rank
block, tests/dist/fsdp2/hpz.py). HSDP meshes: (world, 1) and (1, world) at 2 and 3 ranks,
(2, 2) at 4 ranks as upstream. Upstream's reduce_scatter_only axis
(set_requires_all_reduce(False) under HSDP) defers the all-reduce to the last micro-batch
(issue 36). test_fully_shard_mixed_precision.py's test_grad_acc_with_reduce_dtype with its
set_reshard_after_backward(last or reshard_after_forward) is here too, and so are the numbers
of test_fully_shard_pending_grad.py's test_native_accumulation_dtypes (its
get_pending_gradients API is newer than torch 2.13), and pipeline schedules with several
forwards outstanding (gpipe, interleaved 1F1B), beyond upstream. Left out:
pin_memory=True offload (needs an accelerator).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import grad_acc_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]


def _accumulation_cases() -> list[Case]:
    cases: list[Case] = []
    for mesh, worlds in (("world", (2, 3)), ("hsdp_rep", (2, 3)), ("hsdp_shard", (2,)),
                         ("hsdp", (4,))):
        for raf in ("true", "false", "int", "int1"):
            for mode in ("all", "root_only", "some_mlps"):
                for rab in BOOLS:
                    for offload in BOOLS:
                        if not rab and (raf not in ("false", "int1") or mode == "some_mlps"):
                            continue
                        if offload and raf != "true":
                            continue
                        if mesh != "world" and (raf in ("int", "int1") or offload):
                            continue  # the int forms and offload: once, on the 1-D mesh
                        cases.append(Case("gradient_accumulation", W.gradient_accumulation,
                                          dict(mesh=mesh, raf=raf, mode=mode,
                                               reshard_after_backward=rab, offload=offload),
                                          worlds))
    for mode in ("all", "root_only", "some_mlps"):
        cases.append(Case("gradient_accumulation", W.gradient_accumulation,
                          dict(mesh="world", raf="k2", mode=mode, reshard_after_backward=True,
                               offload=False), (4,)))
    return cases


CASES: list[Case] = [
    *_accumulation_cases(),
    Case("requires_all_reduce_hsdp", W.requires_all_reduce_hsdp, worlds=(4,)),
    *grid("requires_gradient_sync", W.requires_gradient_sync_recurse,
          raf=["true", "false", "int"], offload=[False], recurse=BOOLS),
    *grid("requires_gradient_sync", W.requires_gradient_sync_recurse, worlds=(3,),
          raf=["true"], offload=[True], recurse=BOOLS),
    *grid("grad_acc_with_reduce_dtype", W.grad_acc_with_reduce_dtype,
          reshard_after_forward=BOOLS),
    *grid("native_accumulation_dtypes", W.accumulation_dtypes, offload=BOOLS),
    *grid("interleaved_microbatches", W.interleaved_microbatches,
          reshard_after_forward=BOOLS, schedule=["gpipe", "1f1b"]),
    *grid("1f1b_microbatching", W.microbatching_1f1b,
          unshard=["none", "sync", "async"], reshard_after_backward=BOOLS),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_grad_acc(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
