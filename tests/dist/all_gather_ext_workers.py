"""FSDP2's all-gather extension contract on shardwise, each scenario run through torch's own
FSDP2 and through shardwise in the same processes, with the same client code.

Every scenario builds the model from one seed, shards it with `fully_shard` (torch's or
shardwise's, with the same knobs), trains a few steps on each rank's slice of one global
batch and records the mean loss over ranks; the two runs must agree at 1e-5, and with a
subclass that gathers exactly (SplitTensor) both must equal an unsharded plain model.
Failures are collected and raised at the end so every rank issues the same collectives.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise as sw
from tests.dist import ext_subclasses as X

IMPLS: dict[str, Callable[..., Any]] = {"fsdp2": torch_fully_shard, "shardwise": sw.fully_shard}
TOL = 1e-5


class Failures:
    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, cond: object, what: str) -> None:
        if not cond:
            self.items.append(what)

    def close(self, a: list[float], b: list[float], what: str, tol: float = TOL) -> None:
        worst = max((abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b)), default=0.0)
        self.check(len(a) == len(b) and worst <= tol, f"{what}: {a} vs {b} (worst {worst:.3g})")

    def raise_any(self, rank: int) -> None:
        if self.items:
            raise AssertionError(f"rank {rank}:\n" + "\n".join(self.items[:20]))


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int, h: int, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n)])
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def knobs(raf: bool, mp: bool, offload: bool) -> dict[str, Any]:
    """fully_shard keyword arguments, as torch's policy objects (shardwise takes them too)."""
    kw: dict[str, Any] = {"reshard_after_forward": raf}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return kw


def shard(impl: str, model: nn.Module, units: list[nn.Module], kw: dict[str, Any]) -> None:
    fn = IMPLS[impl]
    for m in units:
        fn(m, **kw)
    fn(model, **kw)


def batches(steps: int, world: int, per_rank: int, d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(world * per_rank, d, generator=g) for _ in range(steps)]


def mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(model: nn.Module, data: list[torch.Tensor], rank: int, world: int,
          loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
          after_step: Callable[[nn.Module], None] | None = None,
          params: list[nn.Parameter] | None = None) -> list[float]:
    """Steps of AdamW on this rank's slice; the mean loss over ranks of each step."""
    trainable = params if params is not None else [p for p in model.parameters()
                                                   if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, foreach=False)
    losses = []
    for full in data:
        n = full.shape[0] // world
        loss = loss_of(model, full[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        losses.append(mean_over_ranks(loss))
    return losses


def reference(model: nn.Module, data: list[torch.Tensor],
              loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor], world: int
              ) -> list[float]:
    """The unsharded run: each rank's slice's loss averaged, gradients averaged alike."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                            foreach=False)
    losses = []
    for full in data:
        parts = full.chunk(world)
        total = sum(loss_of(model, x) for x in parts) / world
        total.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))  # type: ignore[union-attr]
    return losses


def sq_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def local_types(model: nn.Module, names: str = "weight") -> set[str]:
    """The classes of the extension parameters' shards: each must be a DTensor whose local
    tensor is the subclass, as in FSDP2."""
    out = set()
    for n, p in model.named_parameters():
        if n.endswith(names):
            out.add(type(p._local_tensor).__name__ if isinstance(p, DTensor)
                    else f"plain {type(p).__name__}")
    return out


# --- the plain-subclass scenario (upstream's train parity, with SplitTensor) ---------------


def split_parity(rank: int, world: int, cases: list[tuple[bool, bool, bool, bool]]) -> None:
    """cases: (legacy hook, reshard_after_forward, bf16 mixed precision, CPU offload)."""
    fails = Failures()
    for legacy, raf, mp, offload in cases:
        what = f"legacy={legacy} raf={raf} mp={mp} offload={offload}"
        # Uneven shards (7 rows over 2 or 3 ranks) for the 5-argument hook, which pads;
        # the legacy hook cannot pad, so its rows divide both world sizes.
        d, h = (12, 18) if legacy else (7, 10)
        data = batches(3, world, 2, d)
        torch.manual_seed(0)
        plain = Net(d, h)
        got: dict[str, list[float]] = {}
        for impl in IMPLS:
            model = X.split_weights(copy.deepcopy(plain), legacy)
            shard(impl, model, list(model.blocks), knobs(raf, mp, offload))
            X.CALLS.clear()
            got[impl] = train(model, data, rank, world, sq_loss)
            if impl == "shardwise":
                kind = "LegacySplitTensor" if legacy else "SplitTensor"
                fails.check(local_types(model) == {kind},
                            f"{what}: shards are {local_types(model)}, not {kind}")
                pre = X.CALLS["pre1" if legacy else "pre5"]
                # Five weights, gathered at least once per step; the post hook makes each
                # unsharded weight once, then refreshes it through out=.
                fails.check(pre >= 5 * 3, f"{what}: pre hook ran {pre} times")
                fails.check(X.CALLS["post"] == 5 and X.CALLS["post_out"] == pre - 5,
                            f"{what}: post hook calls {dict(X.CALLS)} (5 first, then out=)")
        fails.close(got["shardwise"], got["fsdp2"], f"{what}: shardwise vs FSDP2")
        if not mp:
            ref = reference(copy.deepcopy(plain), data, sq_loss, world)
            fails.close(got["shardwise"], ref, f"{what}: shardwise vs unsharded")
    fails.raise_any(rank)


def split_state_dict(rank: int, world: int, path: str) -> None:
    """`model.state_dict()` / `load_state_dict` and DCP save / load of SplitTensor shards,
    the same client code on FSDP2 and shardwise: a model built from another seed takes the
    first one's weights and then computes what it computes."""
    import torch.distributed.checkpoint as dcp

    fails = Failures()
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(5))
    for impl in IMPLS:
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            m = X.split_weights(Net(7, 10))
            shard(impl, m, list(m.blocks), {})
            models.append(m)
        a, b = models
        want = a(x).detach()
        sd = a.state_dict()
        kinds = {type(v._local_tensor).__name__ for k, v in sd.items() if k.endswith("weight")}
        fails.check(kinds == {"SplitTensor"}, f"{impl}: state dict shards are {kinds}")
        b.load_state_dict(sd)
        fails.check(torch.equal(b(x).detach(), want), f"{impl}: load_state_dict round trip")
        torch.manual_seed(2)
        c = X.split_weights(Net(7, 10))
        shard(impl, c, list(c.blocks), {})
        dcp.save(a.state_dict(), checkpoint_id=f"{path}/{impl}")
        sd_c = c.state_dict()
        dcp.load(sd_c, checkpoint_id=f"{path}/{impl}")
        c.load_state_dict(sd_c)
        fails.check(torch.equal(c(x).detach(), want), f"{impl}: DCP save / load")
    fails.raise_any(rank)
