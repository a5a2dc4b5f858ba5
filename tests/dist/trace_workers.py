"""Workers for the trace tests: a tiny sharded LM traced for a few steps."""

from __future__ import annotations

from typing import Any

import torch

import shardwise as sw
from shardwise.engine.core.context import units_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 4
STEPS = 3


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = make_batch("lm", seed, PER_RANK)
    loss_fn("lm", model(x), y).backward()
    opt.step()
    opt.zero_grad()


def traced(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Trace STEPS steps after one warm-up step; return what the parent checks the files by."""
    torch.manual_seed(0)
    model = make_model("lm", 0)
    # The tiny LM's units are coalesced into one group ([Note: coalesced units]): a group's
    # collective is one event per member, each with its own bytes.
    sw.shard_model(model, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, seed=100 + rank)  # lazy init + the prefetch order
    with sw.trace(out_dir, model) as t:
        for step in range(1, STEPS + 1):
            t.step(step)
            _train_step(model, opt, seed=step * 10 + rank)
    # The bytes one all-gather of each unit moves, from the unit's own flat layout.
    units = units_of(model)
    gather = {u.name: sum(b.numel * u.mesh.shard_size * b.dtype.itemsize for b in u.buckets)
              for u in units}
    refused = ""
    try:
        with sw.trace(out_dir, model):
            pass
    except ValueError as e:
        refused = str(e)
    assert t.report is not None
    return {"gather_bytes": gather, "reshards": {u.name: u.reshard_after_forward and not
                                                 u.is_root for u in units},
            "report": t.report.to_dict(), "refused": refused, "rank_path": str(t.rank_path)}


def traced_hybrid(rank: int, world: int, out_dir: str) -> list[dict[str, Any]]:
    """HYBRID_SHARD 2 x 2: the cross-replica all-reduce is synchronous, so all of it is exposed."""
    torch.manual_seed(0)
    model = make_model("lm", 0)
    sw.shard_model(model, sharding_strategy="HYBRID_SHARD", auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, seed=100 + rank)
    with sw.trace(out_dir, model) as t:
        t.step(1)
        _train_step(model, opt, seed=10 + rank)
    assert t.report is not None
    return [r.to_dict() for r in t.report.rows]
