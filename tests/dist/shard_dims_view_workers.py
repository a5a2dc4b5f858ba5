"""The unsharded parameter of a Shard(d != 0) parameter as forward sees it: contiguous, with
the original strides, as FSDP2 gives it ([Note: layout] in engine/core/sharded_param.py).

The experts here call `w.view(E * F, D)` in forward, which needs exactly that layout (a
movedim view of the gathered rows refuses it), and record each weight's strides. Each case
trains shardwise, FSDP2 running the same client code and the unsharded reference in one
process group; losses, gradients and parameters must agree at 1e-5 (in bf16 against FSDP2
only; hpZ and parameters kept across steps against the unsharded run only, as FSDP2
fails at the one and computes with stale parameters at the other).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import Shard

import shardwise as sw
from shardwise.engine.comm import collectives as C
from tests.dist.shard_dims_workers import (
    PER_RANK,
    STEPS,
    VOCAB,
    D,
    batch,
    check_layout,
    compare,
    full,
    loss_of,
    train,
)


class FlatExperts(nn.Module):
    """(E, f, D) experts used through `.view(E * f, D)`: one matmul over all experts, the
    routing as a mask on the hidden units (the same math as a loop over experts)."""

    def __init__(self, n: int, f: int) -> None:
        super().__init__()
        self.n, self.f = n, f
        self.w1 = nn.Parameter(torch.randn(n, f, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(n, f, D) * 0.3)
        # (shape, strides) of each weight as forward saw it
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        E, f = self.n, self.f
        for w in (self.w1, self.w2):
            self.seen.append((tuple(w.shape), tuple(w.stride())))
        a = torch.tanh(h @ self.w1.view(E * f, D).t()).view(-1, E, f)  # (T, E, f)
        a = a * nn.functional.one_hot(route, E).to(a.dtype).unsqueeze(-1)
        return a.reshape(-1, E * f) @ self.w2.view(E * f, D)  # (T, D)


class Block(nn.Module):
    def __init__(self, n: int, f: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.experts = FlatExperts(n, f)

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return h + self.experts(self.norm(h), route)


class Model(nn.Module):
    def __init__(self, n: int, f: int) -> None:
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(n, f) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        route = ids % self.n
        for b in self.blocks:
            h = b(h, route)
        return self.head(h)


def shard(dim: int | None, sw_kw: dict[str, Any], fsdp2_kw: dict[str, Any]
          ) -> tuple[Callable[[nn.Module], None], Callable[[nn.Module], None]]:
    """(shardwise, FSDP2) sharding of the same model: experts on Shard(dim) per block (None:
    each system's default), the same options where they differ only by type."""
    place = None if dim is None else (lambda p: Shard(dim) if p.dim() == 3 else None)

    def with_(fs: Any, kw: dict[str, Any]) -> Callable[[nn.Module], None]:
        def go(model: nn.Module) -> None:
            for b in model.blocks:
                fs(b, shard_placement_fn=place, **kw)
            fs(model, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
        return go
    return with_(sw.fully_shard, sw_kw), with_(fsdp2_fully_shard, fsdp2_kw)


def options(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """shardwise's and FSDP2's keyword arguments for a named option set."""
    if name in ("plain", "keep_after_backward"):
        return {}, {}
    if name == "bf16_offload_keep":
        # mixed precision, CPU offload and no reshard after forward together
        return ({"mp_policy": sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32),
                 "offload_policy": sw.CPUOffloadPolicy(), "reshard_after_forward": False},
                {"mp_policy": TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 "offload_policy": TorchOffload(pin_memory=False),
                 "reshard_after_forward": False})
    if name == "hpz2":
        return {"reshard_after_forward": 2}, {"reshard_after_forward": 2}
    raise ValueError(name)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").stride())


def check_seen(model: nn.Module, what: str) -> int:
    """Every expert weight forward saw had its full shape and contiguous strides."""
    n = 0
    for b in model.blocks:
        want = (b.experts.n, b.experts.f, D)
        for shape, stride in b.experts.seen:
            assert shape == want, f"{what}: forward saw shape {shape}, want {want}"
            assert stride == contiguous_strides(shape), (
                f"{what}: forward saw strides {stride} for shape {shape}, want "
                f"{contiguous_strides(shape)} (contiguous, as FSDP2 gives it)")
            n += 1
    return n


def train_kept(model: nn.Module, rank: int, world: int) -> dict[str, Any]:
    """`train` for a model whose units stay gathered after backward: the module then holds
    the unsharded parameters, so gradients and values are read from the sharded ones the
    optimizer holds, named before the first forward."""
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for step in range(STEPS):
        ids = batch(step, world)[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = loss_of(model, ids)
        loss.backward()
        t = loss.detach().reshape(1).clone()
        C.all_reduce(t, None)
        losses.append(t.item() / world)
        grads.append({n: full(p.grad).clone() for n, p in params.items()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: full(p.detach()).clone() for n, p in params.items()}}


def view_parity(rank: int, world: int,
                cases: list[tuple[str, int, int, int | None, int, str]]) -> dict[str, int]:
    """Each case: (name, experts, f, Shard dim or None, shardwise's expected dim, options).
    Returns how many weights each case's forwards saw, per rank."""
    out: dict[str, int] = {}
    for name, n, f, dim, want_dim, opts in cases:
        torch.manual_seed(0)
        base = Model(n, f)
        sw_kw, fsdp2_kw = options(opts)
        how_sw, how_fsdp2 = shard(dim, sw_kw, fsdp2_kw)
        model = copy.deepcopy(base)
        how_sw(model)
        if opts == "keep_after_backward":
            # The blocks stay gathered from one backward to the next forward, across the
            # optimizer step: the stale check must see the shards changed and re-gather.
            for b in model.blocks:
                b.set_reshard_after_backward(False)
        check_layout(model, want_dim, name)
        got = (train(model, rank, world, sharded=True) if opts != "keep_after_backward"
               else train_kept(model, rank, world))
        out[name] = check_seen(model, f"{name}: shardwise")
        # FSDP2 (torch 2.13) cannot run hpZ with Shard(d != 0): backward's copy-out indexes
        # dim d of its 1-D post-forward shard (IndexError in foreach_all_gather_copy_out).
        # Nor does it re-gather parameters kept across an optimizer step (they are stale).
        if opts not in ("hpz2", "keep_after_backward"):
            theirs = copy.deepcopy(base)
            how_fsdp2(theirs)
            want = train(theirs, rank, world, sharded=True)
            check_seen(theirs, f"{name}: FSDP2")
            compare(got, want, f"{name}: shardwise vs FSDP2")
        if "bf16" not in opts:
            compare(got, train(copy.deepcopy(base), rank, world, sharded=False),
                    f"{name}: shardwise vs unsharded")
    return out
