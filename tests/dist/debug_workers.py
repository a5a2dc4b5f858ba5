"""Workers for the collective checks: ranks that diverge, die or stall on purpose."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import shardwise as sw


class Chain(nn.Module):
    """Four blocks; `plan` says, per rank, which block indices forward runs, in order.

    The blocks sit in a plain module, not a ModuleList: a container of units is followed
    whatever its members' calls ([Note: data-dependent units]); these skips must not be."""

    def __init__(self, d: int = 9) -> None:
        super().__init__()
        self.blocks = nn.Module()
        for i in range(4):
            self.blocks.add_module(str(i), nn.Linear(d, d))
        self.head = nn.Linear(d, 3)
        self.other_head = nn.Linear(d, 3)
        self.plan: list[int] = [0, 1, 2, 3]
        self.use_other_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.plan:
            x = torch.tanh(self.blocks.get_submodule(str(i))(x))
        return (self.other_head if self.use_other_head else self.head)(x)


def _sharded() -> Chain:
    torch.manual_seed(0)
    model = Chain()
    for b in model.blocks.children():
        sw.fully_shard(b)
    sw.fully_shard(model.head)
    sw.fully_shard(model.other_head)
    sw.fully_shard(model)
    return model


def _step(model: Chain, step: int) -> None:
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def diverge(rank: int, world: int, how: str, at_step: int) -> str:
    """Rank 1 leaves the common path on `at_step`; every rank must raise, naming both paths."""
    sw.set_debug(True)
    model = _sharded()
    for step in range(at_step):
        _step(model, step)
    if rank == 1:
        if how == "extra":
            model.plan = [0, 1, 1, 2, 3]
        elif how == "skip":
            model.plan = [0, 1, 3]
        elif how == "branch":
            model.use_other_head = True
    with pytest.raises(sw.CollectiveMismatchError) as info:
        _step(model, at_step)
    text = str(info.value)
    others = [r for r in range(world) if r != 1]
    assert f"ranks {others} are at" in text and "ranks [1] are at" in text, text
    expected = {"extra": ("'blocks.1'", "'blocks.2'"), "skip": ("'blocks.2'", "'blocks.3'"),
                "branch": ("'head'", "'other_head'")}[how]
    if at_step == 0:  # no prefetch yet: the first collective that differs is exactly this one
        for unit in expected:
            assert unit in text, text
    else:  # prefetch is on: they part ways at one of the units involved
        assert "unit 'blocks." in text or "head'" in text, text
    return type(info.value).__name__


def agree_without_debug(rank: int, world: int) -> None:
    """Off unless asked for: the run trains and no fingerprint is ever exchanged."""
    from shardwise.engine.comm import work as debug

    model = _sharded()
    for step in range(2):
        _step(model, step)
    assert not debug.debug_enabled()
    assert debug._sequence == {}, debug._sequence


def matching_runs_pass_with_debug(rank: int, world: int) -> list[float]:
    """Debug on, every rank on the same path: training is unchanged (same losses as off)."""
    losses = []
    for on in (False, True):
        sw.set_debug(on)
        model = _sharded()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 9, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            sw.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    assert losses[:3] == losses[3:], losses
    return losses


def dies(rank: int, world: int) -> None:
    """Rank 1 exits between steps: the survivors' error names the collective and the unit."""
    model = _sharded()
    _step(model, 0)
    if rank == 1:
        os._exit(17)
    _step(model, 1)


def stalls(rank: int, world: int, stall_s: float) -> None:
    """Rank 1 stops answering for longer than the collective timeout."""
    model = _sharded()
    _step(model, 0)
    if rank == 1:
        time.sleep(stall_s)
    _step(model, 1)
