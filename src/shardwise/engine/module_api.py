"""FSDP2's per-module methods on a sharded module, so an FSDP2 user ports by an import.

Each method acts on the unit of the module it is called on (and, with `recurse=True`, on
every unit below it), as FSDP2's do. Where shardwise decides something itself (prefetch
order, when to wait for reductions), the method is accepted, checked and documented as
having nothing to change (docs/porting.md lists these).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .checks import check_bool, check_number

# Imported at run time, not under TYPE_CHECKING: Hugging Face resolves the annotations of a
# model's class (typing.get_type_hints), and a sharded module's class inherits these.
from .unit import Unit


class UnshardHandle:
    """What `unshard(async_op=True)` returns: `wait()` makes the full parameters usable."""

    def __init__(self, unit: Unit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_unshard()
            self._unit = None


class FSDP2Methods:
    """Mixed into ShardedModule: the module methods FSDP2 users call."""

    _sw_unit: Unit

    def _sw_units(self, recurse: bool) -> Iterator[Unit]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for m in mods:
            unit = getattr(m, "_sw_unit", None)
            if unit is not None:
                yield unit

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
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

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True
                                  ) -> None:
        """True: free full parameters after forward (FULL_SHARD); False: keep them until
        backward (SHARD_GRAD_OP). The root unit always keeps them (backward starts there)."""
        check_reshard_after_forward(reshard_after_forward)
        for u in self._sw_units(recurse):
            u.reshard_after_forward = reshard_after_forward

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
        """FSDP2: skip HYBRID_SHARD's all-reduce across replicas. Only True is supported
        where there are replicas; without replicas there is nothing to skip."""
        check_bool("requires_all_reduce", requires_all_reduce)
        if requires_all_reduce:
            return
        for u in self._sw_units(recurse):
            if u.mesh.replicate_size > 1:
                raise NotImplementedError(
                    f"set_requires_all_reduce(False) on unit {u.label!r} (HYBRID_SHARD, "
                    f"{u.mesh.replicate_size} replicas) is not supported: use "
                    "set_requires_gradient_sync(False) / sw.no_sync(model) to accumulate "
                    "without any communication")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: shardwise waits for every reduction at the end
        of each backward, so there is nothing to defer."""
        check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: Iterable[Any]) -> None:
        """Accepted for FSDP2 compatibility, checked: shardwise records the units' order on
        the first forward and prefetches the next unit itself (`set_prefetch` turns it off)."""
        _check_sharded_modules("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[Any]) -> None:
        """As `set_modules_to_forward_prefetch`: backward prefetch follows the recorded
        order reversed."""
        _check_sharded_modules("set_modules_to_backward_prefetch", modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by `factor` instead of the data-parallel size (the
        default, a mean over ranks); 1.0 gives the sum over ranks."""
        factor = check_number("factor", factor, positive=True)
        for u in self._sw_units(True):
            u.grad_divide_factor = float(factor)

    def set_prefetch(self, enabled: bool) -> None:
        """Turn all-gather prefetching on or off for the whole model (on by default)."""
        check_bool("enabled", enabled)
        assert self._sw_unit.ctx is not None
        self._sw_unit.ctx.schedule.prefetch = enabled


def check_reshard_after_forward(value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"reshard_after_forward={value!r} is not supported: must be a bool (FSDP2's int "
            "form, resharding to a smaller group after forward, is not implemented)")


def _check_sharded_modules(what: str, modules: Iterable[Any]) -> None:
    mods = list(modules)
    bad = [type(m).__name__ for m in mods if getattr(m, "_sw_unit", None) is None]
    if bad:
        raise ValueError(f"{what}: every module must be sharded with fully_shard; got "
                         f"unsharded {bad}")
