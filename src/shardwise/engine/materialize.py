"""Deferred initialization: a model built on the meta device gets only its local shards."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .checks import check_int, check_module
from .fully_shard import sharded_params, units_of


def materialize(
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    seed: int | None = None,
) -> nn.Module:
    """Allocate the local shards of a sharded meta-device model, then initialize them.

    Each module's `reset_parameters()` (or `init_fn(module)` when given) runs on the module
    while it holds only its shards, so no rank ever holds the whole model. Dim-0 sharding
    leaves fan-in (dim 1) intact, so standard initializers keep their scale. Each shard rank
    draws from its own random stream (seed + shard rank); replicas share it.
    Buffers on the meta device are allocated (uninitialized) unless an initializer fills them.
    """
    check_module("model", model)
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn={init_fn!r} is not allowed: must be a callable "
                         "(module) -> None, or None")
    if seed is not None:
        check_int("seed", seed)
    units = units_of(model)
    if not units:
        raise ValueError(f"materialize needs a sharded model; {type(model).__name__} has none")
    device = units[0].mesh.device
    for sp in sharded_params(model):
        sp.materialize()
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:  # ignored parameters: replicated, not sharded
                m._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
    base = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        # Seeded by shard rank: shards are independent draws, while replicas of the same
        # shard (NO_SHARD, HYBRID_SHARD) draw the same values and start as one model.
        torch.manual_seed(base + units[0].mesh.shard_rank)
        with warnings.catch_warnings():
            # A rank whose shard of a small parameter is empty initializes zero elements.
            warnings.filterwarnings("ignore", message=".*zero-element tensors.*")
            with torch.no_grad():
                for m in model.modules():
                    if init_fn is not None:
                        init_fn(m)
                    elif hasattr(m, "reset_parameters") and callable(m.reset_parameters):
                        m.reset_parameters()
    return model
