"""AdamW's fused and foreach implementations on sharded parameters ([Note: optimizer
implementation] in train/optim.py): through the optimizer fast path and through DTensor
dispatch, against the per-parameter loop on an unsharded copy, over a few steps."""

from __future__ import annotations

import copy

import torch

from shardwise.train.optim import adamw, implementation
from tests.dist.dtensor_workers import backward, full, make, ref_backward, shard

TOL = 1e-6


class _ViaDTensor(torch.optim.AdamW):
    """Not an exact torch class: the fast path leaves it to DTensor dispatch."""


def fused_and_foreach_match_the_loop(rank: int, world: int) -> None:
    model = make(0)
    ref = copy.deepcopy(model)
    kw = {"lr": 0.05, "weight_decay": 0.1}
    sharded, opts = [], []
    for impl in ("fused", "foreach"):
        m = shard(copy.deepcopy(model))
        opt, got = adamw(m.parameters(), impl=impl, **kw)
        assert got == impl and implementation(opt) == impl
        sharded.append(m)
        opts.append(opt)
    m = shard(copy.deepcopy(model))
    sharded.append(m)
    opts.append(_ViaDTensor(m.parameters(), fused=True, **kw))
    auto_model = shard(copy.deepcopy(model))
    auto, chosen = adamw(auto_model.parameters(), **kw)
    assert chosen == "fused", chosen  # CPU and fp32: fused is accepted
    sharded.append(auto_model)
    opts.append(auto)
    reference = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    for step in range(4):
        for m in sharded:
            backward(m, step, rank, world)
        ref_backward(ref, step)
        for o in (*opts, reference):
            o.step()
            o.zero_grad()
    for name, r in ref.named_parameters():
        for m, what in zip(sharded, ("fused", "foreach", "fused via DTensor", "auto")):
            p = dict(m.named_parameters())[name]
            diff = (full(p).detach() - r.detach()).abs().max().item()
            assert diff < TOL, f"{what} {name}: {diff} from the loop"
