"""sw.patch_fsdp2 / sw.patched_fsdp2: where FSDP2's fully_shard is swapped, and where not."""

from __future__ import annotations

import sys
import types

import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard._fully_shard as fsdp2_impl

import shardwise as sw
from shardwise.engine.api.fully_shard import fully_shard
from shardwise.engine.api.state import register_fsdp_forward_method


def test_patch_swaps_public_homes_and_bound_names_then_undoes() -> None:
    original = torch_fsdp.fully_shard
    user = types.ModuleType("a_framework")
    user.fully_shard = original  # as `from torch.distributed.fsdp import fully_shard` binds it
    user.register = torch_fsdp.register_fsdp_forward_method
    original_register = user.register
    sys.modules["a_framework"] = user
    try:
        with sw.patched_fsdp2():
            assert torch_fsdp.fully_shard is fully_shard
            assert user.fully_shard is fully_shard
            assert user.register is register_fsdp_forward_method
            # torch's own FSDP2 keeps its function (its methods call fully_shard.state()).
            assert fsdp2_impl.fully_shard is original
        assert torch_fsdp.fully_shard is original
        assert user.fully_shard is original
        assert user.register is original_register
        undo = sw.patch_fsdp2()
        assert user.fully_shard is fully_shard
        undo()
        assert user.fully_shard is original
    finally:
        del sys.modules["a_framework"]
