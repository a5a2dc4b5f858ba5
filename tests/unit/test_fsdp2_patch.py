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
            # The module that defines FSDP2's function exports it too (issue 36).
            assert fsdp2_impl.fully_shard is fully_shard
        assert torch_fsdp.fully_shard is original
        assert fsdp2_impl.fully_shard is original
        assert user.fully_shard is original
        assert user.register is original_register
        undo = sw.patch_fsdp2()
        assert user.fully_shard is fully_shard
        undo()
        assert user.fully_shard is original
    finally:
        del sys.modules["a_framework"]


# Every torch namespace that exports FSDP2's function (torch 2.13), and how a framework
# module binds it at its import (torchtune, torchtitan: the `_composable` path).
_IMPORTS = {
    "torch.distributed.fsdp": "from torch.distributed.fsdp import fully_shard",
    "torch.distributed.fsdp._fully_shard":
        "from torch.distributed.fsdp._fully_shard import fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard":
        "from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard",
    "torch.distributed._composable.fsdp":
        "from torch.distributed._composable.fsdp import fully_shard",
    "torch.distributed._composable.fsdp.fully_shard":
        "from torch.distributed._composable.fsdp.fully_shard import fully_shard",
}


def test_patch_rebinds_every_torch_home_and_names_bound_at_import() -> None:
    """Issue 36: a module that ran `from torch.distributed._composable.fsdp import
    fully_shard` (or any other home, under any name) before the patch calls shardwise's
    after it, and FSDP2's again after the undo."""
    original = torch_fsdp.fully_shard
    users = {}
    for home, statement in _IMPORTS.items():
        user = types.ModuleType(f"framework_{len(users)}")
        exec(f"{statement}\n{statement} as shard", vars(user))  # a framework's import
        users[home] = user
        sys.modules[user.__name__] = user
    try:
        homes = [sys.modules[h] for h in _IMPORTS]
        for user in users.values():
            assert user.fully_shard is original and user.shard is original
        undo = sw.patch_fsdp2()
        try:
            for home in homes:
                assert home.fully_shard is fully_shard, home.__name__
            for home, user in users.items():
                assert user.fully_shard is fully_shard and user.shard is fully_shard, home
        finally:
            undo()
        for home in homes:
            assert home.fully_shard is original, home.__name__
        for user in users.values():
            assert user.fully_shard is original and user.shard is original
    finally:
        for user in users.values():
            del sys.modules[user.__name__]
