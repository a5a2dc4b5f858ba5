"""Port of upstream test_fully_shard_training.py (training parity, registration, AC, tied
and unused parameters, gradient accumulation).

Differences of semantics, by design: shardwise's root keeps its parameters from forward to
backward (docs/design.md), which is FSDP2's default (`reshard_after_forward=None` for the
root); expected all-gather counts follow that. Tied parameters sharded by separate calls are
re-homed to the common parent instead of raising (FSDP2: "already managed by another").

Ported in their own files since: the gradient accumulation axes (set_is_last_backward,
set_reshard_after_backward, int reshard_after_forward, HSDP meshes, async explicit unshards)
in test_grad_acc.py; explicit prefetching, the post-optimizer event, unshard_async_op,
test_partial_group_reshard_toggle, test_reset_iter_state_after_exception,
test_register_fsdp_forward_method, test_share_comm_context and shard_placement_fn (refused
for dims other than 0) in test_training_api.py; the grouped (list-form) scenarios, tied
chunked heads included, in test_grouped.py; TestFullyShardHSDPTraining in test_hsdp.py.
Left out: test_modules_to_run_forward_empty_for_single_module (FSDP2 internal state); the
delay_* axes and TestFullyShardCudaGraph (CUDA streams/sleep kernels);
TestFullyShardNDTraining and TestFullyShardHSDP3DTraining (3-D meshes with TP/PP dims);
pin_memory=True offload (needs an accelerator); test_shared_params_separate_fsdp_groups_error
(shardwise re-homes instead: covered by train_shared_params_uneven_shard[units=separate]).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import training_compose_workers as C
from tests.dist.fsdp2 import training_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    Case("root_move_forward_input_to_device", W.root_move_forward_input_to_device),
    Case("root_no_forward_inputs", W.root_no_forward_inputs),
    *grid("param_registration_after_forward", W.param_registration_after_forward,
          worlds=(2, 3, 4), reshard_after_forward=[True, False, None]),
    *grid("param_registration_after_backward", W.param_registration_after_backward,
          worlds=(2, 3, 4), reshard_after_forward=BOOLS),
    Case("to_float64_after_init", W.to_float64_after_init),
    Case("train_parity_single_group", W.train_parity_single_group, worlds=(2, 3, 4)),
    Case("train_parity_single_worldsize1", W.train_parity_single_worldsize1, worlds=(1,)),
    *grid("train_parity_multi_group", W.train_parity_multi_group,
          reshard_after_forward=BOOLS, offload=[False]),
    *grid("train_parity_multi_group_cpu_offload", W.train_parity_multi_group,
          reshard_after_forward=[True], offload=[True]),
    Case("non_root_forward_backward", W.non_root_forward_backward),
    *grid("multi_forward_module", W.multi_forward_module, reshard_after_forward=BOOLS),
    Case("layer_by_layer_shard_no_false_positive", W.layer_by_layer_shard),
    *grid("gradient_accumulation", W.gradient_accumulation, worlds=(2, 3, 4),
          reshard_after_forward=BOOLS, mode=["all", "root_only", "some_mlps"], offload=[False]),
    *grid("gradient_accumulation", W.gradient_accumulation, worlds=(2, 3, 4),
          reshard_after_forward=[True], mode=["all", "root_only", "some_mlps"], offload=[True]),
    *grid("1f1b_microbatching", W.microbatching_1f1b, worlds=(2, 3, 4),
          explicit_unshard=[False, True]),
    *grid("train_parity_with_activation_checkpointing", C.activation_checkpointing,
          reshard_after_forward=BOOLS, checkpoint_impl=["composable", "utils", "wrapper"]),
    *grid("partial_forward_then_standalone", C.partial_forward_then_standalone,
          reshard_after_forward=BOOLS, mp=["none"], ac=[False]),
    *grid("partial_forward_then_standalone", C.partial_forward_then_standalone,
          reshard_after_forward=[True], mp=["none"], ac=[True]),
    *grid("partial_forward_then_standalone", C.partial_forward_then_standalone,
          reshard_after_forward=[True], mp=["bf16_everywhere", "bf16_inner_only"], ac=[False]),
    Case("cast_forward_inputs_each_unit", C.cast_forward_inputs_each_unit),
    *grid("partial_forward_grad_accum_chunked", C.partial_forward_grad_accum_chunked,
          reshard_after_forward=BOOLS),
    *grid("double_forward_with_nested_fsdp_and_checkpoint", C.double_forward_nested_checkpoint,
          reshard_after_forward=BOOLS, checkpoint_impl=["composable", "utils"]),
    Case("double_partial_forward_then_backward", C.double_partial_forward_then_backward),
    *grid("train_parity_with_shared_params", C.shared_params, worlds=(2, 3, 4),
          reshard_after_forward=BOOLS, activation_checkpointing=[False, True]),
    *grid("train_shared_params_uneven_shard", C.shared_params_uneven_shard, worlds=(2, 3, 4),
          reshard_after_forward=BOOLS, units=["root", "separate"]),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_training(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
