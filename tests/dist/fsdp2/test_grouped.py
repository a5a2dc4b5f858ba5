"""Port of upstream test_fully_shard_training.py's list-form (grouped) scenarios, left out
of test_training.py at first: the mem_eff / mem_eff_weight_tied module groupings of
test_train_parity_with_activation_checkpointing (block grouping: test_training.py),
test_partial_group_forward_then_standalone with its grouped-vs-ungrouped comparison and
weight tying (tied: [embed, norm, head] as one unit), test_partial_group_forward_grad_accum_chunked
(tied too, against the reference), test_grouped_module_cast_forward_inputs, and
test_fully_shard_comm.py's test_fully_shard_multi_module_unused_module (numbers only: its
event order is FSDP2's internal schedule).

reshard_after_forward=1 of the partial-forward case is FSDP2's int form at 1 (False).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import grouped_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    *grid("train_parity_with_activation_checkpointing", W.ac_module_grouping,
          reshard_after_forward=BOOLS, checkpoint_impl=["composable", "utils", "wrapper"],
          grouping=["mem_eff", "mem_eff_weight_tied"]),
    *grid("partial_group_forward_then_standalone", W.partial_group_forward_then_standalone,
          raf=["true", "false"], weight_tying=BOOLS,
          mp=["none", "bf16_everywhere", "bf16_inner_only"], ac=[False]),
    Case("partial_group_forward_then_standalone", W.partial_group_forward_then_standalone,
         dict(raf="true", weight_tying=False, mp="none", ac=True)),
    Case("partial_group_forward_then_standalone", W.partial_group_forward_then_standalone,
         dict(raf="int1", weight_tying=False, mp="none", ac=False)),
    *grid("partial_group_forward_grad_accum_chunked", W.partial_group_grad_accum_chunked,
          reshard_after_forward=BOOLS, weight_tying=BOOLS),
    Case("grouped_module_cast_forward_inputs", W.grouped_cast_forward_inputs),
    *grid("multi_module_unused_module", W.multi_module_unused_module,
          reshard_after_forward=BOOLS),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_grouped(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
