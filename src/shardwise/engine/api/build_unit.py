"""The steps of fully_shard after its checks: collect the parameters a unit owns, re-home
tied ones from child units, shard the new ones, build the unit and its context, and install
the hooks that make the module a sharded one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.buffers import BufferPool
from ..core.context import ModelContext
from ..core.hooks import forward_post_hook, forward_pre_hook
from ..core.layout import shard_dim_for
from ..core.mesh import MeshInfo
from ..core.policies import CPUOffloadPolicy, MixedPrecisionPolicy
from ..core.schedule import ShardedState
from ..core.sharded_param import ParamRef, ShardedParam
from ..core.tp import TPContext
from ..core.unit import Unit
from .fully_shard_checks import check_plain_param
from .misuse import watch_optimizers
from .sd_hooks import install_state_dict_hooks
from .sharded_module import sharded_class
from .state import register_torch_state


def build_unit(module: nn.Module | list[nn.Module], info: MeshInfo,
               reshard_after_forward: bool, mp: MixedPrecisionPolicy | None,
               offload: CPUOffloadPolicy | None, ignored: set[int], owned: set[int] | None,
               tp: TPContext | None, auto: bool = True,
               placements: dict[int, int] | None = None) -> None:
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
