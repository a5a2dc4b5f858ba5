"""One unit: the parameters of one `fully_shard` call, gathered and reduced together.

A unit moves all of its parameters through one flat buffer per communication dtype: one
all-gather to unshard, one reduce-scatter (plus an all-reduce across replicas for
HYBRID_SHARD, or only an all-reduce for NO_SHARD) to reduce gradients. State transitions
live here and are checked at entry (see `ShardedState`); *when* they happen is decided by
the step schedule (schedule.py). How bytes move is the mesh's transport (transport.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ..api.state import ShardwiseState
    from .context import ModelContext

from ..comm.transport import Transport
from .bucket import FlatBucket, PendingGather
from .buffers import BufferPool
from .events import Event, Span, now
from .extension import ExtGather, pack, unpack
from .hpz import Hpz, keep
from .mesh import MeshInfo
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy
from .reduce import PendingReduce, finish_reduce, reduce_bucket
from .schedule import ShardedState, TrainingState
from .sharded_param import ShardedParam
from .streams import ExposedWait, record


class Unit:
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
        # The per-model context (engine/context.py), set when this unit is sharded and
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

    def has_unreduced_grads(self) -> bool:
        """Whether a gradient waits for a reduction (a pure question: nothing moves).

        Under no_sync, decided alike on every rank: a backward ran for this unit (at the
        same point everywhere, [Note: structure decides]) that kept its gradients. Whether
        this rank holds any is its data's business (a parameter the micro-batches used on
        some ranks only): the unit still reduces on all of them.
        """
        return self.unsynced or any(p.has_local_grad() for g in self.buckets
                                    for p in g.grad_params)

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

    # --- unshard / reshard -------------------------------------------------------------

    def unshard(self, async_op: bool = True) -> None:
        """Issue the all-gather (idempotent: no-op unless SHARDED)."""
        if self.state is not ShardedState.SHARDED:
            return
        S, transport = self.mesh.shard_size, self.transport
        # [Note: hpZ] The rows kept after forward serve the backward that follows only.
        kept, self.post_forward = self.post_forward, None
        if kept is not None and not (self.ctx is not None and self.ctx.schedule.in_backward):
            kept = None
        if kept is not None:
            assert self.hpz is not None
            transport = self.hpz.transport
        self._gather_size = transport.size if S > 1 else 1
        streams = self.ctx.streams if self.ctx is not None else None
        if streams is not None and self.ctx.schedule.state is TrainingState.IDLE:  # type: ignore[union-attr]
            # An explicit unshard() between steps: the shards may have just been written.
            streams.copy_in.wait_stream(torch.cuda.current_stream(self.mesh.device))
        for i, g in enumerate(self.buckets):
            if S == 1 or g.numel == 0:
                continue  # nothing to gather; wait_unshard() casts/copies locally
            start = now()
            # What this rank sends: its shard, or under hpZ its block rows (S/k shards).
            n = g.numel if kept is None else g.numel * (S // transport.size)
            with _on(streams and streams.copy_in):  # [Note: streams]
                out = self.pool.get(g.numel * S, g.dtype, self.mesh.device)
                send = transport.gather_buffer(n, g.dtype, self.mesh.device, self.pool)
                shard = send[:n]
                with torch.no_grad():
                    if kept is not None:
                        shard.copy_(kept[i], non_blocking=True)  # type: ignore[arg-type]
                    else:
                        # Casts to the compute dtype and, under offload, copies host -> device.
                        torch._foreach_copy_([shard[off : off + p.chunk_numel] for p, off
                                              in zip(g.gathered, g.offsets)],
                                             [p.padded_shard.reshape(-1) for p in g.gathered],
                                             non_blocking=True)
            # all-to-all also replicates the shard into every peer's row.
            self.copied["gather_in"] += (n * shard.element_size()
                                         * (transport.size if transport.name == "all_to_all"
                                            else 1))
            if streams is not None:
                streams.all_gather.wait_stream(streams.copy_in)
                with _on(streams.all_gather):
                    # Synchronous on NCCL means: the all-gather stream waits, not the host.
                    work = transport.all_gather(out, send, n, False, label=self.label)
                    done = record(streams.all_gather)
                self._gathers.append(PendingGather(g, send, out, work, start, 0.0, done))
                continue
            with Span() as call:
                work = transport.all_gather(out, send, n, async_op, label=self.label)
            # A synchronous gather blocks inside the call: all of it is exposed.
            self._gathers.append(PendingGather(g, send, out, work, start,
                                               0.0 if async_op else call.seconds))
        if self.ext_params:
            self._ext_gather = self._gather_extensions(async_op, streams)
        self.state = ShardedState.GATHERING

    def _gather_extensions(self, async_op: bool, streams: Any) -> ExtGather:
        """The extension parameters' pre hooks and their one packed all-gather
        ([Note: all-gather extensions] in extension.py)."""
        start = now()
        with _on(streams and streams.copy_in):  # the hooks run where the copy-in does
            send, pg = pack(self, self.ext_params)
        pg.start = start
        numel, S = sum(pg.split), self.mesh.shard_size
        self.copied["gather_in"] += (numel * send.element_size()
                                     * (S if self.transport.name == "all_to_all" else 1))
        if S == 1:
            return pg  # the send row is the output: nothing to gather
        if streams is not None:
            streams.all_gather.wait_stream(streams.copy_in)
            with _on(streams.all_gather):
                pg.work = self.transport.all_gather(pg.out, send, numel, False,
                                                    label=self.label)
                pg.done = record(streams.all_gather)
            return pg
        with Span() as call:
            pg.work = self.transport.all_gather(pg.out, send, numel, async_op, label=self.label)
        pg.blocked = 0.0 if async_op else call.seconds
        return pg

    def _wait(self, pg: PendingGather | ExtGather) -> float:
        """Wait for a gather (CUDA: the compute stream waits); the exposed seconds."""
        if pg.done is not None:  # [Note: streams]
            return ExposedWait(pg.done, bool(self.ctx and self.ctx.sinks)).seconds
        with Span() as wait:
            pg.work.wait()
        return wait.seconds

    def wait_unshard(self) -> None:
        """Make the full parameters available on the modules (gathering first if needed)."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is ShardedState.SHARDED:
            self.unshard(async_op=False)
        S = self.mesh.shard_size
        with torch.no_grad():
            for pg in self._gathers:
                waited = self._wait(pg)
                self.pool.release(pg.send)
                rows = pg.out.view(S, pg.bucket.numel)
                for p in pg.bucket.gathered:
                    p.alloc_unsharded()
                # One fused copy (FSDP2's split_with_sizes_copy). The destinations are `.data`
                # views so the copy does not bump the autograd version counter that tensors
                # saved in forward check in backward (they alias this storage).
                dsts = [p.unsharded_rows_view() for p in pg.bucket.gathered]
                if all(d is not None for d in dsts):
                    torch.split_with_sizes_copy(rows, pg.bucket.sizes, dim=1, out=dsts)
                else:
                    # A parameter on another dim is copied into its own layout
                    # ([Note: layout] in sharded_param.py), on this (compute) stream too.
                    for p, part in zip(pg.bucket.gathered,
                                       rows.split(pg.bucket.sizes, dim=1)):
                        p.copy_out(part)
                self.copied["gather_out"] += pg.out.numel() * pg.out.element_size()
                self.pool.release(pg.out)
                self.emit("all_gather", "all_gather", pg.out.numel() * pg.out.element_size(),
                           pg.start, waited + pg.blocked)
            if self._ext_gather is not None:
                self._finish_extensions(self._ext_gather)
            if S == 1:
                for p in self.params:
                    if not p.direct and p.ext is None:
                        p.alloc_unsharded()
                        p.copy_out(p.padded_shard.view(1, -1), non_blocking=True)
        self._gathers.clear()
        for p in self.params:
            for ref in p.refs:
                ref.module._parameters[ref.name] = p.unsharded
        self.state = ShardedState.UNSHARDED

    def _finish_extensions(self, pg: ExtGather) -> None:
        self._ext_gather = None
        waited = self._wait(pg) if self.mesh.shard_size > 1 else 0.0
        if pg.pooled:
            self.pool.release(pg.send)
        unpack(self, pg)
        nbytes = pg.out.numel() * pg.out.element_size()
        self.copied["gather_out"] += nbytes
        if pg.pooled:
            self.pool.release(pg.out)
            self.emit("all_gather", "all_gather", nbytes, pg.start, waited + pg.blocked)

    def shards_changed_since_gather(self) -> bool:
        """Unsharded, and some shard was written since it was gathered: this rank's rows of
        a gathered parameter are no longer its shard, cast as the gather cast it.

        Compared by value, not by version counters: torch's fused optimizers and writes
        through `.data` bump none. Only units still gathered at a forward's start pay it (a
        forward that no backward followed, reshard_after_backward=False).
        """
        if self.state is not ShardedState.UNSHARDED:
            return False
        for p in self.params:
            if p.ext is not None:
                return True  # what its hooks gathered cannot be compared to the shard
            if p.direct:
                continue
            mine = p.gathered_local_rows()
            if not torch.equal(mine, p.local.to(device=mine.device, dtype=mine.dtype)):
                return True
        return False

    def reshard(self) -> None:
        """Free the full parameters; the modules see the shards again. In forward under
        hpZ, this rank's block rows are kept for backward first ([Note: hpZ])."""
        if self.state is ShardedState.SHARDED:
            if self.training_state is not TrainingState.FORWARD:
                self.post_forward = None  # backward is over (or never came)
            return
        if self.state is ShardedState.GATHERING:
            # Collectives must complete on every rank before their buffers go back.
            self.wait_unshard()
        start = now()
        if (self.hpz is not None and self.training_state is TrainingState.FORWARD
                and torch.is_grad_enabled() and not self.ext_params):
            self.post_forward = keep(self, self.hpz)
        for p in self.params:
            for ref in p.refs:
                ref.module._parameters[ref.name] = p.sharded
            p.free_unsharded()
        self.state = ShardedState.SHARDED
        self.emit("reshard", "", 0, start)

    # --- gradients ----------------------------------------------------------------------

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


def _on(stream: Any) -> Any:
    """Run the block on `stream` (CUDA), or where it runs now (None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
