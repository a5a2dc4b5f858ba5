"""`fully_shard` (FSDP2-style, composable) and `shard_model` (one call, four knobs).

Each checks its arguments (fully_shard.py), then builds its units (fully_shard.py);
the class a sharded module becomes is sharded_module.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as _fsdp2_fully_shard

from ..core import dtensor as DT
from ..core.context import ModelContext, units_of
from ..core.dtensor import TPContext, context_for, context_for_dims
from ..core.hooks import forward_post_hook, forward_pre_hook
from ..core.layout import shard_dim_for
from ..core.policies import (
    DEFAULT_COALESCE_BYTES,
    CPUOffloadPolicy,
    MeshInfo,
    MixedPrecisionPolicy,
    ShardingStrategy,
    WrapPolicy,
    WrapPolicyLike,
    check_coalesce_bytes,
    check_fsdp1_ignored_classes,
    check_module,
    check_params,
    check_shard_placement,
    fsdp1_buffer_dtype,
    mesh_for_strategy,
    mesh_info_for,
    resolve_wrap_policy,
)
from ..core.schedule import ShardedState
from ..core.sharded_param import ParamRef, ShardedParam, is_subclass
from ..core.unit import BufferPool, Unit, check_hpz
from ..core.unit import enable as enable_hpz
from .sharded_module import check_reshard_after_forward, own_unit, sharded_class, watch_optimizers
from .state import install_state_dict_hooks, register_torch_state, state_of

# --------------------------------------------------------------------------------------------------
# Which modules become units, and which parameters each unit owns.
#
# Shared by `shard_model` (to shard) and the planner (to predict without allocating), so the
# two can never disagree about units or padding.
#
# Ownership rule: a parameter belongs to the deepest unit whose subtree contains every module
# that refers to it. So a tied embedding used by the first and last layers lands in their
# common ancestor (usually the root), and a unit never reads a parameter it does not own.

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def wrap_targets(model: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """Modules the policy selects, children before parents, the root excluded."""
    if policy is None:
        return []
    out: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()  # ids of parameters owned by a selected descendant
    min_params = getattr(policy, "min_num_params", None)

    def visit(name: str, m: nn.Module, seen: set[int]) -> None:
        for child_name, child in m.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            visit(f"{name}.{child_name}" if name else child_name, child, seen)
        if m is model or isinstance(m, _CONTAINERS):
            return  # containers never run forward, so their hooks would never fire
        if min_params is not None:
            unclaimed = [p for p in m.parameters() if id(p) not in claimed]
            selected = policy(m, sum(p.numel() for p in unclaimed))  # type: ignore[call-arg]
        else:
            selected = bool(policy(m))
        if selected:
            out.append((name, m))
            claimed.update(id(p) for p in m.parameters())

    visit("", model, {id(model)})
    return out


@dataclass(frozen=True)
class ParamSpec:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class UnitSpec:
    """A unit as the planner sees it: its module's FQN ("" = root) and its parameters."""

    name: str
    params: tuple[ParamSpec, ...]
    # id() of each parameter object, in `params` order: what shard_model shards per unit.
    ids: tuple[int, ...] = field(default=(), compare=False, repr=False)


def assign_params(
    model: nn.Module, targets: list[tuple[str, nn.Module]], ignored: set[int] | None = None
) -> list[UnitSpec]:
    """Apply the ownership rule to `targets` + the root, without touching any tensor."""
    ignored = ignored or set()
    unit_names = [name for name, _ in targets] + [""]
    unit_ids = {id(m): name for name, m in targets}
    unit_ids[id(model)] = ""

    # The unit that immediately contains each module, and each unit's parent unit.
    owner_of: dict[int, str] = {}
    parent: dict[str, str | None] = {"": None}

    def visit(m: nn.Module, current: str) -> None:
        for child in m.children():
            if id(child) in owner_of:
                continue
            if id(child) in unit_ids:
                parent[unit_ids[id(child)]] = current
                owner_of[id(child)] = unit_ids[id(child)]
                visit(child, unit_ids[id(child)])
            else:
                owner_of[id(child)] = current
                visit(child, current)

    owner_of[id(model)] = ""
    visit(model, "")

    def ancestors(u: str) -> list[str]:
        chain = [u]
        while parent.get(chain[-1]) is not None:
            chain.append(parent[chain[-1]])  # type: ignore[arg-type]
        return chain

    refs: dict[int, tuple[nn.Parameter, str, set[str]]] = {}
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            entry = refs.setdefault(id(p), (p, fqn, set()))
            entry[2].add(owner_of[id(m)])

    owned: dict[str, list[tuple[ParamSpec, int]]] = {name: [] for name in unit_names}
    for p, fqn, users in refs.values():
        chains = [ancestors(u) for u in users]
        common = [u for u in chains[0] if all(u in c for c in chains[1:])]
        spec = ParamSpec(fqn, tuple(p.shape), p.dtype, p.requires_grad)
        owned[common[0]].append((spec, id(p)))
    return [UnitSpec(name, tuple(s for s, _ in owned[name]), tuple(i for _, i in owned[name]))
            for name in unit_names]


# --------------------------------------------------------------------------------------------------
# fully_shard's argument checks: the modules it is given, its policies, and each parameter
# it is to shard (plain, a TP DTensor, or a tensor subclass with FSDP2's all-gather hooks).
# Each raises naming the offending value (docs/errors.md).


def check_modules(module: object) -> list[nn.Module]:
    """What fully_shard was given, as a list of modules none of which is sharded yet."""
    if isinstance(module, (list, tuple)):
        if not module:
            raise ValueError("fully_shard got an empty list of modules")
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard got a list with the same module twice")
        modules = list(module)
    else:
        modules = [module]  # type: ignore[list-item]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard needs an nn.Module, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard got a {type(m).__name__}, which has no forward of its own, so "
                "its hooks would never run; shard each of its modules instead"
            )
        if own_unit(m) is not None:
            raise ValueError(f"{type(m).__name__} is already sharded")
    return modules


def check_options(modules: list[nn.Module], reshard_after_forward: object, mp_policy: object,
                  offload_policy: object, ignored_params: Iterable[nn.Parameter] | None
                  ) -> tuple[MixedPrecisionPolicy | None, CPUOffloadPolicy | None,
                             list[nn.Parameter]]:
    """fully_shard's policies as shardwise's own (torch's accepted), and the ignored
    parameters as a list."""
    check_reshard_after_forward(reshard_after_forward)
    mp = MixedPrecisionPolicy.from_torch(mp_policy)
    offload = CPUOffloadPolicy.from_torch(offload_policy)
    if mp is not None and not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy={mp!r} must be sw.MixedPrecisionPolicy, torch's "
                         "MixedPrecisionPolicy or None")
    if offload is not None and not isinstance(offload, CPUOffloadPolicy):
        raise ValueError(f"offload_policy={offload!r} must be sw.CPUOffloadPolicy, "
                         "torch's CPUOffloadPolicy / OffloadPolicy or None")
    return mp, offload, check_params("ignored_params", ignored_params)


def check_plain_param(ref: ParamRef, t: torch.Tensor, tp: TPContext | None) -> None:
    """A parameter not sharded yet that shardwise can shard: plain, a TP DTensor (with `tp`),
    or a tensor subclass with both of FSDP2's all-gather hooks."""
    if DT.is_dtensor(t) and tp is None:
        raise ValueError(
            f"{ref.fqn} is already a DTensor ({t.placements} on "  # type: ignore[attr-defined]
            f"{t.device_mesh}); shardwise shards plain parameters and TP "  # type: ignore[attr-defined]
            "DTensors from parallelize_module (see docs/parallelism.md)")
    if DT.is_dtensor(t):
        if DT.uses_all_gather_extension(t) or is_subclass(DT.local_of(t)):
            raise NotImplementedError(
                f"{ref.fqn} is a tensor-parallel DTensor over a "
                f"{type(DT.local_of(t)).__name__}: FSDP2's all-gather extensions with tensor "
                "parallelism are not supported; shard it without parallelize_module")
        return
    if not is_subclass(t):
        if DT.uses_all_gather_extension(t):
            # FSDP2 drops them silently (its shard is a new tensor); so would shardwise.
            raise NotImplementedError(
                f"{ref.fqn} carries fsdp_pre_all_gather / fsdp_post_all_gather on the tensor "
                "given to fully_shard, where they do not survive sharding: define them on a "
                "tensor subclass, or patch them onto the shard after sharding "
                f"(model.get_parameter({ref.fqn!r})._local_tensor), as in FSDP2")
        return
    # [Note: all-gather extensions] in engine/core/sharded_param.py.
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    problem = (
        "it does not define FSDP2's all-gather extension (fsdp_pre_all_gather and "
        "fsdp_post_all_gather), so its gather would drop the subclass's own data"
        if not (pre or post) else
        "it defines only one of fsdp_pre_all_gather / fsdp_post_all_gather" if pre != post else
        "it is on the meta device (build extension parameters on a real device)" if t.is_meta
        else "it is 0-d (extension parameters are sharded on dim 0)" if t.dim() == 0
        else "")
    if problem:
        raise NotImplementedError(
            f"{ref.fqn} is a {type(t).__name__} parameter that shardwise cannot shard: "
            f"{problem}")


# --------------------------------------------------------------------------------------------------
# The steps of fully_shard after its checks: collect the parameters a unit owns, re-home
# tied ones from child units, shard the new ones, build the unit and its context, and install
# the hooks that make the module a sharded one.


def build_unit(module: nn.Module | list[nn.Module], info: MeshInfo,
               reshard_after_forward: bool, mp: MixedPrecisionPolicy | None,
               offload: CPUOffloadPolicy | None, ignored: set[int], owned: set[int] | None,
               tp: TPContext | None, auto: bool = True,
               placements: dict[int, int] | None = None,
               coalesce_bytes: int = DEFAULT_COALESCE_BYTES) -> None:
    """The steps of fully_shard after validation. `owned`: ids of the parameters this unit
    owns, when the caller computed ownership for the whole model (shard_model); None: take
    what no sharded child owns and re-home tied parameters shared with siblings."""
    modules = module if isinstance(module, list) else [module]
    new, rehome = _collect_params(modules, ignored, owned, tp)
    params = _rehome(rehome) + _shard_new(new, info, mp, offload, tp, placements or {})
    unit = Unit(modules[0], "", params, info, reshard_after_forward, mp, BufferPool())
    unit.modules = list(modules)
    unit.auto_reshard_after_forward = auto
    unit.offload = offload
    unit.coalesce_bytes = coalesce_bytes
    for sp in params:
        sp.owner = unit
    for m in modules:
        m._sw_unit = unit  # type: ignore[attr-defined]
        register_torch_state(m, unit)
    ModelContext.create(unit)
    for m in modules:
        _install_hooks(m)
    install_state_dict_hooks(params)


def mark_ignored(params: list[nn.Parameter]) -> set[int]:
    # Marked on the tensor too: a parent's fully_shard must skip them without being told.
    for p in params:
        p._sw_ignored = True  # type: ignore[attr-defined]
    return {id(p) for p in params}


_NewParams = dict[int, tuple[nn.Parameter, list[ParamRef]]]
_Rehome = dict[int, tuple[ShardedParam, list[ParamRef]]]


def _collect_params(modules: list[nn.Module], ignored: set[int], owned: set[int] | None,
                    tp: TPContext | None
                    ) -> tuple[_NewParams, _Rehome]:
    """(plain parameters to shard, already-sharded ones to re-home into this unit), each
    with every (module, name) that refers to it under `modules`."""
    subtree = {id(m) for top in modules for m in top.modules()}
    new: _NewParams = {}
    rehome: _Rehome = {}
    owner_trees: dict[int, set[int]] = {}
    named = (modules[0].named_modules() if len(modules) == 1 else
             [(f"{i}.{n}" if n else str(i), m) for i, top in enumerate(modules)
              for n, m in top.named_modules()])
    seen_mods: set[int] = set()
    for mname, m in named:
        if id(m) in seen_mods:
            continue  # a module inside two of the listed ones
        seen_mods.add(id(m))
        for pname, t in m._parameters.items():
            if t is None or id(t) in ignored or getattr(t, "_sw_ignored", False):
                continue
            ref = ParamRef(m, pname, f"{mname}.{pname}" if mname else pname)
            sp: ShardedParam | None = getattr(t, "_sw_param", None) or getattr(
                t, "_sw_orig_of", None)
            if owned is not None:
                if id(t) in owned:
                    check_plain_param(ref, t, tp)
                    new.setdefault(id(t), (t, []))[1].append(ref)
                continue
            if sp is None:
                check_plain_param(ref, t, tp)
                new.setdefault(id(t), (t, []))[1].append(ref)
                continue
            owner = sp.owner
            if owner is None:
                continue
            if id(owner) not in owner_trees:
                owner_trees[id(owner)] = {id(x) for top in owner.modules
                                          for x in top.modules()}
            if id(m) in owner_trees[id(owner)]:
                continue  # inside the owner's own subtree: the owner's business
            if id(owner.module) not in subtree:
                continue  # a sibling's parameter: the common parent will re-home it
            rehome.setdefault(id(sp), (sp, []))[1].append(ref)
    return new, rehome


def _rehome(rehome: _Rehome) -> list[ShardedParam]:
    """Move tied parameters from the child units that shared them into this one."""
    params = []
    for sp, refs in rehome.values():
        owner = sp.owner
        assert owner is not None
        if owner.state is not ShardedState.SHARDED:
            raise RuntimeError(f"cannot re-home {sp.fqn} while its unit is unsharded")
        owner.set_params([q for q in owner.params if q is not sp])
        for r in refs:
            if not any(x.module is r.module and x.name == r.name for x in sp.refs):
                sp.refs.append(r)
            r.module._parameters[r.name] = sp.sharded
        params.append(sp)
    return params


def _shard_new(new: _NewParams, info: MeshInfo, mp: MixedPrecisionPolicy | None,
               offload: CPUOffloadPolicy | None, tp: TPContext | None,
               placements: dict[int, int]) -> list[ShardedParam]:
    if offload is not None and offload.params and info.device.type == "cuda":
        host = torch.device("cpu")
    else:
        host = info.device
    compute_dtype = mp.param_dtype if mp else None
    pin = bool(offload and offload.pin_memory)
    params = []
    for t, refs in new.values():
        dtype = compute_dtype if (compute_dtype and t.is_floating_point()) else None
        sp = ShardedParam(t, refs, info.shard_rank, info.shard_size, info.device, dtype, host,
                          pin_memory=pin, device_mesh=info.device_mesh, tp=tp,
                          shard_dim=shard_dim_for(t, info.shard_size, tp, placements))
        # Later fully_shard calls on a parent find other references to the original here.
        t._sw_orig_of = sp  # type: ignore[attr-defined]
        if not t.is_meta:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)  # free the full copy
        params.append(sp)
    return params


def _install_hooks(module: nn.Module) -> None:
    watch_optimizers()
    module.register_forward_pre_hook(forward_pre_hook, prepend=True, with_kwargs=True)
    module.register_forward_hook(forward_post_hook, with_kwargs=True)
    module.__class__ = sharded_class(type(module))


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
    coalesce_bytes: int | None = None,
) -> Any:
    """Shard `module`'s parameters (those not owned by already-sharded children) as one unit.

    Call it on the blocks first and on the root last. The module keeps its class, becomes a
    `torch.distributed.fsdp.FSDPModule` and gains FSDP2's module methods (sharded_module.py).
    A list of modules makes one unit over all of them (FSDP2's `fully_shard([norm, head])`),
    and the list is returned. `reshard_after_forward`: None (FSDP2's default) reshards after
    forward except on the root; True/False apply to the root too. `mp_policy` and
    `offload_policy` also take torch.distributed.fsdp's own policy objects.
    `shard_placement_fn` may return `Shard(dim)` (any dim) or None for each parameter; None
    takes the default dim ([Note: balanced shards] in core/layout.py). `dp_mesh_dims`
    (torch's DataParallelMeshDims): `mesh` is the full SPMD mesh the DTensor parameters
    live on, and these are its data-parallel dims ([Note: dp_mesh_dims] in core/dtensor.py).
    `coalesce_bytes`: this unit may share one all-gather and one reduce-scatter with its
    neighbours in forward order while their gathered bytes together stay within it (None:
    4 MiB, `DEFAULT_COALESCE_BYTES`; 0: it gathers and reduces alone, as FSDP2 does;
    [Note: coalesced units] in core/schedule.py).
    """
    coalesce = check_coalesce_bytes(coalesce_bytes)
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
    hpz = raf if type(raf) is int else None  # [Note: hpZ] in core/unit.py
    if hpz is not None:
        check_hpz(hpz, info, tp, type(modules[0]).__name__)
    build_unit(modules, info, True if raf is None else bool(raf), mp, offload,
               mark_ignored(ignored), None, tp, auto=raf is None, placements=placements,
               coalesce_bytes=coalesce)
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
    coalesce_bytes: int | None = None,
) -> nn.Module:
    """Shard `model` with the four FSDP knobs: units from the wrap policy, then the root.

    Each knob also takes PyTorch's FSDP1 object with FSDP1's meaning: its ShardingStrategy
    (`_HYBRID_SHARD_ZERO2` included), the policies of `torch.distributed.fsdp.wrap` and
    callables with FSDP1's `(module, recurse, nonwrapped_numel)` signature, MixedPrecision
    (a field shardwise cannot honour is refused by name) and CPUOffload. `coalesce_bytes`:
    fully_shard's, for every unit.
    """
    coalesce = check_coalesce_bytes(coalesce_bytes)
    check_module("model", model)
    ignored = mark_ignored(check_params("ignored_params", ignored_params))
    strategy = ShardingStrategy.parse(sharding_strategy)
    # FSDP1's MixedPrecision casts the root's inputs and the others' by separate fields.
    mp = MixedPrecisionPolicy.parse(mixed_precision)
    root_mp = MixedPrecisionPolicy.parse(mixed_precision, root=True)
    buffer_dtype = fsdp1_buffer_dtype(mixed_precision)
    offload = CPUOffloadPolicy.parse(cpu_offload)
    policy = resolve_wrap_policy(auto_wrap_policy, model, ignored)
    check_fsdp1_ignored_classes(mixed_precision, model, policy)
    targets = wrap_targets(model, policy)
    # TP ([Note: FSDP x TP]): the dp mesh is checked before any group is made.
    tp = context_for(model, mesh)
    if tp is not None and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError("sharding_strategy=NO_SHARD with tensor-parallel parameters is not "
                         "supported: use FULL_SHARD or SHARD_GRAD_OP with mesh=mesh['dp']")
    info = mesh_info_for(mesh_for_strategy(strategy, mesh))
    reshard = ShardingStrategy.reshards_after_forward(sharding_strategy)
    if buffer_dtype is not None:
        _cast_buffers(model, buffer_dtype, ignored)
    # Ownership for the whole model at once, by the rule the planner uses (fully_shard.py): no
    # unit takes a tied parameter that a parent would then have to re-home.
    owned = {spec.name: set(spec.ids) for spec in assign_params(model, targets, ignored)}
    for name, m in [*targets, ("", model)]:
        if own_unit(m) is not None:
            raise ValueError(f"{name or type(m).__name__!r} is already sharded")
        build_unit(m, info, reshard, root_mp if m is model else mp, offload, ignored,
                   owned[name], tp, coalesce_bytes=coalesce)
    return model


def _cast_buffers(model: nn.Module, dtype: torch.dtype, ignored: set[int]) -> None:
    """FSDP1's `buffer_dtype`: floating-point buffers compute in it (those of modules whose
    parameters are all ignored keep theirs, as FSDP1's ignored modules do)."""
    for m in model.modules():
        params = list(m.parameters(recurse=False))
        if params and all(id(p) in ignored for p in params):
            continue
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)

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

