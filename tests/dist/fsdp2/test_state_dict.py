"""Port of upstream test_fully_shard_state_dict.py, through shardwise's full state dict API.

load_after_forward_without_backward extends upstream's "state dict after a forward that kept
the parameters" check to loading (issue 12, defect 4).

dp_state_dict_dtensors is the DTensor half of test_dp_state_dict_save_load (model.state_dict()
values as DTensors sharing storage with the sharded parameters, also between a forward and
its backward, and load_state_dict of DTensors). Left out: test_cached_state_dict (DTensor
local storage across steps), the use_shard_placement_fn variants. Left out, other reasons:
the HSDP meshes of test_dp_state_dict_save_load, test_2d_state_dict_correctness,
test_dp_tp_state_dict_save_load, test_hsdp_tp_state_dict_save_load (2-D/TP meshes);
cpu_state_dict=False and pin_memory=True of test_dp_state_dict_cpu_offload (need an
accelerator).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import state_dict_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

CASES: list[Case] = [
    Case("dp_state_dict_save_load", W.dp_state_dict_save_load),
    Case("dp_state_dict_dtensors", W.dp_state_dict_dtensors),
    *grid("load_after_forward_without_backward", W.load_after_forward_without_backward,
          reshard_after_forward=[True, False]),
    Case("dp_state_dict_cpu_offload", W.dp_state_dict_cpu_offload),
    Case("rank0_offload_full_state_dict", W.rank0_offload_full_state_dict),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_state_dict(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
