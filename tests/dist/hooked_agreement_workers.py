"""Workers for the hooked agreement ([Note: hooked agreement] in engine/schedule_lockstep.py).

Whether a gradient can reach a unit's outputs depends on the data: `Maybe` hands its input on
unchanged on a rank whose data does not use it. The ranks agree, per unit, whether any of them
hooked its outputs: a unit hooked somewhere gathers in backward on every rank (in lockstep),
one hooked nowhere (a frozen bottom stack, a unit no rank uses) on none. Each worker trains
the sharded model beside the unsharded reference of every rank's loss and compares every
gradient (None alike) at every step, and counts each unit's all-gathers in backward.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.engine.comm import collectives as C
from shardwise.engine.inspect import context_of
from shardwise.engine.schedule import ShardedState
from tests.dist.parity import grads_of

D, OUT, PER_RANK = 6, 3, 2
# Units that no rank hooks: never gathered in backward.
NOWHERE = ("f0", "f1", "idle")


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Maybe(nn.Module):
    """Used by some ranks' data only: elsewhere its output is its input (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return torch.tanh(self.lin(x)) if use else x


class Net(nn.Module):
    """f0 -> f1 (frozen, inputs need no gradient) -> idle (used by no rank) -> m (used by
    some ranks; `twice`: called again) -> b (`ckpt`: activation-checkpointed) -> head."""

    def __init__(self, twice: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.f0, self.f1, self.idle, self.m = Frozen(), Frozen(), Maybe(), Maybe()
        self.b = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, OUT)
        self.twice, self.ckpt = twice, ckpt

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        h = self.idle(self.f1(self.f0(x)), False)
        h = self.m(h, bool(use[0]))
        if self.twice:
            h = self.m(h, bool(use[1]))
        h = checkpoint(self.b, h, use_reentrant=False) if self.ckpt else self.b(h)
        return self.head(h)


def uses(step: int, world: int) -> torch.Tensor:
    """(world, 2): whether each rank's data uses m in its first and second call. Step 0: rank
    0 alone (second call: the last rank alone); 1: all but rank 0 (none); 2: none (rank 0);
    3: every rank (every rank)."""
    r = torch.arange(world)
    firsts = [r == 0, r != 0, r < 0, r >= 0]
    seconds = [r == world - 1, r < 0, r == 0, r >= 0]
    return torch.stack([firsts[step % 4], seconds[step % 4]], dim=1)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(world * PER_RANK, D, generator=g), torch.randn(world * PER_RANK, OUT,
                                                                      generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, use: torch.Tensor,
          ranks: range) -> torch.Tensor:
    """The mean over `ranks` of each rank's loss, on its slice with its own `use`."""
    losses = [((model(x[i * PER_RANK:(i + 1) * PER_RANK], use[i])
                - y[i * PER_RANK:(i + 1) * PER_RANK]) ** 2).mean() for i in ranks]
    return torch.stack(losses).mean()


def _shard(model: Net, strategy: str, prefetch: bool) -> None:
    mesh = None
    if strategy == "NO_SHARD":  # shard groups of one rank, replicated across all
        from shardwise.engine.mesh import mesh_for_strategy
        from shardwise.engine.policies import ShardingStrategy

        mesh = mesh_for_strategy(ShardingStrategy.NO_SHARD, None)
    rafter = strategy == "FULL_SHARD"
    for u in (model.f0, model.f1, model.idle, model.m, model.b):
        sw.fully_shard(u, mesh=mesh, reshard_after_forward=rafter)
    sw.fully_shard(model, mesh=mesh, reshard_after_forward=rafter)
    model.set_prefetch(prefetch)


def count_backward_gathers(model: nn.Module) -> dict[str, int]:
    """Each unit's all-gathers issued while the model is in backward, counted by name (the
    root ''); a live dict."""
    ctx = context_of(model)
    assert ctx is not None
    counts: dict[str, int] = {}
    for u in ctx.units:
        counts[u.name] = 0

        def counted(async_op: bool = True, _u=u, _real=u.unshard) -> None:
            if _u.state is ShardedState.SHARDED and ctx.in_backward:
                counts[_u.name] += 1
            _real(async_op)

        u.unshard = counted  # type: ignore[method-assign]
    return counts


def grad_report(model: nn.Module, ref: nn.Module) -> tuple[float, list[str]]:
    """The largest gradient difference, and the parameters whose gradient is None on one
    side only."""
    ref_named = dict(ref.named_parameters())
    worst, none_mismatch = 0.0, []
    for fqn, (g, missing) in grads_of(model).items():
        rg = ref_named[fqn].grad
        if (rg is None) != missing:
            none_mismatch.append(fqn)
        elif rg is not None:
            worst = max(worst, (g - rg).abs().max().item())
    return worst, none_mismatch


def train(rank: int, world: int, strategy: str, prefetch: bool = True, twice: bool = False,
          ckpt: bool = False, steps: int = 4,
          between: Callable[[int, nn.Module], None] | None = None) -> dict:
    """`steps` AdamW steps against the reference: the worst gradient and parameter
    differences, gradients None on one side only, each unit's backward gathers per step,
    and the loss of every step (the same on every rank: the ranks' mean)."""
    torch.manual_seed(0)
    model = Net(twice, ckpt)
    ref = copy.deepcopy(model)
    _shard(model, strategy, prefetch)
    counts = count_backward_gathers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    out: dict = {"grad": 0.0, "none": [], "gathers": [], "loss": 0.0}
    for step in range(steps):
        if between is not None:
            between(step, model)
        x, y = _batch(step, world)
        use = uses(step, world)
        for k in counts:
            counts[k] = 0
        _loss(model, x, y, use, range(rank, rank + 1)).backward()
        out["gathers"].append(dict(counts))
        _loss(ref, x, y, use, range(world)).backward()
        worst, none = grad_report(model, ref)
        out["grad"] = max(out["grad"], worst)
        out["none"] += [f"step {step}: {n}" for n in none]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    out["params"] = max((full[n] - p.detach()).abs().max().item()
                        for n, p in ref.named_parameters())
    return out


def strategies(rank: int, world: int, strategy: str) -> dict[str, dict]:
    """`train` with prefetch, and without it with m called twice and b checkpointed."""
    return {"prefetch": train(rank, world, strategy, prefetch=True),
            "twice+ckpt": train(rank, world, strategy, prefetch=False, twice=True, ckpt=True)}


def micro_batches(rank: int, world: int, strategy: str) -> dict[str, float]:
    """Per step: a grad-enabled metric forward with no backward (its check is settled at
    the next forward), two no_sync micro-batches whose use of m differs by rank and micro-
    batch, then one synced micro-batch; the gradients are those of the three micro-batches'
    mean loss, against the reference; the parameters after the last step."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    _shard(model, strategy, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = {"grad": 0.0, "params": 0.0, "none": 0.0}
    for step in range(3):
        x, y = _batch(step, world)
        model(x[:PER_RANK], uses(step + 1, world)[rank])  # a metric forward, no backward
        for mb in range(3):
            use = uses(step + mb, world)
            mine = range(rank, rank + 1)
            if mb < 2:
                with sw.no_sync(model):
                    (_loss(model, x, y, use, mine) / 3).backward()
            else:
                (_loss(model, x, y, use, mine) / 3).backward()
            (_loss(ref, x, y, use, range(world)) / 3).backward()
        g, none = grad_report(model, ref)
        worst["grad"] = max(worst["grad"], g)
        worst["none"] = max(worst["none"], float(len(none)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    worst["params"] = max((full[n] - p.detach()).abs().max().item()
                          for n, p in ref.named_parameters())
    return worst


def freeze_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 alone freezes b's weight at step 1: the freeze check, now waited for where
    the schedule first needs the hooked agreement, still raises on every rank with its
    account; the job goes on (reset_iter_state, unfreeze) with the ranks in step."""
    messages: list[str | None] = []

    def between(step: int, model: nn.Module) -> None:
        if rank == 1 and step in (1, 2):
            model.b[0].weight.requires_grad_(step == 2)

    torch.manual_seed(0)
    model = Net()
    _shard(model, "FULL_SHARD", True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        between(step, model)
        x, y = _batch(step, world)
        try:
            _loss(model, x, y, uses(step, world), range(rank, rank + 1)).backward()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
            model.reset_iter_state()
        opt.step()
        opt.zero_grad()
    sums = C.all_gather_floats([float(sum(t.double().sum().item()
                                          for t in sw.full_state_dict(model).values()))])
    return {"messages": messages, "same": len({s[0] for s in sums}) == 1,
            "finite": all(math.isfinite(s[0]) for s in sums)}
