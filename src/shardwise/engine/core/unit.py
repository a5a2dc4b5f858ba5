"""One unit: the parameters of one `fully_shard` call, gathered and reduced together.

A unit moves all of its parameters through one flat buffer per communication dtype: one
all-gather to unshard, one reduce-scatter (plus an all-reduce across replicas for
HYBRID_SHARD, or only an all-reduce for NO_SHARD) to reduce gradients. State transitions
live in the unit and are checked at entry (see `ShardedState`); *when* they happen is decided by
the step schedule (schedule.py). How bytes move is the mesh's transport (transport.py).

This file holds the unit's state and layout; its gather half (unshard / wait_unshard /
reshard) is unit_gather.py, its reduce half (reduce_grads / finish_reduce) unit_reduce.py,
both mixins of `Unit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ..api.state import ShardwiseState
    from .context import ModelContext

from ..comm.transport import Transport
from .bucket import FlatBucket, PendingGather
from .buffers import BufferPool
from .events import Event, now
from .extension import ExtGather
from .hpz import Hpz
from .mesh import MeshInfo
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy
from .schedule import ShardedState, TrainingState
from .sharded_param import ShardedParam
from .unit_gather import UnitGather
from .unit_reduce import UnitReduce


class Unit(UnitGather, UnitReduce):
    def __init__(
        self,
        module: nn.Module,
        name: str,
        params: list[ShardedParam],
        mesh: MeshInfo,
        reshard_after_forward: bool,
        mp: MixedPrecisionPolicy | None,
        pool: BufferPool,
    ) -> None:
        self.module = module
        # Every module this unit was made for: several for the list form of fully_shard.
        self.modules: list[nn.Module] = [module]
        # FQN of the module within the root (filled in at lazy init; "" is the root).
        self.name = name
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        # FSDP2's reshard_after_forward=None: the root keeps its parameters after forward
        # (backward starts there); an explicit value applies to the root too.
        self.auto_reshard_after_forward = True
        self.mp = mp
        # Where this unit's new shards live (set by fully_shard); read back by its state.
        self.offload: CPUOffloadPolicy | None = None
        self.pool = pool
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        # The per-model context (engine/core/context.py), set when this unit is sharded and
        # replaced when a parent is sharded.
        self.ctx: ModelContext | None = None
        self.is_root = False
        # False inside no_sync(): keep unsharded gradients and reduce them later.
        self.requires_grad_sync = True
        # A backward inside no_sync() kept gradients here that no reduction took since.
        self.unsynced = False
        # False: keep the full parameters after backward (set_reshard_after_backward).
        self.reshard_after_backward = True
        # Reduced gradients are divided by this (None: the data-parallel size, a mean).
        self.grad_divide_factor: float | None = None
        # FSDP2 module methods (module_api.py, module_comm_api.py).
        self.unshard_in_backward = True
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: object | None = None
        # How bytes move: the mesh's, or user collectives (set_custom_all_gather).
        self.transport: Transport = mesh.transport
        self.state_view: ShardwiseState | None = None
        self._gathers: list[PendingGather] = []
        # The extension parameters' packed all-gather in flight ([Note: all-gather
        # extensions] in extension.py), beside the plain buckets' gathers.
        self._ext_gather: ExtGather | None = None
        self.ext_params: list[ShardedParam] = []
        # Bytes this unit copied locally since it was sharded, by where (gather_in: shards
        # into the send buffer, gather_out: into the unsharded parameters, pack: gradients
        # into the reduce buffer, reduce_sum: the local sum of a transport that reduces on
        # this side, reduce_out: the reduced shard into existing or cast sharded gradients).
        self.copied: dict[str, int] = dict.fromkeys(
            ("gather_in", "gather_out", "pack", "reduce_sum", "reduce_out"), 0)
        # When the current forward/backward compute interval began (only with sinks).
        self.t_compute = 0.0
        self.buckets: list[FlatBucket] = []
        # CUDA with CPU offload: events after this backward's non-blocking gradient copies
        # to the host (reduce.py), synchronized once at the end of backward.
        self.offload_events: list[Any] = []
        # hpZ ([Note: hpZ] in hpz.py): the block of ranks forward reshards to (None: the
        # whole shard group), and per bucket the rows kept between forward and backward.
        self.hpz: Hpz | None = None
        self.post_forward: list[torch.Tensor | None] | None = None
        # Ranks of the all-gather last issued (the shard group, or the hpZ block): events.
        self._gather_size = mesh.shard_size
        # False (set_requires_all_reduce, HYBRID_SHARD): reduce-scatter, but keep the
        # result here, per bucket, instead of all-reducing it across replicas; the next
        # reduction that all-reduces adds it in (reduce.py, [Note: deferred all-reduce]).
        self.requires_all_reduce = True
        self.partial_reduce: dict[int, torch.Tensor] = {}
        self.params: list[ShardedParam] = []
        self.set_params(params)

    # --- parameters ------------------------------------------------------------------

    def set_params(self, params: list[ShardedParam]) -> None:
        """(Re)build the flat layout; used when a tied parameter is re-homed into a parent."""
        assert self.state is ShardedState.SHARDED, "layout changes only while sharded"
        self.params = list(params)
        self.post_forward = None
        assert not self.partial_reduce, "layout changes only without deferred reductions"
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for p in self.params:
            by_dtype.setdefault(p.compute_dtype, []).append(p)
        self.buckets = [FlatBucket(dtype, ps) for dtype, ps in by_dtype.items()]
        self.ext_params = [p for p in self.params if p.ext is not None]
        rd = self.mp.reduce_dtype if self.mp else None
        # Communication dtype -> gradient reduction dtype, fixed by the layout.
        self.reduce_dtype_for = {g.dtype: (rd or g.dtype) for g in self.buckets}

    def follow_requires_grad(self) -> None:
        """Take up `requires_grad` changes the user made since sharding (between steps).

        The flag is read from the Parameter the module holds now (the sharded one, or the
        unsharded one while the unit is unsharded) and copied to the other; the gradient
        layout is rebuilt when any flag changed, so a frozen parameter gets no gradient, no
        reduction and no optimizer update, and an unfrozen one trains.
        """
        changed = False
        for p in self.params:
            held = p.refs[0].module._parameters.get(p.refs[0].name)
            want = held.requires_grad if held is not None else p.requires_grad
            if want != p.requires_grad:
                changed = True
                p.set_requires_grad(want)
        if changed:
            self.reshard()
            self.set_params(self.params)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether forward frees the full parameters: FSDP2's rule, where the root keeps
        them unless reshard_after_forward was given explicitly."""
        return self.reshard_after_forward and not (self.is_root
                                                   and self.auto_reshard_after_forward)

    @property
    def label(self) -> str:
        """How errors and debug fingerprints name this unit's collectives."""
        return self.name or "<root>"

    def emit(self, phase: str, collective: str, nbytes: int, start: float,
              wait: float = 0.0, end: float | None = None) -> None:
        ctx = self.ctx
        if ctx is not None and ctx.sinks:
            # The group the buffer was split over ([Note: communication bytes]).
            group = ({"all_reduce": self.mesh.replicate_size,
                      "all_gather": self._gather_size}.get(collective, self.mesh.shard_size)
                     if collective else 0)
            ev = Event(self.mesh.global_rank, self.name, phase, collective, nbytes, start,
                       now() if end is None else end, ctx.step, wait, group)
            for sink in ctx.sinks:
                sink(ev)
