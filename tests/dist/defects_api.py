"""Workers for issue 12's API defects: slicing, deepcopy, seeds, meta buffers, misuse."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.Linear(5, 2))


def slicing_and_deepcopy(rank: int, world: int) -> None:
    model = _seq()
    sw.fully_shard(model[0])
    sw.fully_shard(model)
    head = model[2:]
    assert type(head) is nn.Sequential, f"a slice is a {type(head).__name__}"
    assert getattr(head, "_sw_unit", None) is None
    assert isinstance(model[0], nn.Linear)
    with pytest.raises(TypeError, match="deepcopy"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="deepcopy"):
        copy.deepcopy(model[0])
    model(torch.randn(3, 6)).sum().backward()  # still trains after the refusals


class Rotary(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        # What rotary embeddings do: a derived, non-persistent buffer.
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2) / d)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.inv_freq.repeat(2)[: x.shape[-1]]


def materialize_seed_and_buffers(rank: int, world: int) -> None:
    # A common pattern: a different seed per rank. Replicas must still start identical.
    torch.manual_seed(1234 + rank)
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    sw.shard_model(m, sharding_strategy="NO_SHARD", auto_wrap_policy=None)
    sw.materialize(m)
    sd = sw.full_state_dict(m)
    from shardwise.engine.comm import collectives as C

    for k, v in sd.items():
        mine = v.clone()
        C.broadcast(v, 0)
        assert torch.equal(mine, v), f"replica {rank} of {k} differs from rank 0's"

    # A meta buffer that no initializer fills is refused, by name.
    with torch.device("meta"):
        r = Rotary(8)
    sw.fully_shard(r)
    with pytest.raises(ValueError, match="inv_freq"):
        sw.materialize(r)
    # Filled through init_fn (the documented path): accepted, with the right values.
    with torch.device("meta"):
        r = Rotary(8)
    sw.fully_shard(r)

    def init(mod: nn.Module) -> None:
        if isinstance(mod, Rotary):
            mod.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()

    sw.materialize(r, init)
    assert torch.allclose(r.inv_freq, 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))


def optimizer_before_sharding(rank: int, world: int) -> None:
    model = _seq()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sw.fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="before"):
        opt.step()
    good = torch.optim.AdamW(model.parameters(), lr=0.1)
    good.step()  # an optimizer built after sharding steps normally


def to_dtype_after_sharding(rank: int, world: int) -> None:
    model = _seq()
    sw.fully_shard(model[0])
    sw.fully_shard(model)
    with pytest.raises(ValueError, match="mixed_precision"):
        model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="mixed_precision"):
        model.half()
    before = [id(p) for p in model.parameters()]
    model.to(torch.float32)  # no change: allowed
    # ...and the modules still hold the engine's own sharded parameters (nn.Module._apply
    # would otherwise swap each DTensor's contents with a converted copy).
    assert [id(p) for p in model.parameters()] == before
    assert all(getattr(p, "_sw_param", None) is not None for p in model.parameters())
    model.train(False)
    model(torch.randn(2, 6)).sum().backward()  # untouched by the refusal
