"""FSDP2's module-level functions on shardwise modules: `fully_shard.state(module)`,
`register_fsdp_forward_method` and `share_comm_ctx`.

`ShardwiseState` is what `fully_shard.state(module)` and `module._get_fsdp_state()` return.
It is a view of the module's unit, not FSDP2's FSDPState: it has the public facts (mesh,
policies, root, the modules of the unit) and the two entry points that PyTorch's own
`torch.distributed.fsdp.register_fsdp_forward_method` calls on a state (`_pre_forward`,
`_post_forward`), so that function works on shardwise modules unchanged. The facts that
frameworks read from FSDP2's private fields are here too, with FSDP2's types:
`_fsdp_param_group(s)` (policies, parameters, sizes, dtypes: state.py),
`_mp_policy`, `_is_root`, `_modules`, `_device`. FSDP2's machinery (`_comm_ctx`, streams,
prefetch lists) does not exist here: code that reads it gets an AttributeError instead of
a silently empty answer.

[Note: pipelining] torch.distributed.pipelining drives a stage's FSDP from outside. Before
each microbatch's backward it calls `set_is_last_backward(False)`,
`set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)` on the stage
module, so the units accumulate unreduced gradients and stay gathered. After the last
microbatch (its REDUCE_GRAD action, `stage.perform_reduce_grad`) it sets the three back to
True, takes the state with *torch's* `fully_shard.state(stage)` (its own import, which
`patch_fsdp2` does not rebind), calls `post_backward()` on every param group of every
state in `state._state_ctx.all_states`, then `state._root_post_backward_final_callback()`.
So the view is registered where torch's `fully_shard.state` looks (`register_torch_state`),
`post_backward()` reduces a unit's accumulated gradients now (state.py), and the
final callback is the end of a backward: every pending reduction waited for, the units
resharded. Multi-stage schedules also call `unshard(async_op=True)`, the handle's `wait()`
and `reshard()` on every FSDPModule of a stage (sharded_module.py), and the metadata
inference's cleanup calls `reshard()` and sets `.grad = None`. Tested against FSDP2 running
the same schedules (tests/dist/test_pipelining.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._composable.contract import STATE_KEY as _COMPOSABLE_STATE_KEY
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import OffloadPolicy as TorchNoOffload
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from ..core import dtensor as DT
from ..core.context import unit_of
from ..core.hooks import forward_post_hook, forward_pre_hook
from ..core.schedule import ShardedState, TrainingState
from ..core.unit import torch_mp

if TYPE_CHECKING:
    from ..core.policies import CPUOffloadPolicy, MeshInfo, MixedPrecisionPolicy
    from ..core.sharded_param import ShardedParam
    from ..core.unit import Unit


# --------------------------------------------------------------------------------------------------
# `module.state_dict()` / `load_state_dict()` hooks on every module that holds a sharded
# parameter, as FSDP2 registers them.
#
# [Note: state-dict hooks] Before a module's state dict is taken or loaded, its units reshard,
# so `model.state_dict()` gives the DTensor shards at every point of a step (between a forward
# and its backward too, where a unit that keeps its parameters, and the root, would otherwise
# show full plain tensors). Backward then gathers again what it needs, as after a
# `reshard_after_forward=True` forward. Loading also allocates shards still on the meta
# device (a model sharded on meta and loaded without `to_empty`), and after the load puts
# back the engine's own parameters where `load_state_dict(assign=True)` (what
# `set_model_state_dict` uses for a meta model) replaced them, copying the loaded values
# into the shards: otherwise the load would "succeed" into tensors the engine never reads.


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
    """A 0-d parameter's plain value as its replicated DTensor face.

    torch's `set_model_state_dict(full_state_dict=True)` hands 0-d values over as they are
    (it distributes only tensors of one dim or more); the face is a `Replicate()` DTensor
    of shape () ([Note: 0-d parameters] in sharded_param.py), and every rank takes the
    value it was given, as the unsharded module does.
    """
    value = state_dict.get(key)
    if (sp.spec is None or not sp.scalar or not isinstance(value, torch.Tensor)
            or DT.is_dtensor(value) or value.dim() != 0):
        return
    state_dict[key] = DT.wrap(value.detach().to(sp.local.device, sp.local.dtype), sp.spec)


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


# --------------------------------------------------------------------------------------------------
# FSDP2's per-unit facts, read through `fully_shard.state(m)._fsdp_param_group`.
#
# Frameworks and tests written for FSDP2 read a unit's policies and parameters from its
# FSDPParamGroup (`mp_policy`, `offload_policy`, `fsdp_params[i].sharded_param`, ...). These
# views answer the same questions from shardwise's unit, with torch's own policy classes, so
# `isinstance(pg.offload_policy, CPUOffloadPolicy)` reads as on FSDP2. They are read-only
# facts, plus the one action torch.distributed.pipelining takes on a param group,
# `post_backward()` ([Note: pipelining] in state.py). FSDP2's machinery (streams,
# `comm_ctx`, all-gather outputs) has no counterpart here, and reading it raises
# AttributeError rather than returning an empty stand-in.


# The unit's mixed precision as FSDP2 holds it (its default policy when off): one function,
# in core, where the all-gather extensions' 5-argument pre hook needs it too.
torch_mp_policy = torch_mp


def _offloaded(unit: Unit) -> bool:
    return unit.offload is not None and unit.offload.params


class FSDPParamView:
    """One parameter's FSDPParam facts: FSDP2's names, shardwise's values."""

    def __init__(self, sp: ShardedParam, unit: Unit) -> None:
        self._sp = sp
        self._unit = unit

    @property
    def sharded_param(self) -> nn.Parameter:
        """What the module and the optimizer hold (a DTensor on this rank's rows)."""
        return self._sp.sharded

    @property
    def _orig_size(self) -> torch.Size:
        return torch.Size(self._sp.orig_shape)

    @property
    def sharded_size(self) -> torch.Size:
        """This rank's rows, without padding (FSDP2's chunk size)."""
        return torch.Size(self._sp.local.shape)

    @property
    def param_dtype(self) -> torch.dtype | None:
        # FSDP2's clamp: None when no cast happens (same dtype, or not floating point).
        want = self._unit.mp.param_dtype if self._unit.mp is not None else None
        orig = self._sp.orig_dtype
        return None if want in (None, orig) or not orig.is_floating_point else want

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        mp = self._unit.mp
        if mp is None or mp.reduce_dtype == mp.param_dtype:
            return None
        return mp.reduce_dtype

    @property
    def offload_to_cpu(self) -> bool:
        return _offloaded(self._unit)

    @property
    def pin_memory(self) -> bool:
        return _offloaded(self._unit) and bool(self._unit.offload.pin_memory)  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"FSDPParamView({self._sp.fqn!r}, {tuple(self._sp.orig_shape)})"


class FSDPParamGroupView:
    """One unit's FSDPParamGroup facts."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return tuple(self._unit.modules)

    @property
    def fsdp_params(self) -> list[FSDPParamView]:
        # Built on each read: the unit's parameters change when a tied one is re-homed.
        return [FSDPParamView(sp, self._unit) for sp in self._unit.params]

    @property
    def device(self) -> torch.device:
        return self._unit.mesh.device

    @property
    def mp_policy(self) -> TorchMP:
        return torch_mp_policy(self._unit)

    @property
    def offload_policy(self) -> TorchNoOffload:
        off = self._unit.offload
        if off is None or not off.params:
            return TorchNoOffload()
        return TorchOffload(pin_memory=off.pin_memory)

    @property
    def post_forward_mesh_info(self) -> MeshInfo | None:
        """None where forward keeps the full parameters, as in FSDP2 (the value is
        shardwise's mesh facts, not FSDP2's FSDPMeshInfo)."""
        return self._unit.mesh if self._unit.reshards_after_forward else None

    @property
    def reduce_grads(self) -> bool:
        return self._unit.requires_grad_sync

    @property
    def reshard_after_backward(self) -> bool:
        return self._unit.reshard_after_backward

    def post_backward(self) -> None:
        """Reduce what this unit's backward passes accumulated (and, per
        `reshard_after_backward`, reshard): what torch.distributed.pipelining calls on every
        param group after the last microbatch ([Note: pipelining]). The reductions are
        waited for by the root state's `_root_post_backward_final_callback()`."""
        unit = self._unit
        if unit.ctx is None:
            return
        if unit.state is not ShardedState.SHARDED or unit.has_unreduced_grads():
            unit.ctx.schedule.post_backward(unit)

    def __repr__(self) -> str:
        return f"FSDPParamGroupView({self._unit.label!r}, params={len(self._unit.params)})"


class ShardwiseState:
    """One unit's state, as `fully_shard.state(module)` gives it."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        # One view for the unit's life, so `_fsdp_param_groups == [_fsdp_param_group]`.
        self._group_view = FSDPParamGroupView(unit)

    @property
    def modules(self) -> list[nn.Module]:
        """The module(s) this `fully_shard` call was given (several for the list form)."""
        return list(self.unit.modules)

    @property
    def mesh(self) -> MeshInfo:
        return self.unit.mesh

    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        return self.unit.mp

    @property
    def offload_policy(self) -> CPUOffloadPolicy | None:
        return self.unit.offload

    @property
    def is_root(self) -> bool:
        return self.unit.is_root

    @property
    def reshard_after_forward(self) -> bool:
        return self.unit.reshards_after_forward

    # FSDP2's private names for the same facts (what torchtitan, Lightning and FSDP2's own
    # tests read), with FSDP2's types.

    @property
    def _fsdp_param_group(self) -> FSDPParamGroupView | None:
        return self._group_view if self.unit.params else None

    @property
    def _fsdp_param_groups(self) -> list[FSDPParamGroupView]:
        return [self._group_view] if self.unit.params else []

    @property
    def _mp_policy(self) -> TorchMP:
        return torch_mp_policy(self.unit)

    @property
    def _is_root(self) -> bool | None:
        # FSDP2 decides the root at lazy init (the first forward); None until then.
        ready = self.unit.ctx is not None and self.unit.ctx.ready
        return self.unit.is_root if ready else None

    @property
    def _modules(self) -> tuple[nn.Module, ...]:
        return tuple(self.unit.modules)

    @property
    def _device(self) -> torch.device:
        return self.unit.mesh.device

    # What torch.distributed.pipelining walks after the last microbatch's backward
    # ([Note: pipelining]): every state under this root, then the root's final callback.

    @property
    def _state_ctx(self) -> StateContextView:
        return StateContextView(self.unit)

    def _root_post_backward_final_callback(self) -> None:
        """Wait for every reduction the param groups' `post_backward()` issued, reshard the
        units that reshard after backward: the end of a backward, run by hand."""
        if self.unit.ctx is not None:
            self.unit.ctx.finish_backward()

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict]:

        return forward_pre_hook(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:

        return forward_post_hook(module, args, {}, output)

    def __repr__(self) -> str:
        return (f"ShardwiseState(unit={self.unit.label!r}, params={len(self.unit.params)}, "
                f"shard_size={self.unit.mesh.shard_size})")


class StateContextView:
    """FSDP2's `_state_ctx`: the states of every unit under one root."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    @property
    def all_states(self) -> list[ShardwiseState]:
        ctx = self._unit.ctx
        units = ctx.units if ctx is not None else [self._unit]
        return [_view(u) for u in units]


def _view(unit: Unit) -> ShardwiseState:
    if unit.state_view is None:
        unit.state_view = ShardwiseState(unit)
    return unit.state_view


# FSDP2 keeps a module's state where torch's composable APIs keep theirs: in the module's
# __dict__ under contract's STATE_KEY, keyed by the undecorated fully_shard (functools.wraps
# leaves it as __wrapped__). torch's `fully_shard.state(m)` reads it there ([Note:
# pipelining]). A torch whose contract hides it: nothing is registered, and pipelining's
# walk fails in torch as it did before.
_TORCH_FULLY_SHARD = getattr(torch_fully_shard, "__wrapped__", None)


def register_torch_state(module: nn.Module, unit: Unit) -> None:
    """Make torch's `fully_shard.state(module)` return shardwise's view of `unit` (and
    torch's fully_shard on this module refuse, as on a module FSDP2 sharded already)."""
    if _TORCH_FULLY_SHARD is None:
        return
    module.__dict__.setdefault(_COMPOSABLE_STATE_KEY, {})[_TORCH_FULLY_SHARD] = _view(unit)


def state_of(module: nn.Module) -> ShardwiseState | None:
    """`fully_shard.state(module)`: the state of the unit `fully_shard` made on `module`
    (None for a module that was not itself given to fully_shard, as in FSDP2)."""
    unit = unit_of(module)
    if unit is None:
        return None
    return _view(unit)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` like its forward: gather before, reshard (per
    `reshard_after_forward`) and hook the outputs for backward after. A no-op on a module
    that is not sharded, as in FSDP2 (torch's own function works on shardwise modules too).
    """
    if unit_of(module) is None:
        return
    if not isinstance(method_name, str) or not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = forward_pre_hook(self, args, kwargs)
        out = orig(*args, **kwargs)
        return forward_post_hook(self, args, kwargs, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2 shares CUDA streams between roots (pipeline stages). shardwise issues its
    collectives on the current stream and its buffer pools are per root, so there is
    nothing to share; the modules are checked, as FSDP2 does."""
    for m in modules:
        if unit_of(m) is None:
            raise ValueError(f"share_comm_ctx expects sharded modules (fully_shard), got "
                             f"{type(m).__name__}")
