"""The class a sharded module becomes: its original class with FSDP2's module methods mixed
in (so `isinstance` holds), refusing what would swap the shards behind the engine's back
(`.to(dtype)`, deepcopy) and allocating meta shards on `to_empty`; and how to tell that
`fully_shard` was called on a module itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..core.inspect import unit_of
from ..core.unit import Unit
from .module_api import FSDP2Methods


class ShardedModule(FSDP2Methods):
    """Mixed into a sharded module's class, so `isinstance(m, OriginalClass)` still holds."""

    _sw_unit: Unit

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A sharded module is only ever made by fully_shard changing __class__. A *new*
        # instance (nn.Sequential's slice builds one with type(self)(...)) has no unit
        # behind it: make it a plain module of the original class.
        plain = next(c for c in cls.__mro__
                     if issubclass(c, nn.Module) and not issubclass(c, ShardedModule))
        obj = plain.__new__(plain)
        obj.__init__(*args, **kwargs)
        return obj

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported: its "
            "parameters are shards bound to a process group. Deep-copy the model before "
            "sharding, or build a fresh one and load sw.full_state_dict(model) into it")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # model.to(dtype/device), .half(), .cuda() would swap the shards' storage behind
        # the engine's back (it keeps its own views), failing later inside forward.
        _to_empty(self._sw_unit, fn)
        for sp in self._sw_unit.params:
            probe = torch.empty(0, dtype=sp.orig_dtype, device=sp.host_device)
            moved = fn(probe)
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise ValueError(
                    f"changing a sharded model's dtype or device ({sp.orig_dtype}, "
                    f"{sp.host_device} -> {moved.dtype}, {moved.device}) is not supported "
                    "after sharding: convert it before fully_shard/shard_model, or use "
                    "mixed_precision= (compute dtype) and cpu_offload= (where shards live)")
        # The conversion is a no-op for the parameters, yet nn.Module._apply would still
        # swap each DTensor parameter's contents with a converted copy (swap_tensors), so
        # the optimizer's parameter would stop being the engine's shard. Hide them from it.
        held = [(ref.module, ref.name, ref.module._parameters[ref.name])
                for sp in self._sw_unit.params for ref in sp.refs]
        for m, name, _ in held:
            m._parameters[name] = None
        try:
            # Past FSDPModule._apply, which would read FSDP2's own state: the module's class.
            return super(FSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for m, name, t in held:
                m._parameters[name] = t


def _to_empty(unit: Unit, fn: Any) -> None:
    """`model.to_empty(device=...)` on a model sharded on the meta device allocates the
    shards (FSDP2's meta-init route: shard on meta, to_empty, then initialize the DTensor
    parameters). Recognized by what `fn` makes of a meta tensor: a real one."""
    meta = [sp for sp in unit.params if sp.is_meta]
    if not meta:
        return
    try:
        moved = fn(torch.empty(0, dtype=meta[0].orig_dtype, device="meta"))
    except (NotImplementedError, RuntimeError):
        return  # .to(device) of a meta tensor: nothing to copy from, torch refuses it
    if not isinstance(moved, torch.Tensor) or moved.is_meta:
        return
    host = meta[0].host_device
    if moved.device.type != host.type or (moved.device.index is not None
                                          and host.index is not None
                                          and moved.device.index != host.index):
        raise ValueError(
            f"to_empty(device={moved.device}) on unit {unit.label!r}: its shards live on "
            f"{host} (the mesh's device, or the CPU under offload_policy); use that device")
    for sp in meta:
        sp.materialize()


_CLASS_CACHE: dict[type, type] = {}


def sharded_class(cls: type) -> type:
    if issubclass(cls, ShardedModule):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return _CLASS_CACHE[cls]


def own_unit(module: nn.Module) -> Unit | None:
    """The unit fully_shard made on `module` itself, read from its own `__dict__`.

    Not `getattr`: a wrapper that forwards unknown attributes to the module it wraps
    (torch's CheckpointWrapper, Accelerate's and torchtitan's activation checkpointing)
    would answer with the inner module's unit, and the wrapper would look sharded when only
    its inner layer is. FSDP2 keeps its state in `module.__dict__` for the same reason.
    """
    return unit_of(module)
