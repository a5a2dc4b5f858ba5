"""Gradient clipping by the global norm over sharded gradients."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import collectives as C
from ..core.context import ModelGroup, sharded_params, units_of
from ..core.policies import check_bool, check_module, check_number


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of a sharded model in place; return the total (unclipped) norm.

    The norm is over the whole model, each parameter counted once: shards are reduced
    across the shard group (they are disjoint), never across replicas (they are copies).
    Every rank returns the same value, and clips with the same coefficient.
    Only the units' own groups take part, never the world: on a model sharded on a
    subgroup, call it on the model's ranks.

    [Note: ignored gradients] Parameters that no unit owns (`ignored_params`, or modules
    left unsharded) are replicated, and nothing reduces their gradients: each rank holds
    its own. The total is the largest, over the model's ranks, of the norm of the gradient
    that rank holds (the shared sharded gradients plus its own ignored ones): the
    unsharded model's norm when the ignored gradients agree across ranks (the user reduced
    them, or they are frozen), and otherwise a bound under which every rank's clipped
    gradient is within `max_norm`. It costs one scalar all-reduce (MAX) over the model's
    ranks, only on models with ignored parameters that require gradients. (FSDP2 has no
    answer to copy: torch.nn.utils.clip_grad_norm_ refuses its mix of DTensor and plain
    gradients.)
    """
    check_module("model", model)
    # inf is a real use: the trainer asks for the norm only, with no clipping.
    check_number("max_norm", max_norm, positive=True, finite=False)
    if isinstance(norm_type, str) and norm_type in ("inf", "fro"):  # torch accepts these
        norm_type = {"inf": math.inf, "fro": 2.0}[norm_type]
    norm_type = check_number("norm_type", norm_type, positive=True, finite=False)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    total, groups, local_grads, copies = _total_norm(model, norm_type, None)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm {total.item()} is not finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in [g for e in groups.values() for g in e[1] + e[2]] + copies + local_grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total


def grad_norm_of_parts(model: nn.Module, parts: dict[int, torch.Tensor],
                       norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm, as `clip_grad_norm_` returns it, from each parameter's
    local norm recorded while its gradient existed: `parts[id(param)]` is the `norm_type`
    norm of this rank's gradient of the (sharded or ignored) parameter (a 0-d tensor). For
    an optimizer stepped in backward, which frees each gradient as it lands: the norms are
    combined across ranks exactly as the gradients would be. Nothing is clipped."""
    check_module("model", model)
    return _total_norm(model, norm_type, parts)[0]


def _total_norm(model: nn.Module, norm_type: float, parts: dict[int, torch.Tensor] | None
                ) -> tuple[torch.Tensor, dict[int, list], list[torch.Tensor], list[torch.Tensor]]:
    """(the total norm, the gradients by group, the ignored parameters' gradients, the
    gradients counted on another rank: 0-d copies), from the
    gradients or, given `parts`, from per-parameter local norms (a 0-d tensor's norm is
    itself, so each stands in for its gradient)."""
    units = units_of(model)
    sps = sharded_params(model)
    sharded_ids = {id(p.sharded) for p in sps}
    unowned = [p for p in model.parameters() if id(p) not in sharded_ids]
    if parts is None:
        local_grads = [p.grad for p in unowned if p.grad is not None]
    else:
        local_grads = [parts[id(p)] for p in unowned if id(p) in parts]
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

    # Each parameter's shard is reduced over its own unit's shard group: units may sit on
    # different meshes (a replicated block beside a sharded root), and one group for all
    # counted a replicated gradient once per rank or left a sharded one unreduced. Groups in
    # model order, made whether or not a gradient exists, the same on every rank. Under TP,
    # pieces that differ across TP ranks add up across tp as well ([Note: FSDP x TP]);
    # those replicated across tp (norms, a tied embedding) are counted once.
    # A 0-d parameter's gradient is held whole by every rank of its shard group: counted on
    # shard rank 0 only, clipped everywhere ([Note: 0-d parameters] in sharded_param.py).
    groups: dict[int, list] = {}  # -> [mesh, plain grads, tp-split grads, tp group]
    copies: list[torch.Tensor] = []
    for p in sps:
        mesh = (p.owner or units[0]).mesh
        entry = groups.setdefault(id(mesh.shard_group) if mesh.shard_size > 1 else 0,
                                  [mesh, [], [], None])
        split = p.tp is not None and p.tp.tp_sharded
        if split:
            entry[3] = p.tp.ctx.tp_mesh.get_group()  # type: ignore[union-attr]
        g = (p.shard_grad if parts is None else parts.get(id(p.sharded)))
        if g is not None:
            (entry[2 if split else 1] if p.owns_rows else copies).append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for mesh, plain, tp_grads, tp_group in groups.values():
        part = partial(plain)
        if tp_group is not None:
            tp_part = partial(tp_grads)
            C.all_reduce(tp_part, tp_group, op=op, label="clip_grad_norm_ tp")
            part = combine(part, tp_part)
        if mesh.shard_size > 1:
            C.all_reduce(part, mesh.shard_group, op=op, label="clip_grad_norm_")
        total = combine(total, part)
    mine = partial(local_grads)
    # Decided by structure (requires_grad), not by who holds a gradient, so that every
    # rank issues it ([Note: ignored gradients]).
    if units and any(p.requires_grad for p in unowned):
        ModelGroup.of_units(units).max_(mine, label="clip_grad_norm_ ignored")
    total = combine(total, mine)
    if norm_type != math.inf:
        total = total.pow(1.0 / norm_type)
    return total, groups, local_grads, copies
