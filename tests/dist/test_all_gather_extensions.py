"""Issue 36: FSDP2's all-gather extension contract (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`), every scenario run through torch's FSDP2 and shardwise with the same
client code in the same test ([Note: all-gather extensions] in engine/core/sharded_param.py).

- SplitTensor (tests/dist/ext_subclasses.py), a plain-tensor subclass gathered as a bf16
  part and an fp32 remainder (two dtypes packed as bytes, metadata, padded uneven shards
  through the 5-argument hook, even ones through the legacy hook): losses equal FSDP2's and
  the unsharded plain model's at 1e-5, with reshard_after_forward True and False, bf16
  mixed precision and CPU offload; shards stay SplitTensors; the post hook makes each
  unsharded weight once and refreshes it with `out=` after; `state_dict` / `load_state_dict`
  and DCP save / load round-trip.
- torchao NF4 QLoRA (frozen `to_nf4` weights, `linear_nf4`, LoRA adapters): losses equal
  FSDP2's and the unsharded run's at 1e-5 (reshard_after_forward True and False, bf16 mixed
  precision, CPU offload); shards stay NF4Tensors holding 1/N of the quantized bytes on
  each rank; `state_dict` / `load_state_dict` and DCP round-trip.
- torchao float8 training (`enable_fsdp_float8_all_gather=True, emulate=True` on CPU):
  losses equal FSDP2's and the unsharded float8 model's at 1e-5, with and without
  `precompute_float8_dynamic_scale_for_fsdp`.
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import all_gather_ext_workers as W
from tests.dist import torchao_ext_workers as T

# (legacy hook, reshard_after_forward, bf16 mixed precision, CPU offload)
SPLIT_CASES = [(False, True, False, False), (False, False, True, True),
               (True, True, False, False), (True, False, True, False)]


@pytest.mark.parametrize("world", [2, 3])
def test_subclass_hooks_match_fsdp2(world: int) -> None:
    run_distributed(W.split_parity, world, SPLIT_CASES, timeout_s=600)


@pytest.mark.parametrize("world", [2, 3])
def test_subclass_state_dict_and_dcp(world: int, tmp_path: object) -> None:
    run_distributed(W.split_state_dict, world, str(tmp_path), timeout_s=600)


# torchao (tests/dist/torchao_ext_workers.py) --------------------------------------------
# (reshard_after_forward, bf16 mixed precision, CPU offload)
QLORA_CASES = [(True, False, False), (False, True, True)]
# (reshard_after_forward, precompute_float8_dynamic_scale_for_fsdp after each step)
FLOAT8_CASES = [(True, False), (False, True)]


@pytest.mark.parametrize("world", [2, 3])
def test_nf4_qlora_matches_fsdp2(world: int) -> None:
    run_distributed(T.qlora_parity, world, QLORA_CASES, timeout_s=600)


@pytest.mark.parametrize("world", [2, 3])
def test_nf4_state_dict_and_dcp(world: int, tmp_path: object) -> None:
    run_distributed(T.qlora_state_dict, world, str(tmp_path), timeout_s=600)


@pytest.mark.parametrize("world", [2, 3])
def test_float8_training_matches_fsdp2(world: int) -> None:
    run_distributed(T.float8_parity, world, FLOAT8_CASES, timeout_s=600)
