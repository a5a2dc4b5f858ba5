"""Workers for test_schedule.py: the engine's schedule under given in-flight limits."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.engine.inspect import context_of
from shardwise.engine.schedule import Limits
from tests.models import loss_fn, make_batch, make_model


def in_flight(rank: int, world: int, gathers: int, reduces: int) -> dict[str, int]:
    """Three training steps of the tiny LM with the schedule's limits set; what it did."""
    model = make_model("lm", 0)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer")
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
