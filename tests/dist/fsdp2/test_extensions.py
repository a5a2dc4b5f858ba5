"""Port of upstream test_fully_shard_extensions.py as refusals: shardwise does not run FSDP2's
all-gather extensions and shards plain tensors only (docs/porting.md), so each upstream
scenario that trains with one (test_all_gather_extensions_train_parity with TwoTensor,
test_all_gather_extensions_monkey_patch, BFloat16AllGatherTensor of
test_all_gather_extension_outer_size_stride, the HSDP mesh variant) checks a clear
NotImplementedError naming the parameter, raised before any collective, instead.

Left out: test_all_gather_extensions_end_to_end (meta init of TwoTensor parameters: refused
at fully_shard like the train-parity case), test_all_gather_extension_hsdp_mesh and
test_all_gather_extension_outer_size_stride (the same refusal on another mesh or subclass).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import extensions_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

CASES: list[Case] = [
    *grid("all_gather_extension_refused", W.subclass_param_refused,
          kind=["two_tensor", "hooks"]),
    Case("all_gather_extension_monkey_patch_refused", W.patched_after_to_empty_refused),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_extensions(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
