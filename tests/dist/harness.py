"""Parity of a sharded model against an unsharded single-process reference, for any model.

Each rank feeds its slice of a global batch; the reference sees the whole batch. Both clip
and step AdamW (weight decay on, so a wrongly present zero gradient moves a parameter).
Compared: the mean loss every step, the clipped norm every step, and the full parameters
after the last step (with `grads=True` also every full gradient, and which are None, every
step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.engine.comm import collectives as C

Batch = tuple[torch.Tensor, ...]


def mean_over_ranks(x: torch.Tensor) -> float:
    t = x.detach().double().clone().reshape(1)
    C.all_reduce(t, None)
    return t.item() / C.world_size()


def compare_params(model: nn.Module, ref: nn.Module, tol: float, what: str) -> float:
    full = sw.full_state_dict(model)
    worst = 0.0
    for name, p in ref.named_parameters():
        diff = (full[name].float() - p.detach().float()).abs().max().item()
        worst = max(worst, diff)
        assert diff <= tol, f"{what}: {name} differs by {diff:.3g} (tol {tol})"
    return worst


def compare_grads(model: nn.Module, ref: nn.Module, tol: float, what: str) -> float:
    """Every full gradient (a collective per sharded one: same order on every rank) against
    the reference's; a gradient None on one side must be None on the other."""
    ref_named = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g, rg = p.grad, ref_named[name].grad
        assert (g is None) == (rg is None), f"{what}: {name} grad {g is None=} {rg is None=}"
        if g is None:
            continue
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        diff = (full.float() - rg.float()).abs().max().item()
        worst = max(worst, diff)
        assert diff <= tol, f"{what}: grad of {name} differs by {diff:.3g} (tol {tol})"
    return worst


def run_parity(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    batch: Callable[[int, int], Batch],
    loss: Callable[[nn.Module, Batch], torch.Tensor],
    *,
    steps: int = 3,
    per_rank: int = 2,
    tol: float = 1e-5,
    clip: float | None = 1.0,
    what: str = "",
    between_steps: Callable[[int, nn.Module, nn.Module], None] | None = None,
    grads: bool = False,
) -> dict[str, float]:
    """Train both for `steps` steps; assert parity; return the worst differences."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    # eps 1e-4, not 1e-8: attention's key bias has a gradient that is zero up to rounding
    # noise (~1e-10), and Adam turns noise into a full lr-sized step of either sign.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    worst_loss = worst_norm = worst_grad = 0.0
    for step in range(steps):
        if between_steps is not None:
            between_steps(step, model, ref)
        full = batch(step, per_rank * world)
        mine = tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in full)
        out = loss(model, mine)
        out.backward()
        ref_out = loss(ref, full)
        ref_out.backward()
        got = mean_over_ranks(out)
        worst_loss = max(worst_loss, abs(got - ref_out.item()))
        assert abs(got - ref_out.item()) <= tol * max(1.0, abs(ref_out.item())), (
            f"{what} step {step}: loss {got} vs reference {ref_out.item()}")
        if grads:
            worst_grad = max(worst_grad, compare_grads(model, ref, tol, f"{what} step {step}"))
        if clip is not None:
            norm = sw.clip_grad_norm_(model, clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            d = abs(norm.item() - ref_norm.item())
            worst_norm = max(worst_norm, d)
            assert d <= tol * max(1.0, ref_norm.item()), (
                f"{what} step {step}: grad norm {norm.item()} vs reference {ref_norm.item()}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    worst = compare_params(model, ref, tol, what)
    out = {"loss": worst_loss, "norm": worst_norm, "params": worst}
    if grads:
        out["grads"] = worst_grad
    return out
