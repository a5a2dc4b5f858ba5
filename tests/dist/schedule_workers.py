"""Workers for test_schedule.py: the engine's schedule under given in-flight limits."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.engine.core.context import context_of
from shardwise.engine.core.schedule import Limits
from tests.models import loss_fn, make_batch, make_model


def in_flight(rank: int, world: int, gathers: int, reduces: int,
              coalesce_bytes: int | None = None) -> dict[str, int]:
    """Three training steps of the tiny LM with the schedule's limits set; what it did."""
    model = make_model("lm", 0)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer",
                   coalesce_bytes=coalesce_bytes)
    ctx = context_of(model)
    assert ctx is not None
    ctx.schedule.limits = Limits(gathers=gathers, reduces=reduces)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = make_batch("lm", 10 + step + rank * 100, 4)
        loss_fn("lm", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    s = ctx.schedule
    return {"gathers": s.most_gathers, "reduces": s.most_reduces, "prefetches": s.prefetches,
            "units": len(s.units)}


def decision_log(rank: int, world: int, strategy: str, gathers: int, reduces: int,
                 cfg_kw: dict) -> list[tuple[str, int]]:
    """The schedule's decisions in the second of two training steps of a GPT ([Note:
    decision log] in engine/core/schedule.py), units by their index in the context (forward
    order, the root first, as the planner numbers them)."""
    from shardwise.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
    ctx = context_of(model)
    assert ctx is not None
    ctx.schedule.limits = Limits(gathers=gathers, reduces=reduces)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        if step == 1:
            ctx.schedule.log = []  # the first step records the forward order
        idx = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
    index = {id(u): i for i, u in enumerate(ctx.units)}
    return [(what, index[id(u)]) for what, u in ctx.schedule.log or ()]
