"""Issue 36: FSDP2's all-gather extension contract (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`), every scenario run through torch's FSDP2 and shardwise with the same
client code in the same test ([Note: all-gather extensions] in engine/core/extension.py).

- SplitTensor (tests/dist/ext_subclasses.py), a plain-tensor subclass gathered as a bf16
  part and an fp32 remainder (two dtypes packed as bytes, metadata, padded uneven shards
  through the 5-argument hook, even ones through the legacy hook): losses equal FSDP2's and
  the unsharded plain model's at 1e-5, with reshard_after_forward True and False, bf16
  mixed precision and CPU offload; shards stay SplitTensors; the post hook makes each
  unsharded weight once and refreshes it with `out=` after; `state_dict` / `load_state_dict`
  and DCP save / load round-trip.
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import all_gather_ext_workers as W

# (legacy hook, reshard_after_forward, bf16 mixed precision, CPU offload)
SPLIT_CASES = [(False, True, False, False), (False, False, True, True),
               (True, True, False, False), (True, False, True, False)]


@pytest.mark.parametrize("world", [2, 3])
def test_subclass_hooks_match_fsdp2(world: int) -> None:
    run_distributed(W.split_parity, world, SPLIT_CASES, timeout_s=600)


@pytest.mark.parametrize("world", [2, 3])
def test_subclass_state_dict_and_dcp(world: int, tmp_path: object) -> None:
    run_distributed(W.split_state_dict, world, str(tmp_path), timeout_s=600)
