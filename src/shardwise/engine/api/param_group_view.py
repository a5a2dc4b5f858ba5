"""FSDP2's per-unit facts, read through `fully_shard.state(m)._fsdp_param_group`.

Frameworks and tests written for FSDP2 read a unit's policies and parameters from its
FSDPParamGroup (`mp_policy`, `offload_policy`, `fsdp_params[i].sharded_param`, ...). These
views answer the same questions from shardwise's unit, with torch's own policy classes, so
`isinstance(pg.offload_policy, CPUOffloadPolicy)` reads as on FSDP2. They are read-only
facts, plus the one action torch.distributed.pipelining takes on a param group,
`post_backward()` ([Note: pipelining] in state.py). FSDP2's machinery (streams,
`comm_ctx`, all-gather outputs) has no counterpart here, and reading it raises
AttributeError rather than returning an empty stand-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import OffloadPolicy as TorchNoOffload

from ..core.extension import torch_mp
from ..core.schedule import ShardedState

if TYPE_CHECKING:
    from ..core.mesh import MeshInfo
    from ..core.sharded_param import ShardedParam
    from ..core.unit import Unit


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
