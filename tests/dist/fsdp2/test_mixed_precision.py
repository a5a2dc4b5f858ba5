"""Port of upstream test_fully_shard_mixed_precision.py. Upstream runs these on accelerators
only; on CPU/gloo the same numerics apply (bf16/fp16 compute on CPU, gloo moves the bytes).

reshard_after_forward=2 (hpZ) runs at 4 ranks (at 2 it is True), in one set of processes:
compute_dtype (bf16 and fp16) and both reduce_dtype forms (bf16 compute with fp32 reduce,
fp32 compute with bf16 reduce), with upstream's parity and reduce-scatter dtype checks plus
every backward all-gather within a 2-rank block (tests/dist/fsdp2/hpz.py); the kept block
rows are in the compute dtype, so these check the values they gather back.
Left out: the use_shard_placement_fn axes (with an int reshard_after_forward upstream runs
them at 2 ranks only, where k=2 is True; shard_placement_fn itself is tested against FSDP2
in tests/dist/test_shard_dims.py); (set_reshard_after_backward of
test_grad_acc_with_reduce_dtype: ported in test_grad_acc.py);
test_no_warmup_jvp_reshard_after_forward_false (meta-device
init through module.to_empty on DTensor parameters, torch.func.jvp); the ungrouped form of
test_grouped_module_cast_forward_inputs is ported in test_training.py.
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import mp_casts_workers as C
from tests.dist.fsdp2 import mp_training_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    *grid("compute_dtype", W.compute_dtype, param_dtype=["bf16", "fp16"],
          reshard_after_forward=BOOLS),
    *grid("reduce_dtype", W.reduce_dtype, param_dtype=["bf16"], reduce=["fp32"],
          reshard_after_forward=BOOLS),
    *grid("reduce_dtype", W.reduce_dtype, param_dtype=["fp32"], reduce=["bf16"],
          reshard_after_forward=BOOLS),
    # reshard_after_forward=2 (hpZ), meaningful from 4 ranks on: the kept block rows are in
    # the compute dtype
    *grid("compute_dtype_k2", W.compute_dtype_hpz, worlds=(4,), param_dtype=["bf16", "fp16"]),
    *grid("reduce_dtype_k2", W.reduce_dtype_hpz, worlds=(4,), param_dtype=["bf16"],
          reduce=["fp32"]),
    *grid("reduce_dtype_k2", W.reduce_dtype_hpz, worlds=(4,), param_dtype=["fp32"],
          reduce=["bf16"]),
    Case("reduce_dtype_after_frozen_first_forward", W.reduce_dtype_after_frozen_first_forward),
    *grid("grad_acc_with_reduce_dtype", W.grad_acc_with_reduce_dtype,
          reshard_after_forward=BOOLS),
    *grid("structured_input_output", W.structured_input_output,
          container=["dataclass", "nested_dataclass", "namedtuple"],
          mp=["fp32", "bf16", "bf16_fp32_reduce"]),
    *grid("float16_on_one_submodule", C.float16_on_one_submodule,
          variant=["c2_fp16", "c2_casts_itself", "c1_output_fp32"]),
    *grid("submodules_with_external_inputs", C.submodules_with_external_inputs,
          enable_submodule_cast=[False, True]),
    *grid("checkpoint_recompute_casts", C.checkpoint_recompute_casts,
          recompute_cast=["input", "output"]),
    *grid("norm_modules", C.norm_modules, param_dtype=["bf16", "fp16"],
          variant=["layer_norm", "batch_norm_1d", "batch_norm_2d", "batch_norm_2d_low_buffers",
                   "batch_norm_2d_bn_policy"]),
    Case("clamp_reduce_dtype", C.clamp_reduce_dtype),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_mixed_precision(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
