"""Review leftovers: a model sharded over a subgroup, beside ranks that do something else.

The engine's own agreements (the layout check at the first forward, the freeze check at
every grad-enabled forward, the decision to regather stale parameters) ran over the world:
with a model on ranks {0, 1} of 3, the check waited for rank 2, or met rank 2's check of
its own model ("ranks disagree on the sharded model"). They now run over the model's ranks
([Note: model group] in engine/core/policies.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import shardwise as sw
from shardwise.engine.comm import collectives as C
from shardwise.engine.core.context import context_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 2
TOL = 1e-5


def _train_other(model: nn.Module, steps: int) -> float:
    """What a rank outside the subgroup does meanwhile: train its own model alone."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = make_batch("mlp", 50 + step, 4)
        out = loss_fn("mlp", model(x), y)
        out.backward()
        opt.step()
        opt.zero_grad()
    return float(out.item())


def subgroup_trains(rank: int, world: int, hybrid: bool) -> dict:
    """A TinyLM sharded on the first ranks (FULL_SHARD, then SHARD_GRAD_OP) trains 3 AdamW
    steps against an unsharded reference on the global batch, with a grad-enabled metric
    forward before each step (the root stays gathered: the next forward regathers it after
    the step, decided over the model's ranks only). Ranks {0, 1} on a 1-D mesh, or with
    `hybrid` ranks {0..3} on a 2 x 2 (replicate, shard) mesh, whose two dims the checks
    reduce over in turn. The other ranks train their own model on their own mesh meanwhile,
    and never join the model's collectives."""
    n = 4 if hybrid else 2
    ranks = torch.arange(n).view(2, 2) if hybrid else torch.arange(n)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("rep", "shard") if hybrid else None)
    others = [DeviceMesh("cpu", [r]) for r in range(n, world)]  # every rank makes every mesh
    if rank >= n:
        model = sw.shard_model(make_model("mlp", rank), auto_wrap_policy=None,
                               mesh=others[rank - n])
        return {"other": _train_other(model, 4), "groups": len(context_of(model).groups)}
    strategies = ("HYBRID_SHARD",) if hybrid else ("FULL_SHARD", "SHARD_GRAD_OP")
    return {s: _parity(rank, n, s, mesh) for s in strategies}


def _parity(rank: int, n: int, strategy: str, mesh: DeviceMesh) -> dict:
    model = make_model("lm", 0)
    ref = copy.deepcopy(model)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                   mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    worst = {"loss": 0.0, "params": 0.0}
    for step in range(3):
        x, y = make_batch("lm", step, n * PER_RANK)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        out = loss_fn("lm", model(x[mine]), y[mine])
        out.backward()
        with torch.no_grad():  # this rank's loss, computed by the reference
            worst["loss"] = max(worst["loss"], abs(
                out.item() - loss_fn("lm", ref(x[mine]), y[mine]).item()))
        loss_fn("lm", ref(x), y).backward()
        model(x[mine])  # a metric forward: the root keeps its parameters gathered
        sw.clip_grad_norm_(model, 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    got_sd = sw.full_state_dict(model)
    for name, p in ref.named_parameters():
        worst["params"] = max(worst["params"], (got_sd[name] - p.detach()).abs().max().item())
    ctx = context_of(model)
    return {**worst, "groups": [C.group_ranks(g) for g in ctx.groups]}


# --- a unit whose output needs a gradient on some ranks only (docs/moe.md) ---------------

D, OUT = 5, 3


class Maybe(nn.Module):
    """A unit whose parameters only some ranks' data uses: elsewhere its output is its
    input, which needs no gradient, so no pre-backward hook is put on it there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return torch.tanh(self.lin(x)) if use else x


class Skippy(nn.Module):
    """a1 -> a2 (Maybe units) -> [f: frozen, needs a gradient only behind a used a2] -> b."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.a1, self.a2 = Maybe(), Maybe()
        self.f = nn.Linear(D, D).requires_grad_(False) if frozen else None
        self.b = nn.Linear(D, D)
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.a2(self.a1(x, use), use)
        if self.f is not None:
            h = self.f(h)
        return self.head(torch.tanh(self.b(h)))


def _skippy_batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(400 + step)
    use = (torch.arange(n) // PER_RANK + step) % 2  # which ranks use a1/a2 alternates
    return torch.randn(n, D, generator=g), torch.randn(n, OUT, generator=g), use


def _skippy_loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, use = b
    losses = [((m(x[i:i + PER_RANK], bool(use[i])) - y[i:i + PER_RANK]) ** 2).mean()
              for i in range(0, len(x), PER_RANK)]
    return torch.stack(losses).mean()


def output_grad_on_some_ranks(rank: int, world: int, frozen: bool) -> str:
    """FULL_SHARD without prefetch (every backward gather is the unit's own): the ranks'
    backward collectives differ (data-dependent control flow, not followed, as in FSDP2).
    Returns the error this rank got, under SHARDWISE_DEBUG (set by the test)."""
    torch.manual_seed(0)
    m = Skippy(frozen)
    # Each unit alone: coalesced, these small units would share their backward all-gather
    # and reduce-scatter, which are then the same on both ranks ([Note: coalesced units]).
    for u in (m.a1, m.a2, m.f, m.b):
        if u is not None:
            sw.fully_shard(u, coalesce_bytes=0)
    sw.fully_shard(m, coalesce_bytes=0).set_prefetch(False)
    x, y, use = _skippy_batch(0, world * PER_RANK)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    try:
        _skippy_loss(m, (x[mine], y[mine], use[mine])).backward()
    except Exception as e:  # noqa: BLE001 - the test reads which error each rank got
        return f"{type(e).__name__}: {e}"
    return ""
