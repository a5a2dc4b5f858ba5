"""Scenarios of upstream test_fully_shard_state.py: one unit per call, no second call on a
module, the class swap, containers without forward, deepcopy."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw
from tests.dist.fsdp2.common import Expect
from tests.dist.fsdp2.models import MLP


def fully_shard_state(rank: int, world: int, ex: Expect) -> None:
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    for m in [*model, model]:
        sw.fully_shard(m)
    units = [getattr(m, "_sw_unit", None) for m in [model, *model]]
    ex.true(all(u is not None for u in units), "a sharded module has no unit")
    ex.true(len({id(u) for u in units}) == 4, "the calls do not have distinct units")


def fully_shard_reapply(rank: int, world: int, ex: Expect) -> None:
    model = MLP(8)
    sw.fully_shard(model)
    try:
        sw.fully_shard(model)
        ex.true(False, "a second fully_shard on the same module was accepted")
    except (ValueError, RuntimeError):
        pass


def fully_shard_cls(rank: int, world: int, ex: Expect) -> None:
    """Only the module given to fully_shard changes class; a slice of a sharded Sequential
    is a plain Sequential (issue 12, defect 9)."""
    model = MLP(8)
    sw.fully_shard(model)
    ex.true(isinstance(model, MLP) and isinstance(model, sw.ShardedModule), "class swap")
    ex.true(type(model).__name__ == "ShardedMLP", f"class name {type(model).__name__}")
    for m in model.modules():
        if m is not model:
            ex.true(not isinstance(m, sw.ShardedModule), f"{type(m).__name__} was swapped")
    seq = nn.Sequential(*[MLP(8) for _ in range(3)])
    sw.fully_shard(seq)
    ex.true(isinstance(seq, nn.Sequential) and isinstance(seq, sw.ShardedModule), "Sequential")
    sliced = seq[:2]
    ex.true(isinstance(sliced, nn.Sequential), f"slice is a {type(sliced).__name__}")
    ex.true(not isinstance(sliced, sw.ShardedModule),
            f"slice of a sharded Sequential is a {type(sliced).__name__} (ShardedModule)")


def fully_shard_unsupported_module_cls(rank: int, world: int, ex: Expect) -> None:
    for container in (nn.ModuleList([MLP(8) for _ in range(3)]),
                      nn.ModuleDict({"1": MLP(8), "2": MLP(8)})):
        try:
            sw.fully_shard(container)
            ex.true(False, f"fully_shard accepted a {type(container).__name__}")
        except ValueError:
            pass


def fully_shard_deepcopy(rank: int, world: int, ex: Expect) -> None:
    """copy.deepcopy of a sharded module raises a clear error or returns a working copy;
    it never crashes the process (issue 12, defect 10)."""
    torch.manual_seed(0)
    model = MLP(8)
    sw.fully_shard(model)
    try:
        clone = copy.deepcopy(model)
    except (ValueError, RuntimeError, TypeError, AssertionError):
        return
    x = torch.randn(2, 8)
    ex.close(clone(x), model(x), "the copy computes differently from the original")
