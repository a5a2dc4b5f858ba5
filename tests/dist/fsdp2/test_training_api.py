"""Port of upstream test_fully_shard_training.py's scenarios that call FSDP2's module
methods during training (left out of test_training.py at first): test_explicit_prefetching,
test_post_optim_event, test_train_parity_multi_group_unshard_async_op (and the int
reshard_after_forward form of test_train_parity_multi_group), test_partial_group_reshard_toggle,
test_reset_iter_state_after_exception (plus a failure in backward),
test_register_fsdp_forward_method, test_share_comm_context, test_fully_shard_comm.py's
test_unshard_async (asynchronous unshards between the model's own asynchronous
all-reduces), and
test_train_parity_shard_placement_fn_shard_largest_dim with
test_shard_placement_fn_contiguous_params_grads (every parameter on its largest dim, uneven at 3
ranks, which FSDP2 refuses and shardwise pads; unsharded weights and gradients contiguous).

Left out: the delay_* axes and CUDA stream assertions (CUDA sleep kernels and streams).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import training_api_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    *grid("explicit_prefetching", W.explicit_prefetching, n_ahead=[1, 2]),
    *grid("post_optim_event", W.post_optim_event, event=["stream", "counted"]),
    *grid("train_parity_multi_group_unshard_async_op", W.unshard_async_op,
          raf=["true", "false", "int", "int1"]),
    *grid("partial_group_reshard_toggle", W.partial_group_reshard_toggle,
          weight_tying=BOOLS, initial_reshard=BOOLS),
    *grid("reset_iter_state_after_exception", W.reset_iter_state_after_exception,
          where=["forward", "backward"]),
    Case("register_fsdp_forward_method", W.register_forward_method),
    Case("share_comm_context", W.share_comm_ctx_parity),
    Case("unshard_async", W.unshard_async_overlap),
    Case("shard_placement_fn_largest_dim", W.shard_placement_fn_largest_dim),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_training_api(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
