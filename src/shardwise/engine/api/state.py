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
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.hooks import forward_post_hook, forward_pre_hook
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

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict]:

        return forward_pre_hook(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:

        return forward_post_hook(module, args, {}, output)

    def __repr__(self) -> str:
        return (f"ShardwiseState(unit={self.unit.label!r}, params={len(self.unit.params)}, "
                f"shard_size={self.unit.mesh.shard_size})")


def state_of(module: nn.Module) -> ShardwiseState | None:
    """`fully_shard.state(module)`: the state of the unit `fully_shard` made on `module`
    (None for a module that was not itself given to fully_shard, as in FSDP2)."""
    unit = getattr(module, "_sw_unit", None)
    if unit is None:
        return None
    if unit.state_view is None:
        unit.state_view = ShardwiseState(unit)
    return unit.state_view


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` like its forward: gather before, reshard (per
    `reshard_after_forward`) and hook the outputs for backward after. A no-op on a module
    that is not sharded, as in FSDP2 (torch's own function works on shardwise modules too).
    """
    if getattr(module, "_sw_unit", None) is None:
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
        if getattr(m, "_sw_unit", None) is None:
            raise ValueError(f"share_comm_ctx expects sharded modules (fully_shard), got "
                             f"{type(m).__name__}")
