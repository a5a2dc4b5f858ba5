"""`fully_shard` (FSDP2-style, composable) and `shard_model` (one call, four knobs).

Each checks its arguments (fully_shard_checks.py), then builds its units (build_unit.py);
the class a sharded module becomes is sharded_module.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard as _fsdp2_fully_shard

from ..core.checks import check_module, check_params, check_shard_placement
from ..core.hpz import check_hpz
from ..core.hpz import enable as enable_hpz
from ..core.inspect import units_of
from ..core.mesh import mesh_for_strategy, mesh_info_for
from ..core.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    WrapPolicyLike,
    resolve_wrap_policy,
)
from ..core.spmd import context_for_dims
from ..core.tp import context_for
from .build_unit import build_unit, mark_ignored
from .fully_shard_checks import check_modules, check_options
from .module_api import check_reshard_after_forward
from .sharded_module import own_unit
from .state import state_of
from .wrap import assign_params, wrap_targets


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: object | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: CPUOffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    dp_mesh_dims: object | None = None,
) -> Any:
    """Shard `module`'s parameters (those not owned by already-sharded children) as one unit.

    Call it on the blocks first and on the root last. The module keeps its class, becomes a
    `torch.distributed.fsdp.FSDPModule` and gains FSDP2's module methods (module_api.py).
    A list of modules makes one unit over all of them (FSDP2's `fully_shard([norm, head])`),
    and the list is returned. `reshard_after_forward`: None (FSDP2's default) reshards after
    forward except on the root; True/False apply to the root too. `mp_policy` and
    `offload_policy` also take torch.distributed.fsdp's own policy objects.
    `shard_placement_fn` may return `Shard(dim)` (any dim) or None for each parameter; None
    takes the default dim ([Note: balanced shards] in core/layout.py). `dp_mesh_dims`
    (torch's DataParallelMeshDims): `mesh` is the full SPMD mesh the DTensor parameters
    live on, and these are its data-parallel dims ([Note: dp_mesh_dims] in core/spmd.py).
    """
    modules = check_modules(module)
    mp, offload, ignored = check_options(modules, reshard_after_forward, mp_policy,
                                         offload_policy, ignored_params)
    placements: dict[int, int] = {}
    for m in modules:
        placements.update(check_shard_placement(m, shard_placement_fn, ignored))
    # A tensor-parallel model ([Note: FSDP x TP]): checked before mesh_info_for's groups.
    if dp_mesh_dims is not None:
        tp = context_for_dims(modules, mesh, dp_mesh_dims, reshard_after_forward,
                              {id(p) for p in ignored})
        mesh = tp.dp_mesh
    else:
        tp = context_for(modules[0], mesh)
    info = mesh_info_for(mesh)
    raf = check_reshard_after_forward(reshard_after_forward, info.shard_size)
    hpz = raf if type(raf) is int else None  # [Note: hpZ] in core/hpz.py
    if hpz is not None:
        check_hpz(hpz, info, tp, type(modules[0]).__name__)
    build_unit(modules, info, True if raf is None else bool(raf), mp, offload,
               mark_ignored(ignored), None, tp, auto=raf is None, placements=placements)
    if hpz is not None:
        enable_hpz(own_unit(modules[0]), hpz)  # type: ignore[arg-type]
    return module


def _state(module: nn.Module) -> Any:
    """`fully_shard.state(module)`, as in FSDP2 (engine/state.py): the state of the
    `fully_shard` call made on `module` itself, None for a module that was not given to it
    (an unsharded CheckpointWrapper around a sharded layer, too). A module FSDP2 sharded
    answers with FSDP2's state: while `patch_fsdp2()` is on, FSDP2's own `fully_shard` finds
    its state through this name (fsdp2_patch.py)."""
    if own_unit(module) is None:
        return _fsdp2_fully_shard.state(module)  # type: ignore[attr-defined]
    return state_of(module)


fully_shard.state = _state  # type: ignore[attr-defined]


def shard_model(
    model: nn.Module,
    *,
    sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
    auto_wrap_policy: WrapPolicyLike = "transformer",
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    cpu_offload: bool | CPUOffloadPolicy = False,
    mesh: object | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard `model` with the four FSDP knobs: units from the wrap policy, then the root."""
    check_module("model", model)
    ignored = mark_ignored(check_params("ignored_params", ignored_params))
    strategy = ShardingStrategy.parse(sharding_strategy)
    mp = MixedPrecisionPolicy.parse(mixed_precision)
    offload = CPUOffloadPolicy.parse(cpu_offload)
    policy = resolve_wrap_policy(auto_wrap_policy, model)
    targets = wrap_targets(model, policy)
    # TP ([Note: FSDP x TP]): the dp mesh is checked before any group is made.
    tp = context_for(model, mesh)
    if tp is not None and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError("sharding_strategy=NO_SHARD with tensor-parallel parameters is not "
                         "supported: use FULL_SHARD or SHARD_GRAD_OP with mesh=mesh['dp']")
    info = mesh_info_for(mesh_for_strategy(strategy, mesh))
    reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    # Ownership for the whole model at once, by the rule the planner uses (wrap.py): no
    # unit takes a tied parameter that a parent would then have to re-home.
    owned = {spec.name: set(spec.ids) for spec in assign_params(model, targets, ignored)}
    for name, m in [*targets, ("", model)]:
        if own_unit(m) is not None:
            raise ValueError(f"{name or type(m).__name__!r} is already sharded")
        build_unit(m, info, reshard, mp, offload, ignored, owned[name], tp)
    return model


def reshard_between_steps(model: nn.Module, what: str) -> None:
    """Reshard every unit so that writing the shards takes effect on the next forward.

    After a forward with grad enabled and no backward, the root keeps its full parameters
    registered; writing only the shards would leave the next forward computing with the
    old full copies. Inside a backward nothing may be resharded: that is refused.
    """
    for u in units_of(model):
        ctx = u.ctx
        if ctx is not None and ctx.in_backward:
            raise RuntimeError(f"{what} cannot run inside backward (unit {u.label!r} is in "
                               "use); call it between steps")
        u.reshard()

