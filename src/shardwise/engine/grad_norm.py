"""Gradient clipping by the global norm over sharded gradients."""

from __future__ import annotations

import math

import torch
from torch import nn

from .checks import check_bool, check_module, check_number
from .comm import collectives as C
from .inspect import sharded_params, units_of


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
    sps = sharded_params(model)
    units = units_of(model)
    sharded_ids = {id(p.sharded) for p in sps}
    # Plain local rows of the DTensor gradients: the reduction is ours, below. Under TP,
    # pieces that differ across TP ranks add up across tp as well ([Note: FSDP x TP]);
    # those replicated across tp (norms, a tied embedding) are counted once.
    tp_split = [p for p in sps if p.tp is not None and p.tp.tp_sharded]
    split_ids = {id(p) for p in tp_split}
    tp_grads = [g for g in (p.shard_grad for p in tp_split) if g is not None]
    shard_grads = [g for g in (p.shard_grad for p in sps if id(p) not in split_ids)
                   if g is not None]
    local_grads = [p.grad for p in model.parameters()
                   if id(p) not in sharded_ids and p.grad is not None]
    device = units[0].mesh.device if units else torch.device("cpu")

    def partial(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack([g.detach().float().norm(norm_type).to(device) for g in grads])
        return norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()

    total = partial(shard_grads)
    if tp_split:
        tp_part = partial(tp_grads)
        C.all_reduce(tp_part, tp_split[0].tp.ctx.tp_mesh.get_group(),  # type: ignore[union-attr]
                     op="max" if norm_type == math.inf else "sum", label="clip_grad_norm_ tp")
        total = torch.maximum(total, tp_part) if norm_type == math.inf else total + tp_part
    if units and units[0].mesh.shard_size > 1:
        C.all_reduce(total, units[0].mesh.shard_group,
                     op="max" if norm_type == math.inf else "sum", label="clip_grad_norm_")
    extra = partial(local_grads)
    if norm_type == math.inf:
        total = torch.maximum(total, extra)
    else:
        total = (total + extra).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm {total.item()} is not finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in shard_grads + tp_grads + local_grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total
