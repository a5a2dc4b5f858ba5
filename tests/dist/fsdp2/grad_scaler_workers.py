"""Scenario of upstream test_fully_shard_grad_scaler.py, with sw.ShardedGradScaler."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from tests.dist.fsdp2.common import Expect


def gradient_scaler(rank: int, world: int, ex: Expect, has_inf: bool) -> None:
    """An inf in one rank's shard makes every rank skip the step and back off the scale;
    without it, gradients are unscaled exactly and the step runs."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for m in [*model, model]:
        sw.fully_shard(m)
    loss = model(torch.randn(4, 4)).sum()
    scaler = sw.ShardedGradScaler(init_scale=2.0, enabled=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler.scale(loss).backward()
    first = opt.param_groups[0]["params"][0]
    if has_inf and rank == 1:
        local_of(first.grad)[0, 0] = float("inf")  # in rank 1's own rows
    initial_grad = local_of(first.grad).detach().clone()
    initial_params = [local_of(p.detach()).clone() for p in model.parameters()]
    scaler.unscale_(opt)
    ex.close(local_of(first.grad), initial_grad * (1 / 2.0), "unscaled gradient")
    initial_scale = scaler.get_scale()
    initial_state = copy.copy(opt.state)
    stepped = scaler.step(opt)
    ex.true(stepped == (not has_inf), f"step returned {stepped} with has_inf={has_inf}")
    if has_inf:
        ex.true(len(opt.state) == len(initial_state) == 0, "optimizer state changed")
        for p, q in zip(model.parameters(), initial_params):
            ex.true(torch.equal(local_of(p.detach()), q), "a parameter changed in a skipped step")
    else:
        ex.true(len(opt.state) > 0, "optimizer did not step")
    scaler.update()
    expected = initial_scale * (0.5 if has_inf else 1.0)
    ex.true(scaler.get_scale() == expected, f"scale {scaler.get_scale()}, expected {expected}")
