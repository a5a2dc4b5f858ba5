"""`module.state_dict()` / `load_state_dict()` hooks on every module that holds a sharded
parameter, as FSDP2 registers them.

[Note: state-dict hooks] Before a module's state dict is taken or loaded, its units reshard,
so `model.state_dict()` gives the DTensor shards at every point of a step (between a forward
and its backward too, where a unit that keeps its parameters, and the root, would otherwise
show full plain tensors). Backward then gathers again what it needs, as after a
`reshard_after_forward=True` forward. Loading also allocates shards still on the meta
device (a model sharded on meta and loaded without `to_empty`), and after the load puts
back the engine's own parameters where `load_state_dict(assign=True)` (what
`set_model_state_dict` uses for a meta model) replaced them, copying the loaded values
into the shards: otherwise the load would "succeed" into tensors the engine never reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core import dtensor as DT
from ..core.schedule import TrainingState

if TYPE_CHECKING:
    from ..core.sharded_param import ShardedParam


def install_state_dict_hooks(params: list[ShardedParam]) -> None:
    for sp in params:
        for ref in sp.refs:
            m = ref.module
            slots: dict[str, ShardedParam] | None = m.__dict__.get("_sw_slots")
            if slots is None:
                slots = m.__dict__["_sw_slots"] = {}
                m.register_state_dict_pre_hook(_pre_save)
                m.register_load_state_dict_pre_hook(_pre_load)
                m.register_load_state_dict_post_hook(_post_load)
            slots[ref.name] = sp


def _units(module: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for sp in module.__dict__["_sw_slots"].values():
        if sp.owner is not None:
            seen.setdefault(id(sp.owner), sp.owner)
    return list(seen.values())


def _reshard(module: nn.Module, what: str) -> None:
    for u in _units(module):
        if u.training_state is TrainingState.PRE_BACKWARD and u.ctx is not None \
                and u.ctx.in_backward:
            raise RuntimeError(f"{what} of {type(module).__name__} inside the backward of "
                               f"unit {u.label!r} (its parameters are in use); call it "
                               "between steps or between forward and backward")
        u.reshard()


def _pre_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _reshard(module, "state_dict()")


def _pre_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    _reshard(module, "load_state_dict()")
    for name, sp in module.__dict__["_sw_slots"].items():
        sp.materialize()  # a no-op unless the shard is still on the meta device
        _zero_dim_value(sp, state_dict, prefix + name)


def _zero_dim_value(sp: ShardedParam, state_dict: dict, key: str) -> None:
    """A 0-d parameter's plain full value as its DTensor face: this rank's row of it.

    The face of a 0-d parameter has global shape (1,) ([Note: DTensor parameters]), and
    torch's `set_model_state_dict(full_state_dict=True)` hands 0-d values over as they are
    (it distributes only tensors of one dim or more), so load_state_dict refused them as a
    size mismatch. The unsharded module takes a 0-d value here; so does the sharded one.
    """
    value = state_dict.get(key)
    if (sp.spec is None or sp.orig_shape != torch.Size([]) or not isinstance(value, torch.Tensor)
            or DT.is_dtensor(value) or value.dim() != 0):
        return
    rows = value.detach().reshape(1)[sp.row_start: sp.row_end]
    state_dict[key] = DT.wrap(rows.to(sp.local.device, sp.local.dtype), sp.spec)


def _post_load(module: nn.Module, incompatible: Any) -> None:
    slots: dict[str, ShardedParam] = module.__dict__["_sw_slots"]
    for name, sp in slots.items():
        now = module._parameters.get(name)
        if now is None or now is sp.sharded or now is sp.unsharded:
            continue
        # load_state_dict(assign=True) put the loaded tensor in place of the engine's.
        with torch.no_grad():
            if DT.is_dtensor(now):
                local = DT.local_of(now)
                mine = tuple(sp.from_rows(sp.local).shape)  # the face's layout
                placed = getattr(sp.sharded, "placements", None)
                moved = sp.shard_dim != 0 and now.placements != placed
                if tuple(local.shape) != mine or moved:
                    raise ValueError(
                        f"{sp.fqn}: the loaded DTensor's local shard has shape "
                        f"{tuple(local.shape)} placed {now.placements}, this rank's shard "
                        f"{mine} placed {placed} (a different sharding); load "
                        "a full state dict instead")
                sp.local.copy_(sp.to_rows(local))
            else:
                sp.set_full(now.detach())
            requires_grad = now.requires_grad
        for ref in sp.refs:
            ref.module._parameters[ref.name] = sp.sharded
        if requires_grad != sp.requires_grad:
            sp.set_requires_grad(requires_grad)
