"""FSDP2's per-module methods on a sharded module, so an FSDP2 user ports by an import.

[Note: FSDPModule identity] A sharded module's class derives from torch's own
`torch.distributed.fsdp.FSDPModule`, so the frameworks that detect FSDP2 with
`isinstance(m, FSDPModule)` (torchtitan disabling gradient division, Lightning's
`no_backward_sync`, chunked losses) take their FSDP2 path on it. FSDPModule's methods reach
into FSDP2's internal state, so *every* one of them is overridden here (or in
module_comm_api.py) to act on shardwise's units; tests/dist/fsdp2_identity_workers.py checks
that none is inherited. `_get_fsdp_state()` returns shardwise's state view (state.py), not
FSDP2's FSDPState.

Each method acts on the unit of the module it is called on (and, with `recurse=True`, on
every unit below it), as FSDP2's do. Where shardwise decides something itself (prefetch
order, when to wait for reductions), the method is accepted, checked and documented as
having nothing to change (docs/porting.md lists these).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from ..core.checks import check_bool, check_module
from ..core.inspect import unit_of, units_of
from ..core.schedule import ShardedState
from ..core.unit import Unit
from .module_comm_api import CommMethods

# Imported at run time, not under TYPE_CHECKING: Hugging Face resolves the annotations of a
# model's class (typing.get_type_hints), and a sharded module's class inherits these.
from .state import ShardwiseState, state_of


class UnshardHandle(TorchUnshardHandle):
    """What `unshard(async_op=True)` returns: `wait()` makes the full parameters usable."""

    def __init__(self, unit: Unit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        # Only a gather still in flight is waited for. Once a forward consumed it (and
        # maybe resharded), waiting must not gather again: FSDP2's handle is then a no-op,
        # and a re-gather would leave plain full parameters on the module after the step.
        if self._unit is not None and self._unit.state is ShardedState.GATHERING:
            self._unit.wait_unshard()
        self._unit = None


class FSDP2Methods(CommMethods, FSDPModule):
    """Mixed into ShardedModule: the module methods FSDP2 users call."""

    _sw_unit: Unit

    def _sw_units(self, recurse: bool) -> Iterator[Unit]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        seen: set[int] = set()
        for m in mods:
            unit = unit_of(m)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                yield unit

    def _get_fsdp_state(self) -> ShardwiseState:  # type: ignore[override]
        """shardwise's state view of this module's unit (FSDP2 returns its FSDPState)."""
        state = state_of(self)  # type: ignore[arg-type]
        assert state is not None
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """Gather this unit's full parameters onto the module.

        async_op=True issues the all-gather and returns a handle; `handle.wait()` (or the
        module's next forward) finishes it. Synchronous by default, as in FSDP2.
        """
        check_bool("async_op", async_op)
        if async_op:
            self._sw_unit.unshard(async_op=True)
            return UnshardHandle(self._sw_unit)
        self._sw_unit.wait_unshard()
        return None

    def reshard(self) -> None:
        """Free this unit's full parameters; the module holds only its shards."""
        self._sw_unit.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: reshard every unit, drop the failed step's
        unreduced gradients and pending reductions, so the next step starts clean. Only on
        the root (FSDP2 refuses it elsewhere too)."""
        unit = self._sw_unit
        if unit.ctx is None or not unit.is_root:
            raise RuntimeError("reset_iter_state must be called on the root sharded module "
                               f"(the last one fully_shard was called on); "
                               f"{type(self).__name__} is not the root")
        unit.ctx.reset_iter_state()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True
                                  ) -> None:
        """True: free full parameters after forward (FULL_SHARD); False: keep them until
        backward (SHARD_GRAD_OP). As in FSDP2, an explicit True applies to the root too,
        only a bool is taken (an int group size is fully_shard's alone), and either value
        replaces an hpZ group size given to fully_shard ([Note: hpZ] in core/hpz.py)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward).__name__} "
                             f"({reshard_after_forward!r}); an int group size (hpZ) is "
                             "taken by fully_shard only, as in FSDP2")
        for u in self._sw_units(recurse):
            u.reshard_after_forward = reshard_after_forward
            u.auto_reshard_after_forward = False
            u.hpz = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep full parameters after backward (saves the next forward's all-gather
        during gradient accumulation). Set it back to True before the optimizer step's
        backward: full parameters kept across a step would be stale."""
        check_bool("reshard_after_backward", reshard_after_backward)
        for u in self._sw_units(recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally, with no communication."""
        check_bool("requires_gradient_sync", requires_gradient_sync)
        for u in self._sw_units(recurse):
            u.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True
                                ) -> None:
        """False: under HYBRID_SHARD, each backward still reduce-scatters within the shard
        group but skips the all-reduce across replicas; the partial sums accumulate, and
        the next backward with True all-reduces them all at once (FSDP2's meaning;
        [Note: deferred all-reduce] in core/reduce.py). Without replicas there is nothing
        to skip; NO_SHARD (replicas, no shard group) is refused."""
        check_bool("requires_all_reduce", requires_all_reduce)
        units = list(self._sw_units(recurse))
        if not requires_all_reduce:
            for u in units:
                if u.mesh.replicate_size > 1 and u.mesh.shard_size == 1:
                    raise NotImplementedError(
                        f"set_requires_all_reduce(False) on unit {u.label!r}: its "
                        f"{u.mesh.replicate_size} replicas have no shard group (NO_SHARD), "
                        "so the all-reduce is the only reduction; use "
                        "set_requires_gradient_sync(False) / sw.no_sync(model) to "
                        "accumulate without communication")
        for u in units:
            u.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: shardwise waits for every reduction at the end
        of each backward, so there is nothing to defer."""
        check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: Iterable[Any]) -> None:  # type: ignore[override]
        """Accepted for FSDP2 compatibility, checked: shardwise records the units' order on
        the first forward and prefetches the next unit itself (`set_prefetch` turns it off)."""
        _check_sharded_modules("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[Any]) -> None:  # type: ignore[override]
        """As `set_modules_to_forward_prefetch`: backward prefetch follows the recorded
        order reversed."""
        _check_sharded_modules("set_modules_to_backward_prefetch", modules)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward runs without gathering its parameters (for modules
        whose backward needs no parameter values, such as an embedding); its gradients are
        still reduced. Not recursive, as in FSDP2."""
        check_bool("unshard_in_backward", unshard_in_backward)
        self._sw_unit.unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted (FSDP2's private stream knob): shardwise already issues its prefetches
        asynchronously and waits where the parameters are needed."""
        check_bool("async_op", async_op)

    def set_prefetch(self, enabled: bool) -> None:
        """Turn all-gather prefetching on or off for the whole model (on by default)."""
        check_bool("enabled", enabled)
        assert self._sw_unit.ctx is not None
        self._sw_unit.ctx.schedule.prefetch = enabled


def check_reshard_after_forward(value: object, shard_size: int | None = None) -> object:
    """FSDP2's forms: None (root False, others True), a bool, or an int group size: 1 is
    False, the shard-group size True, and a proper divisor k stays k (hpZ: reshard to
    blocks of k ranks after forward, [Note: hpZ] in core/hpz.py)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward={value!r} must be None, a bool or an int "
                         "group size")
    if shard_size is None:
        return value
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(f"reshard_after_forward={value} as an int must be a divisor of the "
                         f"shard group size {shard_size}")
    if value == 1:
        return False
    if value == shard_size:
        return True
    return value


def _check_sharded_modules(what: str, modules: Iterable[Any]) -> None:
    mods = list(modules)
    bad = [type(m).__name__ for m in mods if unit_of(m) is None]
    if bad:
        raise ValueError(f"{what}: every module must be sharded with fully_shard; got "
                         f"unsharded {bad}")


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no communication) inside the block.

    The backward after the block reduces everything accumulated, so k micro-batches (each
    loss divided by k) give the same update as one batch k times larger.
    """
    check_module("model", model)
    units = units_of(model)
    if not units:
        raise ValueError(f"no_sync needs a sharded model; {type(model).__name__} has no units")
    before = [u.requires_grad_sync for u in units]
    for u in units:
        u.requires_grad_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.requires_grad_sync = b
