"""Gradient clipping by the global norm over sharded gradients."""

from __future__ import annotations

import math

import torch
from torch import nn

from .checks import check_bool, check_module, check_number
from .comm import collectives as C
from .inspect import units_of


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of a sharded model in place; return the total (unclipped) norm.

    The norm is over the whole model, each parameter counted once: shards are reduced
    across the shard group (they are disjoint), never across replicas (they are copies).
    Every rank returns the same value. Parameters that no unit owns (ignored parameters)
    are the same on every rank and are counted locally.
    """
    check_module("model", model)
    # inf is a real use: the trainer asks for the norm only, with no clipping.
    check_number("max_norm", max_norm, positive=True, finite=False)
    if isinstance(norm_type, str) and norm_type in ("inf", "fro"):  # torch accepts these
        norm_type = {"inf": math.inf, "fro": 2.0}[norm_type]
    norm_type = check_number("norm_type", norm_type, positive=True, finite=False)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    units = units_of(model)
    sharded_ids = {id(p.sharded) for u in units for p in u.params}
    local_grads = [p.grad for p in model.parameters()
                   if id(p) not in sharded_ids and p.grad is not None]
    device = units[0].mesh.device if units else torch.device("cpu")
    op = "max" if norm_type == math.inf else "sum"

    def partial(grads: list[torch.Tensor]) -> torch.Tensor:
        # An empty shard (fewer rows than ranks) adds nothing, and has no inf norm at all.
        norms = [g.detach().float().norm(norm_type).to(device) for g in grads if g.numel()]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=device)
        stacked = torch.stack(norms)
        return stacked.max() if norm_type == math.inf else stacked.pow(norm_type).sum()

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if norm_type == math.inf else a + b

    # Each unit's shards are reduced over its own shard group: units may sit on different
    # meshes (a replicated block beside a sharded root), and one group for all counted a
    # replicated gradient once per rank or left a sharded one unreduced. Groups in model
    # order, the same on every rank. Under TP, pieces that differ across TP ranks add up
    # across tp as well ([Note: FSDP x TP]); those replicated across tp (norms, a tied
    # embedding) are counted once.
    by_group: dict[int, tuple[object, list, list, list]] = {}
    seen: set[int] = set()  # a parameter listed by two units (a list-form unit) counts once
    for u in units:
        key = id(u.mesh.shard_group) if u.mesh.shard_size > 1 else 0
        entry = by_group.setdefault(key, (u.mesh, [], [], []))
        for p in u.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = p.shard_grad
            if g is None:
                continue
            split = p.tp is not None and p.tp.tp_sharded
            (entry[2] if split else entry[1]).append(g)
            if split:
                entry[3].append(p)
    total = torch.zeros((), dtype=torch.float32, device=device)
    grads_seen: list[torch.Tensor] = []
    for mesh, plain, tp_grads, tp_params in by_group.values():
        part = partial(plain)
        if tp_params:
            tp_part = partial(tp_grads)
            C.all_reduce(tp_part, tp_params[0].tp.ctx.tp_mesh.get_group(), op=op,
                         label="clip_grad_norm_ tp")
            part = combine(part, tp_part)
        if mesh.shard_size > 1:  # type: ignore[attr-defined]
            C.all_reduce(part, mesh.shard_group, op=op,  # type: ignore[attr-defined]
                         label="clip_grad_norm_")
        total = combine(total, part)
        grads_seen += plain + tp_grads
    total = combine(total, partial(local_grads))
    if norm_type != math.inf:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm {total.item()} is not finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads_seen + local_grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total
