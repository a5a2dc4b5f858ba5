"""Workers that go wrong on purpose: a dead rank, a diverging rank, bad state dicts."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise as sw
from tests.models import loss_fn, make_batch, make_model


def dead_rank(rank: int, world: int) -> None:
    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy="transformer")
    for step in range(3):
        if step == 1 and rank == 1:
            os._exit(17)  # dies without a word, mid-training
        x, y = make_batch("lm", step, 4)
        loss_fn("lm", model(x), y).backward()


def diverging_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = make_model("lm", 0) if rank == 0 else make_model("mlp", 0)
    sw.shard_model(model, auto_wrap_policy=None)
    x = make_batch("lm", 0, 2)[0] if rank == 0 else make_batch("mlp", 0, 2)[0]
    with pytest.raises(RuntimeError, match="ranks disagree on the sharded model"):
        model(x)


def bad_state_dict(rank: int, world: int) -> None:
    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy="transformer")
    sd = sw.full_state_dict(model)
    wrong = dict(sd)
    wrong["blocks.0.up.weight"] = torch.zeros(3, 3)
    # Only rank 0 holds the state dict; every rank must raise, none may hang.
    with pytest.raises(ValueError, match=r"blocks\.0\.up\.weight.*\(3, 3\)"):
        sw.load_full_state_dict(model, wrong if rank == 0 else None, from_rank0=True)
    missing = {k: v for k, v in sd.items() if k != "norm.bias"}
    with pytest.raises(ValueError, match="missing keys.*norm.bias"):
        sw.load_full_state_dict(model, missing)
    sw.load_full_state_dict(model, sd if rank == 0 else None, from_rank0=True)


def diverging_subclass(rank: int, world: int) -> None:
    """Same shapes and dtypes on every rank, but rank 0's weights carry FSDP2's all-gather
    hooks (an extension subclass) and rank 1's are plain: the two gather differently, so the
    layout check must name the disagreement rather than let the gathers mismatch."""
    from tests.dist import ext_subclasses as X

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 10), torch.nn.Linear(10, 3))
    if rank == 0:
        for lin in model:
            lin.weight = torch.nn.Parameter(X.SplitTensor(lin.weight.detach().clone()))
    sw.fully_shard(model)
    with pytest.raises(RuntimeError, match="ranks disagree on the sharded model"):
        model(torch.randn(2, 7))
