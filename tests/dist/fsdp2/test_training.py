"""Port of upstream test_fully_shard_training.py (training parity, registration, AC, tied
and unused parameters, gradient accumulation).

Differences of semantics, by design: shardwise's root keeps its parameters from forward to
backward (docs/design.md), which is FSDP2's default (`reshard_after_forward=None` for the
root); expected all-gather counts follow that. Tied parameters sharded by separate calls are
re-homed to the common parent instead of raising (FSDP2: "already managed by another").

Left out, needs issue 14 (DTensor/FSDP2 API): test_train_parity_single_group_shard_largest_dim,
TestFullyShardShardPlacementFn* (shard_placement_fn); reshard_after_forward=2/None in every
grid (int/None values); test_train_parity_multi_group_unshard_async_op and the
unshard_async_op axis (_set_unshard_async_op); test_explicit_prefetching
(set_modules_to_forward/backward_prefetch); test_partial_group_reshard_toggle
(set_reshard_after_forward/backward); test_reset_iter_state_after_exception (reset_iter_state);
test_register_fsdp_forward_method (register_fsdp_forward_method); module_grouping mem_eff /
mem_eff_weight_tied, test_grouped_module_cast_forward_inputs (grouped form),
test_shared_params_separate_fsdp_groups_error's grouped counterpart and the grouped-vs-
ungrouped comparisons (fully_shard on a list of modules); set_is_last_backward and
set_reshard_after_backward axes of test_gradient_accumulation / test_1f1b_microbatching /
test_partial_group_forward_grad_accum_chunked; test_modules_to_run_forward_empty_for_single_module
(FSDP2 internal state); the chunked-head case with tied weights (needs the grouped form).
Left out, other reasons: delay_* axes and test_post_optim_event, TestFullyShardShareCommContext,
TestFullyShardCudaGraph (CUDA streams/sleep kernels); TestFullyShardNDTraining,
TestFullyShardHSDP3DTraining, TestFullyShardHSDPTraining and the HSDP mesh of
test_gradient_accumulation (2-D/TP meshes); pin_memory=True offload (needs an accelerator);
test_shared_params_separate_fsdp_groups_error (shardwise re-homes instead: covered by
train_shared_params_uneven_shard[units=separate]).
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
