"""Workers for the engine-hygiene defects of issue 25: each check failed before its fix."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import shardwise as sw
from shardwise.engine.core.context import unit_of


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def predicate_is_pure(rank: int, world: int) -> bool:
    """has_unreduced_grads() answers without folding gradients into acc_grad."""
    m = _mlp()
    sw.fully_shard(m[0])
    sw.fully_shard(m)
    with sw.no_sync(m):
        m(torch.randn(4, 5)).sum().backward()
    unit = unit_of(m[0])
    assert unit is not None
    before = []
    for p in unit.params:
        p.acc_grad = torch.zeros(p.unsharded.shape)
        p.unsharded.grad = torch.ones(p.unsharded.shape)
        before.append((p.acc_grad.clone(), p.unsharded.grad))
    assert unit.has_unreduced_grads()
    for (acc, g), p in zip(before, unit.params):
        assert torch.equal(p.acc_grad, acc), "the predicate folded a gradient into acc_grad"
        assert p.unsharded.grad is g, "the predicate moved the unsharded gradient"
    return True


def finish_twice_adds_once(rank: int, world: int) -> float:
    """A pending reduction finished twice writes its result once."""
    m = _mlp()
    sw.fully_shard(m)
    unit = unit_of(m)
    assert unit is not None
    unit.wait_unshard()
    for p in unit.params:
        p.unsharded.grad = torch.full(p.unsharded.shape, float(rank + 1))
    pending = list(unit.reduce_grads())
    assert pending
    for pr in pending:
        pr.finish()
    once = [p.shard_grad.clone() for p in unit.params]
    for pr in pending:
        pr.finish()
    worst = max((p.shard_grad - g).abs().max().item() for p, g in zip(unit.params, once))
    assert worst == 0.0, f"a second finish changed the gradients by {worst}"
    return worst


def no_shard_frees_last_gradient(rank: int, world: int) -> bool:
    """NO_SHARD keeps no reference to a reduced gradient once the user dropped it."""
    m = sw.shard_model(_mlp(), sharding_strategy="NO_SHARD", auto_wrap_policy=None)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(4, 5)).sum().backward()
    opt.step()
    refs = [weakref.ref(p.grad) for p in m.parameters() if p.grad is not None]
    assert refs
    opt.zero_grad(set_to_none=True)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of last step's gradients are still held after zero_grad"
    return True


def fp16_reduction_stays_finite(rank: int, world: int) -> dict[str, float]:
    """fp16 reduction of gradients whose sum over the ranks overflows fp16 (max 65504)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 8, bias=False)
    mp = sw.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    sw.fully_shard(m, mp_policy=mp)
    # d(loss)/dW = 3e4 everywhere on every rank: each rank's gradient fits fp16, the sum of
    # three or four (9e4, 1.2e5) does not, their mean (3e4) does.
    (m(torch.ones(1, 4, dtype=torch.float16)).float() * 3e4).sum().backward()
    g = m.weight.grad.to_local() if hasattr(m.weight.grad, "to_local") else m.weight.grad
    return {"finite": float(torch.isfinite(g).all()), "worst": (g - 3e4).abs().max().item()}


def no_sync_backward_events(rank: int, world: int) -> dict[str, int]:
    """Under no_sync, each unit reports its backward once per backward."""
    from shardwise.observe.sinks import ListSink, attach_sink

    m = _mlp()
    sw.fully_shard(m[0])
    sw.fully_shard(m[2])  # its input needs a gradient: its post-backward runs in backward
    sw.fully_shard(m)
    sink = ListSink()
    attach_sink(m, sink)
    with sw.no_sync(m):
        m(torch.randn(4, 5)).sum().backward()
    counts: dict[str, int] = {}
    for e in sink.events:
        if e.phase == "backward":
            counts[e.unit] = counts.get(e.unit, 0) + 1
    return counts
