"""FSDP2's module-level functions on shardwise modules: `fully_shard.state(module)`,
`register_fsdp_forward_method` and `share_comm_ctx`.

`ShardwiseState` is what `fully_shard.state(module)` and `module._get_fsdp_state()` return.
It is a view of the module's unit, not FSDP2's FSDPState: it has the public facts (mesh,
policies, root, the modules of the unit) and the two entry points that PyTorch's own
`torch.distributed.fsdp.register_fsdp_forward_method` calls on a state (`_pre_forward`,
`_post_forward`), so that function works on shardwise modules unchanged. The facts that
frameworks read from FSDP2's private fields are here too, with FSDP2's types:
`_fsdp_param_group(s)` (policies, parameters, sizes, dtypes: param_group_view.py),
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
`post_backward()` reduces a unit's accumulated gradients now (param_group_view.py), and the
final callback is the end of a backward: every pending reduction waited for, the units
resharded. Multi-stage schedules also call `unshard(async_op=True)`, the handle's `wait()`
and `reshard()` on every FSDPModule of a stage (module_api.py), and the metadata
inference's cleanup calls `reshard()` and sets `.grad = None`. Tested against FSDP2 running
the same schedules (tests/dist/test_pipelining.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed._composable.contract import STATE_KEY as _COMPOSABLE_STATE_KEY
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from ..core.hooks import forward_post_hook, forward_pre_hook
from ..core.inspect import unit_of
from .param_group_view import FSDPParamGroupView, torch_mp_policy

if TYPE_CHECKING:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    from ..core.mesh import MeshInfo
    from ..core.policies import CPUOffloadPolicy, MixedPrecisionPolicy
    from ..core.unit import Unit


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
