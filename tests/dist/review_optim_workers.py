"""Silent wrong numbers around the optimizer fast path ([Note: optimizer fast path]).

Each worker trains a sharded model and an unsharded single-process copy with the same torch
optimizer and the same code around `step()`, and asserts the parameters agree to 1e-6.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw

TOL = 1e-6
BATCH = 12


class RootParams(nn.Module):
    """Two sharded blocks plus parameters held by the root unit (gathered after forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 7)
        self.lin2 = nn.Linear(7, 2)
        self.scale = nn.Parameter(torch.randn(3, 5) * 0.5 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x * self.scale.sum(0))))


def _make() -> nn.Module:
    torch.manual_seed(0)
    return RootParams()


def _shard(m: nn.Module) -> nn.Module:
    sw.fully_shard(m.lin1)
    sw.fully_shard(m.lin2)
    sw.fully_shard(m)
    return m


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)


def _backward(m: nn.Module, step: int, rank: int | None = None, world: int = 1) -> None:
    x, y = _batch(step)
    if rank is not None:
        n = BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    nn.functional.mse_loss(m(x), y).backward()


def _diffs(model: nn.Module, ref: nn.Module) -> dict[str, float]:
    full = sw.full_state_dict(model)
    return {n: (full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()}


def _step_both(opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer) -> None:
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def _check(model: nn.Module, ref: nn.Module, what: str) -> None:
    bad = {n: d for n, d in _diffs(model, ref).items() if d > TOL}
    assert not bad, f"{what}: parameters differ from the unsharded run: {bad}"


def fused_step_after_forward_without_backward(rank: int, world: int, name: str,
                                              fused: bool = True) -> None:
    """A grad-enabled forward that no backward follows (a metric) between backward and
    step: the root unit stays gathered, and the next forward must regather the stepped
    shards. A fused step does not bump the shards' version counter, so the engine misses
    the change and the next forward computes with the previous step's parameters."""
    model = _make()
    ref = copy.deepcopy(model)
    model = _shard(model)
    cls = getattr(torch.optim, name)
    kw = {"lr": 0.05 if name != "SGD" else 0.5, "fused": fused}
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    for step in range(4):
        _backward(model, step, rank, world)
        _backward(ref, step)
        x, _ = _batch(50 + step)
        model(x)  # e.g. a training-accuracy metric, computed without torch.no_grad()
        ref(x)
        _step_both(opt, ref_opt)
    _check(model, ref, f"{name}(fused={fused})")


def step_pre_hook_sees_dtensor_parameters(rank: int, world: int, kind: str,
                                          cls: type = torch.optim.SGD) -> None:
    """A per-optimizer step pre-hook (opt.register_step_pre_hook) must see what it sees
    without the fast path: the DTensor parameters and their gradients. torch runs global
    pre-hooks (the fast path's swap) before per-optimizer ones, so the hook sees plain local
    rows: a norm over `param_groups` is this rank's, not the global one ("clip"), and a
    gradient assigned to the module's parameter is not the one the step uses ("reassign")."""
    model = _make()
    ref = copy.deepcopy(model)
    model = _shard(model)
    opt = cls(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for o, m in ((opt, model), (ref_opt, ref)):
        if kind == "clip":
            def hook(o_: torch.optim.Optimizer, args: object, kwargs: object) -> None:
                ps = [p for g in o_.param_groups for p in g["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(ps, 0.05, foreach=False)
        else:
            def hook(o_: torch.optim.Optimizer, args: object, kwargs: object,
                     m: nn.Module = m) -> None:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad = p.grad * 0.1
        o.register_step_pre_hook(hook)
    for step in range(3):
        _backward(model, step, rank, world)
        _backward(ref, step)
        _step_both(opt, ref_opt)
    _check(model, ref, f"step pre-hook ({kind})")
