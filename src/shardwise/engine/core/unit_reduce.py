"""One unit's reduce half: after its backward, reduce the gradients (reduce.py issues the
collectives and writes the sharded gradients), or keep them unsharded inside no_sync().

A mixin of `Unit` (unit.py), which holds the layout and the flags read here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .bucket import FlatBucket
from .reduce import PendingReduce, finish_reduce, reduce_bucket

if TYPE_CHECKING:
    from .context import ModelContext


class UnitReduce:
    ctx: ModelContext | None
    buckets: list[FlatBucket]
    reduce_dtype_for: dict[torch.dtype, torch.dtype]
    requires_grad_sync: bool
    unsynced: bool
    t_compute: float
    offload_events: list[Any]

    # --- gradients ----------------------------------------------------------------------

    def has_unreduced_grads(self) -> bool:
        """Whether a gradient waits for a reduction (a pure question: nothing moves).

        Under no_sync, decided alike on every rank: a backward ran for this unit (at the
        same point everywhere, [Note: structure decides]) that kept its gradients. Whether
        this rank holds any is its data's business (a parameter the micro-batches used on
        some ranks only): the unit still reduces on all of them.
        """
        return self.unsynced or any(p.has_local_grad() for g in self.buckets
                                    for p in g.grad_params)

    def reduce_grads(self) -> Sequence[PendingReduce]:
        """The unit's backward is over: reduce its gradients (async); the schedule reshards.

        May run more than once per backward (a unit used by several forwards): each call
        reduces what accumulated since the last one, and the results add up in the sharded
        gradients. Inside no_sync() the gradients stay unsharded (upcast to the reduce
        dtype, as they will be reduced in it) for a later backward to reduce.
        """
        if self.ctx is not None and self.ctx.sinks:
            self.emit("backward", "", 0, self.t_compute)
        # (has_unreduced_grads: what a later backward must reduce, alike on every rank.)
        self.unsynced = not self.requires_grad_sync
        if self.requires_grad_sync:
            return self._reduce_grads()
        self._accumulate_unsynced()
        return ()

    def _accumulate_unsynced(self) -> None:
        for g in self.buckets:
            rd = self.reduce_dtype_for[g.dtype]
            for p in g.grad_params:
                grad = None if p.direct else p.unsharded_grad()
                if grad is None or grad.dtype == rd:
                    continue  # accumulates in place already, in the right dtype
                with torch.no_grad():
                    if p.acc_grad is None:
                        p.acc_grad = grad.to(rd)
                    else:
                        p.acc_grad.add_(grad)
                p.unsharded.grad = None

    def _reduce_grads(self) -> list[PendingReduce]:
        with torch.no_grad():
            pending = [reduce_bucket(self, g) for g in self.buckets if g.grad_params]
        return [pr for pr in pending if pr is not None]

    def settle_offload(self) -> None:
        """Wait for the gradient copies to the host (CPU offload on a GPU): the optimizer
        steps them on the host next."""
        for ev in self.offload_events:
            ev.synchronize()
        self.offload_events.clear()

    def finish_reduce(self, pr: PendingReduce) -> None:
        """Wait for a reduction and write the result into the sharded gradients."""
        finish_reduce(self, pr)
