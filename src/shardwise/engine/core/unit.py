"""One unit: the parameters of one `fully_shard` call, gathered and reduced together.

A unit moves all of its parameters through one flat buffer per communication dtype: one
all-gather to unshard, one reduce-scatter (plus an all-reduce across replicas for
HYBRID_SHARD, or only an all-reduce for NO_SHARD) to reduce gradients. State transitions
live in the unit and are checked at entry (see `ShardedState`); *when* they happen is decided by
the step schedule (schedule.py). How bytes move is the mesh's transport (transport.py).

This file holds `Unit` whole (its state and layout, its gather half: unshard / wait_unshard /
reshard, its reduce half: reduce_grads / finish_reduce and no_sync accumulation) with what
only it uses: the side streams ([Note: streams]), the buffer pool, the flat buckets, the
packing of gradients, hpZ's kept rows, the extension parameters' packed all-gather and the
reduction in flight (`PendingReduce`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

from ..comm import collectives as C
from ..comm.process_group import block_group
from ..comm.transport import Transport, transport_for
from ..comm.work import Work
from . import dtensor as DT
from .events import Event, EventSink, Span, now
from .layout import full_into_rows
from .policies import DEFAULT_COALESCE_BYTES, CPUOffloadPolicy, MeshInfo, MixedPrecisionPolicy
from .schedule import Coalesce, Schedule, ShardedState, TrainingState
from .sharded_param import ShardedParam

if TYPE_CHECKING:
    from .dtensor import TPContext


# --------------------------------------------------------------------------------------------------
# The side streams of one model on a GPU, and how the exposed wait on them is measured.
#
# [Note: streams] On CUDA a unit's collectives run off the compute stream, as in FSDP2:
#
# - the copy of the shards into the all-gather's send buffer runs on `copy_in`, and the
#   all-gather itself on `all_gather` (waiting for the copy-in by an event), so a prefetch
#   issued while unit i computes does not queue behind unit i's kernels;
# - the reduce-scatter runs on `reduce_scatter`, after the compute stream packed the
#   gradients (the gradients are freed on the stream that made them); under HYBRID_SHARD
#   the all-reduce across replicas follows at once on `all_reduce`, waiting for the
#   reduce-scatter by an event (FSDP2's order), and the compute stream waits for it;
# - hpZ's kept rows ([Note: hpZ]) are written on the compute stream after forward and read
#   by `copy_in` in backward: an event recorded after the write is waited by `copy_in`
#   before the read, and the rows are recorded on `copy_in` (`record_stream`) so that
#   freeing them after the gather does not hand their memory out before the read ran;
# - the compute stream waits for a gather or a reduction by an event (`wait_event`), never the
#   host: no host-device sync that FSDP2 does not make;
# - the two all-gather streams wait for the compute stream once per step, at the root's
#   forward (or for the event given to `set_post_optim_event`), so that the optimizer's
#   updates of the shards are visible to the step's gathers and nothing later is waited for.
#
# Pooled buffers cross streams, so `BufferPool` (unit.py) records an event on the stream
# that releases a buffer and makes the stream that takes it next wait for that event.
#
# On CPU none of this exists (`streams_for` returns None) and collectives run as before.


class Streams:
    """FSDP2's communication streams on one CUDA device (high priority)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_in: Any = torch.cuda.Stream(device=device, priority=-1)
        self.all_gather: Any = torch.cuda.Stream(device=device, priority=-1)
        self.reduce_scatter: Any = torch.cuda.Stream(device=device, priority=-1)
        # HYBRID_SHARD: the all-reduce across replicas, right after the reduce-scatter.
        self.all_reduce: Any = torch.cuda.Stream(device=device, priority=-1)

    def step_starts(self, event: Any = None) -> None:
        """The root's forward: the gathers may read what the compute stream (or the
        optimizer's stream, through `event`) wrote to the shards so far."""
        for s in (self.copy_in, self.all_gather):
            if event is not None:
                s.wait_event(event)
            else:
                s.wait_stream(torch.cuda.current_stream(self.device))


def streams_for(device: torch.device) -> Streams | None:
    return Streams(device) if device.type == "cuda" else None


def record(stream: Any) -> Any:
    """An event marking the work queued on `stream` so far."""
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class ExposedWait:
    """How long the compute stream stood still waiting for `event` (CUDA, traced runs only).

    Host time around a `wait_event` reads about 0: the host does not wait. Two timing events
    on the compute stream around the wait measure the stall on the device itself; reading
    them is a host sync, paid only when a trace or the explorer asked for events.
    """

    def __init__(self, event: Any, timed: bool) -> None:
        stream = torch.cuda.current_stream()
        self.start = self.end = None
        if timed:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(stream)
        stream.wait_event(event)
        if timed:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(stream)

    @property
    def seconds(self) -> float:
        if self.start is None or self.end is None:
            return 0.0
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


class UnitContext(Protocol):
    """What a unit reads of its model's context (context.py's ModelContext, which holds the
    units and so is defined above this file): the schedule's phase, the event sinks, the
    side streams and the step count."""

    schedule: Schedule[Any]
    sinks: list[EventSink]
    streams: Streams | None
    step: int


# --------------------------------------------------------------------------------------------------
# Reusable flat communication buffers.
#
# All-gather outputs and reduce-scatter inputs are unit-sized and short-lived; allocating them
# fresh for every unit of every step is pure allocator churn. A pool per (dtype, device) hands
# out the smallest free buffer that is large enough (a slice of it) and takes it back when the
# collective that used it has completed. At most two all-gathers and two reduce-scatters are in
# flight, so the pool never holds more than a few unit-sized buffers.
#
# On CUDA a buffer crosses streams ([Note: streams] in unit.py): the stream that releases it
# records an event, and the stream that takes it next waits for that event before using it.


class BufferPool:
    def __init__(self, max_free: int = 4) -> None:
        # Free buffers per (dtype, device); each is a flat tensor.
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # CUDA: id(buffer) -> the event recorded where it was released.
        self._released: dict[int, Any] = {}
        self._max_free = max_free
        # Bytes currently allocated by the pool (free and lent), for memory accounting.
        self.allocated_bytes = 0

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of exactly `numel` elements (a view of a pooled buffer)."""
        free = self._free.setdefault((dtype, torch.device(device)), [])
        best = None
        for i, buf in enumerate(free):
            if buf.numel() >= numel and (best is None or buf.numel() < free[best].numel()):
                best = i
        if best is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.allocated_bytes += buf.numel() * buf.element_size()
        else:
            buf = free.pop(best)
            ev = self._released.pop(id(buf), None)
            if ev is not None:
                torch.cuda.current_stream(buf.device).wait_event(ev)
        return buf[:numel] if buf.numel() != numel else buf

    def release(self, view: torch.Tensor) -> None:
        """Give back a tensor obtained from `get` (its whole underlying buffer)."""
        base = view._base if view._base is not None else view
        free = self._free.setdefault((base.dtype, base.device), [])
        free.append(base)
        if base.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(base.device))
            self._released[id(base)] = ev
        if len(free) > self._max_free:
            free.sort(key=lambda t: t.numel())
            dropped = free.pop(0)
            self._released.pop(id(dropped), None)
            if dropped.is_cuda:
                # Freed here, but other streams may still be reading it: the allocator waits.
                dropped.record_stream(torch.cuda.current_stream(dropped.device))
            self.allocated_bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        self._free.clear()
        self._released.clear()
        self.allocated_bytes = 0


# --------------------------------------------------------------------------------------------------
# A unit's flat layout per communication dtype (`FlatBucket`) and a gather in flight.
#
# One all-gather and one reduction per bucket move all of its parameters ([Note: layout] in
# sharded_param.py for one parameter's rows).


@dataclass
class FlatBucket:
    """Parameters of a unit that share a communication dtype, and their flat layout."""

    dtype: torch.dtype
    params: list[ShardedParam]
    # Gathered through this bucket's flat chunk: all but the extension parameters, which
    # the unit gathers by their hooks ([Note: all-gather extensions]); they reduce here.
    gathered: list[ShardedParam] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # into one rank's all-gather chunk
    numel: int = 0  # one rank's chunk
    grad_params: list[ShardedParam] = field(default_factory=list)
    grad_offsets: list[int] = field(default_factory=list)
    grad_numel: int = 0
    sizes: list[int] = field(default_factory=list)  # each gathered parameter's chunk

    # The reduction's "has a gradient" flags when every parameter has one, per reduce dtype
    # (made once per layout: the bucket is rebuilt when the layout changes).
    _all_flags: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    # What the per-step loops read (BucketHot), made at first use.
    _hot: BucketHot | None = None

    def all_flags(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ones = self._all_flags.get(dtype)
        if ones is None:
            ones = self._all_flags[dtype] = torch.ones(len(self.grad_params), dtype=dtype,
                                                       device=device)
        return ones

    def hot(self) -> BucketHot:
        """The bucket's per-step views and lists; remade after any parameter was rebuilt
        (`ShardedParam.rebuilds`), the bucket itself being remade when the layout changes."""
        h = self._hot
        if h is None or h.rebuilds != ShardedParam.rebuilds:
            h = self._hot = BucketHot(self)
        return h

    def __post_init__(self) -> None:
        for p in self.params:
            if p.ext is None:
                self.gathered.append(p)
                self.sizes.append(p.chunk_numel)
                self.offsets.append(self.numel)
                self.numel += p.chunk_numel
            if p.requires_grad:
                self.grad_params.append(p)
                self.grad_offsets.append(self.grad_numel)
                self.grad_numel += p.chunk_numel


class BucketHot:
    """One bucket's parameters as the per-step loops use them, computed once per layout:
    per step a unit then pays one op per bucket, not one call chain per parameter (the
    host's cost of a small unit, issue 43; [Note: layout] in sharded_param.py)."""

    def __init__(self, g: FlatBucket) -> None:
        self.rebuilds = ShardedParam.rebuilds
        # The gathered parameters' unsharded storages and their sizes (direct ones have
        # none: the sharded parameter is the unsharded one).
        self.allocs = [(p._storage, p._nbytes) for p in g.gathered
                       if not (p.direct or p.whole) and p._storage is not None]
        # Where the gathered rows go, (S, chunk) each: None when a parameter on another dim
        # is copied into its own layout instead (`ShardedParam.copy_out`).
        dsts = [p.unsharded_rows_view() for p in g.gathered]
        self.rows_dsts = dsts if all(d is not None for d in dsts) else None
        # One rank (nothing gathered): the shards straight into the unsharded parameters,
        # one fused copy for the dim-0 ones, `copy_out` for the others.
        # ([Note: one rank's parameters]: a whole one's unsharded parameter is its shard.)
        local = [p for p in g.gathered if not (p.direct or p.whole)]
        self.local_dsts = [p._rows for p in local if p._rows is not None]
        self.local_srcs = [p.padded_shard.view(1, -1) for p in local if p._rows is not None]
        self.local_other = [p for p in local if p._rows is None]
        # Per gradient parameter: its rows in the reduce output and the shape of `local`.
        self.grads = [(p, off, p.local_rows * p.row_numel, p.local.shape)
                      for p, off in zip(g.grad_params, g.grad_offsets)]
        # Packing as one concatenation of (S, chunk) views: each gradient splits into S
        # equal chunks (dim 0, no padding row, not 0-d), as `pack_grad` would lay it out.
        self.grad_rows = [(p.shard_size, p.chunk_numel) for p in g.grad_params]
        self.pack_fused = all(p.shard_dim == 0 and not p.scalar and p.chunk_rows > 0
                              and p.dim0 == p.shard_size * p.chunk_rows
                              for p in g.grad_params)
        # [Note: one rank's gradients] Whether every gradient, as autograd leaves it, already
        # is its sharded gradient: one shard of everything, in the parameter's dtype, layout
        # and device (a DTensor face on a one-rank mesh; a direct parameter is autograd's own).
        self.whole = bool(g.grad_params) and all(
            p.shard_size == 1 and not p.direct and p.compute_dtype == p.orig_dtype == g.dtype
            and p.host_device == p.device and p.shard_dim == 0 and not p.scalar
            and p.tp is None and not p.subclass and p.ext is None
            and tuple(p.local.shape) == tuple(p.orig_shape) for p in g.grad_params)


class UnitHot:
    """A unit's per-layout lists for the per-step swaps, frees and checks (see BucketHot)."""

    def __init__(self, unit: Unit) -> None:
        self.rebuilds = ShardedParam.rebuilds
        places = [(ref.module._parameters, ref.name, p) for p in unit.params for ref in p.refs]
        # What the modules hold unsharded and sharded, per place a module refers to.
        self.to_unsharded = [(d, n, p.unsharded) for d, n, p in places]
        self.to_sharded = [(d, n, p.sharded) for d, n, p in places]
        self.sharded = [p.sharded for p in unit.params]
        self.frees = [p._storage for p in unit.params
                      if not (p.direct or p.whole) and p._storage is not None]
        # Every unsharded parameter is its shard's storage ([Note: one rank's parameters]):
        # a gather on one rank moves nothing, and what is gathered is never stale.
        self.shares_all = all(p.direct or p.whole for p in unit.params)
        self.exts = [p.ext for p in unit.params if p.ext is not None]
        # The tensor each parameter's all-gather hooks would be found on, and whether it had
        # them: `extensions_changed` asks both names of each, as refresh_extension does.
        self.probe = [(DT.local_of(p.sharded), p.ext is not None) for p in unit.params]
        # Where the user's requires_grad flag is read (follow_requires_grad).
        self.flags = [(p.refs[0].module._parameters, p.refs[0].name, p) for p in unit.params]

    def extensions_changed(self) -> bool:
        """Whether some parameter's shard gained or lost FSDP2's all-gather hooks."""
        for t, had in self.probe:
            if (hasattr(t, "fsdp_pre_all_gather") or hasattr(t, "fsdp_post_all_gather")) != had:
                return True
        return False


def _alloc_all(allocs: list[tuple[Any, int]]) -> None:
    for storage, nbytes in allocs:
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)


@dataclass
class PendingGather:
    bucket: FlatBucket
    send: torch.Tensor  # pooled; given back once the gather is waited for
    out: torch.Tensor  # the rank-major output
    work: Work
    start: float
    blocked: float = 0.0  # seconds a synchronous all-gather held the caller inside the call
    # CUDA: an event after the all-gather on its own stream ([Note: streams]); None on CPU.
    done: Any = None
    # [Note: coalesced units] The group's one all-gather this bucket is part of, and where
    # its columns start in the group's rows (then `send` is None and `out` the group's).
    shared: SharedGather | None = None
    col: int = 0


@dataclass(eq=False)
class SharedGather:
    """One all-gather for a group of units ([Note: coalesced units] in schedule.py): waited
    for by the first member that needs it, its buffers given back by the last."""

    lead: Unit
    send: torch.Tensor
    out: torch.Tensor
    numel: int  # one rank's chunk: the members' chunks side by side
    left: int  # members that have not copied their columns out yet
    members: list[Unit] = field(default_factory=list)
    waited: float | None = None  # the exposed seconds of the one wait, once waited

    def rows(self, S: int, col: int, numel: int) -> torch.Tensor:
        return self.out.view(S, self.numel)[:, col : col + numel]

    def release(self, start: float, blocked: float) -> None:
        self.left -= 1
        if self.left:
            return
        lead = self.lead
        lead.pool.release(self.send)
        lead.pool.release(self.out)
        # One event per member, each with its own columns' bytes and the interval of the
        # one collective; the wait on the first only. So traces and the explorer see every
        # unit's gather, and the sums (bytes, exposed seconds; comm time is a union of
        # intervals) are the collective's (observe/overlap.py).
        S, size = lead.mesh.shard_size, self.out.element_size()
        end = now()
        for i, u in enumerate(self.members):
            u.emit("all_gather", "all_gather", u.buckets[0].numel * S * size, start,
                   (self.waited or 0.0) + blocked if i == 0 else 0.0, end)


def gather_together(units: Sequence[Unit], async_op: bool) -> None:
    """Issue one all-gather for `units` (sharded, on the same `coalesce()` key), each member's
    chunk after the previous one's in every rank's row ([Note: coalesced units])."""
    lead = units[0]
    mesh, transport, S = lead.mesh, lead.transport, lead.mesh.shard_size
    dtype = lead.buckets[0].dtype
    cols, total = [], 0
    for u in units:
        cols.append(total)
        total += u.buckets[0].numel
    streams = lead.ctx.streams if lead.ctx is not None else None
    start = now()
    with _on(streams and streams.copy_in):  # [Note: streams]
        out = lead.pool.get(total * S, dtype, mesh.device)
        send = transport.gather_buffer(total, dtype, mesh.device, lead.pool)
        shard = send[:total]
        dsts, srcs = [], []
        for u, col in zip(units, cols):
            g = u.buckets[0]
            for p, off in zip(g.gathered, g.offsets):
                dsts.append(shard[col + off : col + off + p.chunk_numel])
                srcs.append(p.padded_shard.reshape(-1))
            u.copied["gather_in"] += (g.numel * shard.element_size()
                                      * (transport.size if transport.name == "all_to_all"
                                         else 1))
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
    done, blocked = None, 0.0
    if streams is not None:
        streams.all_gather.wait_stream(streams.copy_in)
        with _on(streams.all_gather):
            work = transport.all_gather(out, send, total, False, label=lead.label)
            done = record(streams.all_gather)
    else:
        with Span() as call:
            work = transport.all_gather(out, send, total, async_op, label=lead.label)
        blocked = 0.0 if async_op else call.seconds
    shared = SharedGather(lead, send, out, total, len(units), list(units))
    for u, col in zip(units, cols):
        u._gathers.append(PendingGather(u.buckets[0], None, out, work, start, blocked, done,
                                        shared, col))
        u._gather_size = transport.size
        u.post_forward = None
        u.state = ShardedState.GATHERING


# --------------------------------------------------------------------------------------------------
# Gradients into a unit's reduce buffer: rank-major rows, zero-padded, pre-divided.
#
# [Note: divide in the pack] A power-of-two divide is exact, so dividing each rank's gradient
# before the sum gives the same bits as after it, and costs nothing inside the pack (one pass
# instead of a separate one over the reduced shard). Other factors divide after the sum.


def prescale(factor: float) -> float | None:
    """1/factor when the divide can go into the pack exactly (a power of two), else None."""
    if factor == 1 or factor <= 0 or math.frexp(factor)[0] != 0.5:
        return None
    return 1.0 / factor


# A scaled fused pack copies, then scales in place: two passes over the buffer where the
# per-parameter `pack_grad` makes one. Below this many elements the per-parameter calls
# cost more than the second pass. Only where the gradients are in the reduce dtype: a cast
# before the scale rounds as the per-parameter pack (which scales, then casts) may not.
_FUSED_SCALED_MAX = 1 << 16


def pack_grad(p: ShardedParam, grad: torch.Tensor | None, dst: torch.Tensor,
               scale: float | None = None) -> None:
    """Copy p's unsharded gradient (times `scale`) into (S, C*row_numel) rank-major rows,
    zero-padded."""
    if grad is None:
        dst.zero_()
        return
    if p.shard_dim != 0:
        # The gradient is in the parameter's own (contiguous) layout: strided copies of
        # its rows straight into the buffer, no temporary ([Note: layout]).
        full_into_rows(grad, dst, p.shard_dim, p.chunk_rows, 0, scale)
        return
    flat = grad.reshape(-1)
    chunk = p.chunk_numel
    if p.chunk_rows == 0:
        return  # dim 0 has size 0: nothing to send (and no rows to divide by)

    def put(d: torch.Tensor, src: torch.Tensor) -> None:
        torch.mul(src, scale, out=d) if scale is not None else d.copy_(src)

    if p.scalar:
        # Every rank's row: each is handed the whole reduced gradient ([Note: 0-d parameters]).
        put(dst, flat.view(1, 1).expand(dst.shape))
        return

    full_ranks = p.dim0 // p.chunk_rows
    if full_ranks:
        put(dst[:full_ranks], flat[: full_ranks * chunk].view(full_ranks, chunk))
    tail = flat.numel() - full_ranks * chunk
    if full_ranks < dst.shape[0]:
        if tail:
            put(dst[full_ranks, :tail], flat[full_ranks * chunk :])
        dst[full_ranks, tail:].zero_()
        dst[full_ranks + 1 :].zero_()


# --------------------------------------------------------------------------------------------------
# hpZ: after forward, keep each parameter sharded over a block of k ranks, not all S.
#
# [Note: hpZ] `fully_shard(m, reshard_after_forward=k)` with k a proper divisor of the
# shard-group size S is FSDP2's int form (ZeRO++'s hierarchical partitioning). The shard
# group is cut into S/k blocks of k consecutive ranks (FSDP2's `(S/k, k)` post-forward mesh;
# this rank is number `shard_rank % k` of its block). After forward a unit keeps, of each
# bucket's gathered rows, the S/k rows that belong to its block position (rows
# `[j * S/k, (j + 1) * S/k)` of the rank-major `(S, numel)` layout, in the compute dtype)
# and frees the rest. Backward's all-gather then runs within the block: each rank sends S/k
# rows and receives k times that, so the block's all-gather output is the full rank-major
# buffer again, copied out exactly as a shard-group gather is. The post-backward reshard
# returns to the 1/S shard; the reduce-scatter is over the whole shard group as before.
#
# Per rank, backward's all-gather moves (k-1)/k of a unit's gathered bytes over k ranks
# (native: sends 1/k of them) instead of (S-1)/S over S ranks; between forward and backward
# each rank holds 1/k of a unit's compute-dtype parameters instead of 1/S.
#
# The kept rows are used only by the backward that follows: a gather outside backward (the
# next forward, an explicit `unshard()`) drops them and gathers the shards, which an optimizer
# step may have changed since. A forward without grad mode (evaluation) reshards fully, and
# so does a unit holding all-gather extension parameters (their hooks gather per parameter;
# FSDP2 gathers those within its post-forward mesh only when each has a single output).


@dataclass(frozen=True)
class Hpz:
    """A unit's post-forward block: k consecutive ranks of its shard group."""

    k: int
    group: ProcessGroup
    transport: Transport  # how the block's all-gather moves bytes
    rows: int  # S / k: rows of the rank-major gather layout this rank keeps
    first_row: int  # (shard_rank % k) * rows


def check_hpz(k: int, mesh: MeshInfo, tp: TPContext | None, where: str) -> None:
    """Refuse what hpZ does not cover, before any group is made ([Note: hpZ])."""
    if mesh.replicate_size > 1:
        raise NotImplementedError(
            f"{where}: reshard_after_forward={k} (hpZ, groups of {k} of the "
            f"{mesh.shard_size} shard ranks) on a HYBRID_SHARD mesh ({mesh.replicate_size} "
            "replicas) is not supported: pass a 1-D mesh, or True/False")
    if tp is not None:
        # FSDP2 refuses it for DTensor (tensor-parallel) parameters too.
        raise NotImplementedError(
            f"{where}: reshard_after_forward={k} (hpZ) with tensor-parallel parameters is "
            "not supported (nor in FSDP2): use True or False")


def check_params(unit: Unit, k: int) -> None:
    """Tensor subclasses (NF4, float8) gather through their own hooks: refused with hpZ."""
    subs = [p.fqn for p in unit.params if p.subclass]
    if subs:
        raise NotImplementedError(
            f"reshard_after_forward={k} (hpZ) with tensor-subclass parameters {subs} is not "
            "supported: use True or False for this module")


def enable(unit: Unit, k: int) -> None:
    """Give a freshly sharded unit its post-forward block of `k` ranks."""
    check_params(unit, k)
    unit.hpz = make(unit.mesh, k)


def make(mesh: MeshInfo, k: int) -> Hpz:
    """This rank's block of `k` ranks (the group is made once per block, comm/process_group.py)."""
    S = mesh.shard_size
    assert 1 < k < S and S % k == 0, f"hpZ block {k} of a shard group of {S}"
    group = block_group(mesh.shard_group, k)
    rows = S // k
    return Hpz(k, group, transport_for(group), rows, (mesh.shard_rank % k) * rows)


@dataclass
class KeptRows:
    """What hpZ keeps from forward to backward: per bucket, this rank's block rows."""

    rows: list[torch.Tensor | None]  # (rows * numel,) in the compute dtype; None: empty
    # CUDA: an event on the compute stream after the rows were written ([Note: streams]).
    written: Any = None

    def hand_to(self, stream: Any, rows: torch.Tensor) -> None:
        """`stream` reads `rows` next: it waits for their write, and the allocator keeps
        their memory until that read ran, wherever the last reference is dropped."""
        if self.written is not None:
            stream.wait_event(self.written)
        rows.record_stream(stream)


def keep(unit: Unit, hpz: Hpz) -> KeptRows:
    """Per bucket, this rank's rows of the gathered layout, copied out of the unsharded
    parameters before they are freed: (rows * numel,) in the compute dtype."""
    lo, hi = hpz.first_row, hpz.first_row + hpz.rows
    kept: list[torch.Tensor | None] = []
    with torch.no_grad():
        for g in unit.buckets:
            if g.numel == 0:
                kept.append(None)
                continue
            out = torch.empty((hpz.rows, g.numel), dtype=g.dtype, device=unit.mesh.device)
            views = [p.unsharded_rows_view() for p in g.gathered]
            if all(v is not None for v in views):
                torch.cat([v[lo:hi] for v in views], dim=1, out=out)  # type: ignore[index]
            else:
                # A parameter on another dim holds its own layout, not rows: its rows are
                # copied out of it ([Note: layout] in sharded_param.py).
                for p, off in zip(g.gathered, g.offsets):
                    p.rows_into(out[:, off: off + p.chunk_numel], lo)
            kept.append(out.view(-1))
    device = unit.mesh.device
    written = record(torch.cuda.current_stream(device)) if device.type == "cuda" else None
    return KeptRows(kept, written)


# ---- the unit's extension all-gather ([Note: all-gather extensions] in sharded_param.py)


def torch_mp(unit: Unit) -> TorchMP:
    """The unit's mixed precision as FSDP2's class (what a 5-argument pre hook receives)."""
    mp = unit.mp
    if mp is None:
        return TorchMP()
    return TorchMP(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                   output_dtype=mp.output_dtype, cast_forward_inputs=mp.cast_forward_inputs)


@dataclass
class ExtGather:
    """A unit's extension all-gather in flight: every extension parameter's inputs packed."""

    params: list[ShardedParam]
    numels: list[list[int]]  # per parameter, per input: elements in the input's dtype
    dtypes: list[list[torch.dtype]]
    split: list[int]  # per input: elements in the packed dtype (one rank's row)
    send: torch.Tensor  # pooled (given back once waited for); the output itself when S == 1
    out: torch.Tensor
    work: Work
    start: float
    blocked: float = 0.0
    done: Any = None  # CUDA: an event after the all-gather ([Note: streams])
    pooled: bool = True  # False when S == 1: send and out are one fresh tensor


def pack(unit: Unit, params: list[ShardedParam]) -> tuple[torch.Tensor, ExtGather]:
    """Run the pre hooks, copy every input into one send buffer (bytes when dtypes differ).

    Returns (the send row, the gather without its work) for the caller to issue.
    """
    with torch.no_grad():  # as FSDP2 calls them: what the hooks compute is not autograd's
        mp = torch_mp(unit)
        per = [p.ext.inputs(mp) for p in params]  # type: ignore[union-attr]
    dtypes = [[t.dtype for t in ts] for ts in per]
    numels = [[t.numel() for t in ts] for ts in per]
    flat = [t for ts in per for t in ts]
    dtype = flat[0].dtype
    if len({t.dtype for t in flat}) > 1 or (dtype.is_floating_point and dtype.itemsize == 1):
        # Mixed dtypes as bytes (FSDP2's rule); float8 too, which gloo cannot move (an
        # all-gather copies bits, so bytes are the same gather).
        dtype = torch.uint8
        flat = [t.contiguous().view(torch.uint8) for t in flat]
    split = [t.numel() for t in flat]
    numel = sum(split)
    S, device = unit.mesh.shard_size, unit.mesh.device
    if S == 1:
        send = out = torch.empty(numel, dtype=dtype, device=device)
        pooled = False
    else:
        out = unit.pool.get(numel * S, dtype, device)
        send = unit.transport.gather_buffer(numel, dtype, device, unit.pool)
        pooled = True
    with torch.no_grad():
        torch.cat(flat, out=send[:numel])
    pg = ExtGather(list(params), numels, dtypes, split, send, out, Work(None, out), 0.0,
                   pooled=pooled)
    return send, pg


def unpack(unit: Unit, pg: ExtGather) -> None:
    """The gathered rows into each parameter's outputs, then its post hook."""
    S = unit.mesh.shard_size
    views: list[torch.Tensor] = []
    for p, numels, dtypes in zip(pg.params, pg.numels, pg.dtypes):
        for o in p.ext.outputs_for(numels, dtypes, S, unit.mesh.device):  # type: ignore[union-attr]
            v = o.view(S, -1)
            views.append(v.view(torch.uint8) if pg.out.dtype is torch.uint8 else v)
    rows = pg.out.view(S, -1)
    # The outputs may be what autograd saved in forward (a post hook that returns them):
    # refilling them in backward must not bump the version it checks (FSDP2 does the same).
    live = tuple(v for v in views if not v.is_inference())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(live):
        torch.split_with_sizes_copy(rows, pg.split, dim=1, out=views)
    for p in pg.params:
        p.ext.post()  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------------
# A unit's gradient reduction: pack, reduce-scatter, divide, write the shards.
#
# The unit decides *that* its gradients reduce (unit.py, called by the schedule); this file
# is *how*: one reduction per flat bucket, in flight as a `PendingReduce` until the schedule
# finishes it, which writes the reduced rows into the sharded gradients. Every gradient is
# copied into one rank-major buffer (unit.py) that the transport reduce-scatters.


@dataclass
class PendingReduce:
    unit: Unit
    bucket: FlatBucket
    send: torch.Tensor | None  # a pooled buffer to give back when finished (or None)
    out: torch.Tensor
    work: Work
    start: float
    # Indices (into the bucket's grad_params) of the parameters this rank had no gradient
    # for: only their counts can be 0 ([Note: unused gradients]); empty: no count is read.
    missing: tuple[int, ...] = ()
    # What is left to divide by after the sum (1: the pack divided already, [Note: divide
    # in the pack]).
    post: float = 1.0
    # Set once the result is in the sharded gradients: finishing twice would release the
    # send buffer twice and add the gradient twice.
    finished: bool = False
    # CUDA: an event after the reduce-scatter (HYBRID_SHARD: and the all-reduce after it),
    # each on its own stream ([Note: streams]).
    done: Any = None
    # HYBRID_SHARD on CUDA: the all-reduce across replicas was issued right after the
    # reduce-scatter, so finishing only waits for it.
    all_reduced: bool = False

    def finish(self) -> None:
        """Wait for the reduction and write its result (idempotent)."""
        if not self.finished:
            self.finished = True
            finish_reduce(self.unit, self)


def reduce_bucket(unit: Unit, g: FlatBucket) -> PendingReduce | None:
    """Issue the reduction of one bucket's gradients (async); None: nothing to reduce.

    [Note: unused gradients] A parameter that no rank computed a gradient for keeps
    `.grad = None` (as in DDP and FSDP2), so the optimizer skips it instead of stepping
    it from zeros. Each rank's row of the reduce buffer ends with one flag per
    parameter (1 where this rank has a gradient); reduced, the flags count the ranks
    that contributed, and every rank reads the same counts.
    """
    mesh, S = unit.mesh, unit.mesh.shard_size
    # Reduced even when this rank has no gradient at all: another rank may have one, and
    # the schedule calls this at the same point on every rank ([Note: structure decides]).
    grads = [p.local_grad() for p in g.grad_params]
    if mesh.dp_size == 1:
        if all(p.direct for p in g.grad_params):
            return None  # one rank, no casts: the gradients already are the result
        if (g.hot().whole and unit.reduce_dtype_for[g.dtype] == g.dtype
                and unit.all_reduce_hook is None and not unit.force_sum_reduction
                and unit.grad_divide_factor in (None, 1) and _hand_over(unit, g, grads)):
            return None
    start = now()
    dtype = unit.reduce_dtype_for[g.dtype]
    width = g.grad_numel + len(g.grad_params)
    # With S == 1 the packed buffer becomes the gradients: not pooled.
    send = (unit.pool.get(width * S, dtype, mesh.device) if S > 1
            else torch.empty(width, dtype=dtype, device=mesh.device))
    missing, post = _pack(unit, g, grads, send.view(S, width))
    if S > 1:
        out = torch.empty(width, dtype=dtype, device=mesh.device)
        streams = unit.ctx.streams if unit.ctx is not None else None
        if streams is not None:
            # [Note: streams]: packed on the compute stream (which frees the gradients), then
            # reduced on the reduce-scatter stream; `send` and `out` stay referenced by the
            # pending reduction until the compute stream waited for `done`.
            rs = streams.reduce_scatter
            rs.wait_stream(torch.cuda.current_stream(mesh.device))
            with torch.cuda.stream(rs):
                work = unit.transport.reduce_scatter(out, send, False, unit.pool,
                                                     label=unit.label)
                done = record(rs)
            all_reduced = mesh.replicate_size > 1 and unit.requires_all_reduce
            if all_reduced:
                # HYBRID_SHARD: the all-reduce across replicas on its own stream, right
                # after the reduce-scatter (FSDP2's order), not later on the compute stream.
                ar = streams.all_reduce
                ar.wait_event(done)
                with torch.cuda.stream(ar):
                    out = _take_deferred(unit, g, out)
                    work = C.all_reduce(out, mesh.replicate_group, async_op=False,
                                        label=unit.label)
                    done = record(ar)
            return PendingReduce(unit, g, send, out, work, start, missing, post, done=done,
                                 all_reduced=all_reduced)
        work = unit.transport.reduce_scatter(out, send, True, unit.pool, label=unit.label)
        return PendingReduce(unit, g, send, out, work, start, missing, post)
    work = (C.all_reduce(send, mesh.replicate_group, async_op=True, label=unit.label)
            if mesh.replicate_size > 1 else Work(None, send))
    return PendingReduce(unit, g, None, send, work, start, missing, post)


# [Note: one rank's gradients] With one rank and no replicas the reduction is the identity
# (a sum over one rank, divided by one), and FSDP2 still packs each gradient into a buffer,
# "reduces" it and copies it out again: two copies and a dozen host ops per unit. Where
# autograd's gradient already has the sharded gradient's dtype, shape and device, it becomes
# the sharded gradient itself (or is added to it). Only a tensor that owns its whole storage
# is handed over: the optimizer and `clip_grad_norm_` write gradients in place, which must
# never reach a tensor something else still reads.


def _hand_over(unit: Unit, g: FlatBucket, grads: list[torch.Tensor | None]) -> bool:
    """One rank: make each local gradient the sharded one, no pack and no copy; False (and
    nothing changed) where some gradient is not a whole contiguous tensor of its own."""
    for x in grads:
        if x is not None and (x._base is not None or not x.is_contiguous()
                              or x.storage_offset() != 0
                              or x.untyped_storage().nbytes() != x.nbytes):
            return False
    unsure = unit.unsure
    with _NoGrad():
        for p, x in zip(g.grad_params, grads):
            if x is None:
                continue  # no gradient on the only rank: it stays as it was
            p.drop_local_grad()
            unsure.used(p)
            sharded = p.sharded
            if sharded.grad is None:
                # set_shard_grad's work for a whole parameter: its face is the rows, its spec
                # the parameter's own object.
                sharded.grad = DT.wrap(x, sharded._spec)
            else:
                p.shard_grad.add_(x)  # type: ignore[union-attr]
            p.run_post_accumulate_hooks()
    return True


def _pack(unit: Unit, g: FlatBucket, grads: list[torch.Tensor | None],
          rows: torch.Tensor) -> tuple[tuple[int, ...], float]:
    """Pack the bucket's gradients and flags into `rows` (S, grad_numel + flags), dropping
    the unsharded gradients; (the indices this rank had no gradient for, what is left to
    divide by after the sum)."""
    dtype = rows.dtype
    # Which parameters this rank has no gradient for: known on the host, never read back.
    missing = tuple(i for i, x in enumerate(grads) if x is None)
    scale, post = divide(unit, dtype)
    hot = g.hot()
    S, k = rows.shape[0], len(g.grad_params)
    if hot.pack_fused and not missing and rows.is_contiguous() and (scale is None or (
            dtype == g.dtype and rows.numel() <= _FUSED_SCALED_MAX)):
        # The whole row in one op: each gradient's S chunks and the flags (all ones, no
        # gradient missing), rank-major, as `pack_grad` lays them out one by one. (A
        # group's span is a strided view of its buffer: packed one by one below.)
        torch.cat([*(x.reshape(shape) for x, shape in zip(grads, hot.grad_rows)),  # type: ignore[union-attr]
                   g.all_flags(dtype, rows.device).expand(S, k)], dim=1, out=rows)
        if scale is not None:
            rows[:, : g.grad_numel].mul_(scale)
        for p in g.grad_params:
            p.drop_local_grad()
    else:
        for p, off, grad in zip(g.grad_params, g.grad_offsets, grads):
            pack_grad(p, grad, rows[:, off : off + p.chunk_numel], scale)
            p.drop_local_grad()
        # [Note: unused gradients] flags, written on the device: ones (made once per
        # layout), a zero column per missing gradient (no host list copied to the device).
        rows[:, g.grad_numel :].copy_(g.all_flags(dtype, rows.device))
        for i in missing:
            rows[:, g.grad_numel + i].zero_()
    unit.copied["pack"] += rows.numel() * rows.element_size()
    return missing, post


class GroupReduce:
    """A group's gradients in one reduce buffer, reduced by one reduce-scatter ([Note:
    coalesced units] in schedule.py). Each member owns a fixed span of every rank's row,
    in group order, whichever order the members pack in; a span nobody packed by the time
    the batch is issued is zeros (every rank leaves the same spans, so no rank reads them)."""

    def __init__(self, members: Sequence[Unit]) -> None:
        self.members = list(members)
        c = next((c for m in members if (c := m.coalesce()) is not None), None)
        self.key = None if c is None else c.key
        self.spans: dict[int, tuple[int, int]] = {}
        width = 0
        for m in members:
            mc = m.coalesce()
            if mc is None or mc.key != self.key or not m.buckets[0].grad_params:
                continue  # (a frozen member reduces nothing: reduce_grads passes it by)
            g = m.buckets[0]
            w = g.grad_numel + len(g.grad_params)
            self.spans[id(m)] = (width, w)
            width += w
        self.width = width
        self.rows: torch.Tensor | None = None
        self.packed: list[tuple[Unit, int, int, tuple[int, ...], float]] = []
        self.start = 0.0

    def accepts(self, unit: Unit) -> bool:
        span = self.spans.get(id(unit))
        return span is not None and all(id(unit) != id(u[0]) for u in self.packed) and (
            (c := unit.coalesce()) is not None and c.key == self.key)

    def pack(self, unit: Unit) -> None:
        g = unit.buckets[0]
        grads = [p.local_grad() for p in g.grad_params]
        if self.rows is None:
            self.start = now()
            S = unit.mesh.shard_size
            dtype = unit.reduce_dtype_for[g.dtype]
            self.rows = unit.pool.get(self.width * S, dtype, unit.mesh.device).view(
                S, self.width)
        off, w = self.spans[id(unit)]
        missing, post = _pack(unit, g, grads, self.rows[:, off : off + w])
        self.packed.append((unit, off, w, missing, post))

    def issue(self) -> Sequence[GroupPending]:
        rows, self.rows = self.rows, None
        if rows is None:
            return ()  # nobody packed: alike on every rank, no collective
        packed = {id(u) for u, *_ in self.packed}
        for m in self.members:
            if id(m) in self.spans and id(m) not in packed:
                off, w = self.spans[id(m)]
                rows[:, off : off + w].zero_()
        lead = self.packed[0][0]
        mesh = lead.mesh
        send = rows.view(-1)
        out = torch.empty(self.width, dtype=rows.dtype, device=mesh.device)
        streams = lead.ctx.streams if lead.ctx is not None else None
        done = None
        if streams is not None:
            rs = streams.reduce_scatter  # [Note: streams], as reduce_bucket
            rs.wait_stream(torch.cuda.current_stream(mesh.device))
            with torch.cuda.stream(rs):
                work = lead.transport.reduce_scatter(out, send, False, lead.pool,
                                                     label=lead.label)
                done = record(rs)
        else:
            work = lead.transport.reduce_scatter(out, send, True, lead.pool,
                                                 label=lead.label)
        return (GroupPending(lead, send, out, work, self.start, list(self.packed), done),)


@dataclass(eq=False)
class GroupPending:
    """A group's reduce-scatter in flight; finishing writes every member's gradients."""

    unit: Unit  # the first member that packed (named in the schedule's log)
    send: torch.Tensor
    out: torch.Tensor
    work: Work
    start: float
    packed: list[tuple[Unit, int, int, tuple[int, ...], float]]
    done: Any = None
    finished: bool = False

    @property
    def units(self) -> list[Unit]:
        """The members whose gradients it carries (the schedule's log names each)."""
        return [u for u, *_ in self.packed]

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        lead = self.unit
        if self.done is not None:
            waited = ExposedWait(self.done, bool(lead.ctx and lead.ctx.sinks)).seconds
            out = self.out
        else:
            with Span() as wait:
                out = self.work.wait()
            waited = wait.seconds
        nbytes = out.numel() * out.element_size()
        if lead.mesh.transport.name != "native":
            lead.copied["reduce_sum"] += nbytes
        # One event per member whose gradients it carries, the wait on the first (as the
        # group's all-gather, SharedGather.release).
        end, S, size = now(), lead.mesh.shard_size, out.element_size()
        for i, (u, _, w, _, _) in enumerate(self.packed):
            u.emit("reduce_scatter", "reduce_scatter", w * S * size, self.start,
                   waited if i == 0 else 0.0, end)
        lead.pool.release(self.send)
        for u, off, w, missing, post in self.packed:
            part = out[off : off + w]
            finish_reduce(u, PendingReduce(u, u.buckets[0], None, part, Work(None, part),
                                           self.start, missing, post, finished=True))


def divide(unit: Unit, dtype: torch.dtype) -> tuple[float | None, float]:
    """How the divide by the data-parallel size (or the set factor) splits around the sum:
    (scale applied in the pack or None, divisor left for after the sum).

    A power-of-two factor goes into the pack ([Note: divide in the pack]). In fp16, N
    summed gradients can overflow where their mean would not, so, as FSDP2 does, about
    sqrt(N) (a power of two: exact) is divided before the sum and the rest after it.
    Not when the sum itself must be seen: an all-reduce hook under forced-sum reduction
    (FSDP2's contract) receives the undivided sum.
    """
    factor = unit.grad_divide_factor or unit.mesh.dp_size
    if unit.force_sum_reduction:
        return None, factor
    if dtype == torch.float16:
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return (1.0 / pre if pre > 1 else None), factor / pre
    scale = prescale(factor)
    return scale, (1.0 if scale is not None else factor)


# [Note: post-accumulate-grad hooks] Hooks registered on a sharded parameter
# (`param.register_post_accumulate_grad_hook`, PyTorch's optimizer-in-backward recipe) run
# as FSDP2 runs them: once per reduction, on the sharded parameter, right after its reduced
# gradient is written (after the copy to the host under CPU offload, which then blocks:
# the hook reads the gradient at once). Autograd never accumulates into a sharded parameter
# (the modules compute with the unsharded one), so it would never run them. A direct
# parameter (NO_SHARD without casts) is the one autograd accumulates into, and autograd
# would run them on the local, unreduced gradient: its gather sets them aside until the
# reduced gradient is written (ShardedParam.hide_post_accumulate_hooks). A gradient this
# rank had none for runs them at the end of backward, if some rank computed it (UnsureGrads).


def finish_reduce(unit: Unit, pr: PendingReduce) -> None:
    """Wait for a reduction, write the result into the sharded gradients and run their
    post-accumulate-grad hooks ([Note: post-accumulate-grad hooks])."""
    if pr.done is not None:
        ctx = unit.ctx
        waited = ExposedWait(pr.done, bool(ctx and ctx.sinks)).seconds
        out = pr.out
    else:
        with Span() as wait:
            out = pr.work.wait()
        waited = wait.seconds
    mesh = unit.mesh
    nbytes = pr.out.numel() * pr.out.element_size()
    if pr.send is not None:
        if mesh.transport.name != "native":
            unit.copied["reduce_sum"] += nbytes  # the transport's local sum
        unit.emit("reduce_scatter", "reduce_scatter", nbytes * mesh.shard_size, pr.start,
                   waited)
        unit.pool.release(pr.send)
        if pr.all_reduced:
            # Issued on its own stream right after the reduce-scatter ([Note: streams]).
            unit.emit("all_reduce", "all_reduce", nbytes, pr.start, 0.0)
        elif mesh.replicate_size > 1:
            if not unit.requires_all_reduce:
                _defer(unit, pr, out)
                return
            out = _take_deferred(unit, pr.bucket, out)
            with Span() as call:
                C.all_reduce(out, mesh.replicate_group, label=unit.label)
            # Synchronous: the whole call is exposed.
            unit.emit("all_reduce", "all_reduce", nbytes, call.start, call.seconds, call.end)
    elif mesh.replicate_size > 1:
        unit.emit("all_reduce", "all_reduce", nbytes, pr.start, waited)
    n_grad = pr.bucket.grad_numel
    # The mean over ranks of each rank's mean loss gradient: what the pack did not divide
    # yet is divided now (divide()).
    hook = unit.all_reduce_hook
    if hook is not None and unit.force_sum_reduction:
        _run_hook(unit, hook, out[:n_grad])  # FSDP2: the hook sees the sum, then divides
    if pr.post != 1:
        out[:n_grad].div_(pr.post)
    if hook is not None and not unit.force_sum_reduction:
        _run_hook(unit, hook, out[:n_grad])
    missing = set(pr.missing)
    unsure = unit.unsure
    with _NoGrad():
        for i, (p, off, n, shape) in enumerate(pr.bucket.hot().grads):
            grad = out[off : off + n].view(shape)
            fresh = p.sharded.grad is None
            if grad.dtype != p.orig_dtype or grad.device != p.host_device:
                grad = _to_host(unit, grad, p, fresh, bool(p.post_accumulate_hooks()))
                unit.copied["reduce_out"] += n * grad.element_size()
            if i in missing:
                # Its count may be 0 (no rank computed it): read once, at the end of backward.
                unsure.note(p, fresh, out[n_grad + i : n_grad + i + 1])
            else:
                unsure.used(p)
            if p.direct or fresh:
                # Direct params accumulated locally; the reduced sum replaces it.
                p.set_shard_grad(grad)
                if p.direct:
                    p.mark_reduced()
            else:
                # The DTensor gradient's local tensor: no dispatch.
                p.shard_grad.add_(grad)  # type: ignore[union-attr]
            if i not in missing:
                p.run_post_accumulate_hooks()


@dataclass
class UnsureGrads:
    """[Note: unused gradients] without a host read per bucket: the gradients this rank had
    none for, written from the reduction like the others, with their counts kept on the
    device. At the end of backward (`Unit.settle`) the counts are read once, in one copy:
    where no rank computed the gradient it goes back to `None` (if it was `None` before this
    backward), and where some rank did, its post-accumulate-grad hooks run. Only buckets
    where this rank missed a gradient put anything here (per-layer MoE units whose expert
    got no tokens on this rank); FSDP2 cannot run that case at all (a size mismatch)."""

    # id(param) -> [param, was None before this backward, its count tensors, whether this
    # rank computed it in another reduction of this backward]
    entries: dict[int, list[Any]] = field(default_factory=dict)
    # Parameters this rank had a gradient for in some reduction of this backward.
    seen: set[int] = field(default_factory=set)

    def note(self, p: ShardedParam, was_none: bool, count: torch.Tensor) -> None:
        e = self.entries.setdefault(id(p), [p, was_none, [], id(p) in self.seen])
        e[2].append(count.clone())

    def used(self, p: ShardedParam) -> None:
        self.seen.add(id(p))
        if self.entries:
            e = self.entries.get(id(p))
            if e is not None:
                e[3] = True  # it has a gradient whatever the counts; its hooks ran then

    def settle(self) -> None:
        if not self.entries:  # every unit, every backward: nothing was missing here
            self.seen.clear()
            return
        entries = [e for e in self.entries.values() if not e[3]]
        self.clear()
        if not entries:
            return
        counts = torch.cat([c for e in entries for c in e[2]]).tolist()  # the one host read
        at = 0
        for p, was_none, cs, _ in entries:
            total, at = sum(counts[at : at + len(cs)]), at + len(cs)
            if total == 0:
                if was_none:
                    p.sharded.grad = None  # no rank computed it: `None`, as unsharded
            else:
                p.run_post_accumulate_hooks()

    def clear(self) -> None:
        self.entries = {}
        self.seen = set()


def _defer(unit: Unit, pr: PendingReduce, out: torch.Tensor) -> None:
    """[Note: deferred all-reduce] `set_requires_all_reduce(False)` under HYBRID_SHARD
    (FSDP2's meaning): the reduce-scatter within the shard group ran; its result, summed
    over this replica's ranks and not yet divided, is added to what earlier micro-batches
    left, in the reduce dtype (FSDP2 accumulates its partial output in that dtype too), and
    neither the all-reduce across replicas nor the gradients' update happens now. The next
    reduction that all-reduces adds it in first, so one all-reduce carries every deferred
    micro-batch, and the [Note: unused gradients] flags add up the same way."""
    key = id(pr.bucket)
    have = unit.partial_reduce.get(key)
    if have is None:
        unit.partial_reduce[key] = out
    else:
        have.add_(out)


def _take_deferred(unit: Unit, bucket: FlatBucket, out: torch.Tensor) -> torch.Tensor:
    have = unit.partial_reduce.pop(id(bucket), None)
    if have is not None:
        out.add_(have)
    return out


def _run_hook(unit: Unit, hook: Callable[[torch.Tensor], None],
              reduced: torch.Tensor) -> None:
    stream = unit.all_reduce_hook_stream
    if stream is None:
        hook(reduced)
        return
    dev: Any = torch.get_device_module(reduced.device)
    stream.wait_stream(dev.current_stream())  # type: ignore[attr-defined]
    with dev.stream(stream):
        hook(reduced)
    dev.current_stream().wait_stream(stream)


def offload_copy(pin_memory: bool, fresh: bool, hooked: bool) -> tuple[bool, bool]:
    """How a reduced gradient goes device -> host under CPU offload: (into pinned memory,
    without blocking). FSDP2's rule: only into pinned memory (`CPUOffloadPolicy(pin_memory=
    True)`) may the copy run without blocking, and only when nothing on the host reads the
    gradient inside backward: not when it adds to an existing gradient, not when a
    post-accumulate-grad hook will read it (optimizer-in-backward)."""
    return pin_memory, pin_memory and fresh and not hooked


def _to_host(unit: Unit, grad: torch.Tensor, p: ShardedParam, fresh: bool,
             hooked: bool) -> torch.Tensor:
    """The reduced gradient in the master dtype on the shard's device.

    CPU offload on a GPU: copied device -> host without blocking where `offload_copy` allows,
    and an event recorded after the copy; the unit synchronizes on its events once, at the
    end of backward (`Unit.settle`), as FSDP2 does, instead of one blocking copy per
    parameter inside backward.
    """
    dtype, host = p.orig_dtype, p.host_device
    grad = grad.to(dtype)
    if grad.device == host:
        return grad
    pinned, non_blocking = offload_copy(p.pin_memory, fresh, hooked)
    if not (grad.is_cuda and host.type == "cpu"):
        return grad.to(host)
    dst = torch.empty(grad.shape, dtype=dtype, device=host, pin_memory=pinned)
    dst.copy_(grad, non_blocking=non_blocking)
    if non_blocking:
        unit.offload_events.append(record(torch.cuda.current_stream(grad.device)))
    return dst


class _NoGrad:
    """`torch.no_grad()` for the per-step paths: the same switch, without the decorator
    machinery torch's class runs on entry (five Python calls, several times per unit)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.prev)


def _on(stream: Any) -> Any:
    """Run the block on `stream` (CUDA), or where it runs now (None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Unit:
    """The parameters of one `fully_shard` call: one all-gather per bucket to unshard, one
    reduction per bucket after backward; `ShardedState` says which face the modules hold."""

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
        # One shard rank: the gather is a local swap, nothing to overlap by issuing it early
        # (ScheduledUnit.prefetchable).
        self.prefetchable = mesh.shard_size > 1
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
        self.ctx: UnitContext | None = None
        self.is_root = False
        # False inside no_sync(): keep unsharded gradients and reduce them later.
        self.requires_grad_sync = True
        # A backward inside no_sync() kept gradients here that no reduction took since.
        self.unsynced = False
        # False: keep the full parameters after backward (set_reshard_after_backward).
        self.reshard_after_backward = True
        # Reduced gradients are divided by this (None: the data-parallel size, a mean).
        self.grad_divide_factor: float | None = None
        # FSDP2 module methods (sharded_module.py, sharded_module.py).
        self.unshard_in_backward = True
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: object | None = None
        # How bytes move: the mesh's, or user collectives (set_custom_all_gather).
        self.transport: Transport = mesh.transport
        # api/state.py's ShardwiseState for this unit, made once on first ask (typed loosely:
        # the core imports nothing from the API layer).
        self.state_view: Any = None
        self._gathers: list[PendingGather] = []
        # The extension parameters' packed all-gather in flight ([Note: all-gather
        # extensions] in sharded_param.py), beside the plain buckets' gathers.
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
        # to the host (unit.py), synchronized once at the end of backward.
        self.offload_events: list[Any] = []
        # Gradients this rank had none for, written from a reduction whose count is read at
        # the end of backward ([Note: unused gradients], UnsureGrads).
        self.unsure = UnsureGrads()
        # Each parameter's sharded-Parameter version when the unit was last gathered: an
        # in-place write through it since (every rank runs it) makes the gathered copy stale.
        self._gathered_versions: list[int] = []
        # hpZ ([Note: hpZ] in unit.py): the block of ranks forward reshards to (None: the
        # whole shard group), and per bucket the rows kept between forward and backward.
        self.hpz: Hpz | None = None
        self.post_forward: KeptRows | None = None
        # Ranks of the all-gather last issued (the shard group, or the hpZ block): events.
        self._gather_size = mesh.shard_size
        # False (set_requires_all_reduce, HYBRID_SHARD): reduce-scatter, but keep the
        # result here, per bucket, instead of all-reducing it across replicas; the next
        # reduction that all-reduces adds it in (unit.py, [Note: deferred all-reduce]).
        self.requires_all_reduce = True
        self.partial_reduce: dict[int, torch.Tensor] = {}
        # [Note: coalesced units] in schedule.py: the most all-gather bytes a group holding
        # this unit may gather in one collective (0: this unit gathers alone).
        self.coalesce_bytes = DEFAULT_COALESCE_BYTES
        self.params: list[ShardedParam] = []
        # The per-step lists of this layout (UnitHot), made at first use.
        self._hot: UnitHot | None = None
        self.set_params(params)

    # --- parameters ------------------------------------------------------------------

    def set_params(self, params: list[ShardedParam]) -> None:
        """(Re)build the flat layout; used when a tied parameter is re-homed into a parent."""
        assert self.state is ShardedState.SHARDED, "layout changes only while sharded"
        self.params = list(params)
        self._hot = None
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

    def hot(self) -> UnitHot:
        """This layout's per-step lists, remade after any parameter was rebuilt."""
        h = self._hot
        if h is None or h.rebuilds != ShardedParam.rebuilds:
            h = self._hot = UnitHot(self)
        return h

    def follow_requires_grad(self) -> None:
        """Take up `requires_grad` changes the user made since sharding (between steps).

        The flag is read from the Parameter the module holds now (the sharded one, or the
        unsharded one while the unit is unsharded) and copied to the other; the gradient
        layout is rebuilt when any flag changed, so a frozen parameter gets no gradient, no
        reduction and no optimizer update, and an unfrozen one trains.
        """
        # A step starts here (the root's forward, after a backward that missed its final
        # callback was finished): what a backward that raised left of its unused-gradient
        # counts belongs to no step, and added to the next one's kept a gradient no rank
        # computed ([Note: unused gradients], UnsureGrads). reset_iter_state leaves them.
        if self.unsure.entries or self.unsure.seen:
            self.unsure.clear()
        changed = False
        for params, name, p in self.hot().flags:
            held = params.get(name)
            want = held.requires_grad if held is not None else p.requires_grad
            if want != p.requires_grad:
                changed = True
                p.set_requires_grad(want)
        if changed:
            self.reshard()
            self.set_params(self.params)

    def coalesce(self) -> Coalesce | None:
        """This unit's terms for sharing its all-gather and reduce-scatter with neighbours
        ([Note: coalesced units] in schedule.py); None: it gathers and reduces alone. Only
        the plain path coalesces: one bucket, a sharded group with no replicas, the mesh's
        own transport, no all-gather extensions, no hpZ, no all-reduce hook."""
        mesh = self.mesh
        if (self.coalesce_bytes <= 0 or mesh.shard_size == 1 or mesh.replicate_size > 1
                or len(self.buckets) != 1 or self.ext_params or self.hpz is not None
                or self.transport is not mesh.transport or self.all_reduce_hook is not None):
            return None
        g = self.buckets[0]
        if g.numel == 0:
            return None
        t = self.transport
        key = (t.name, id(t.group), mesh.device, g.dtype, self.reduce_dtype_for[g.dtype])
        return Coalesce(key, g.numel * mesh.shard_size * g.dtype.itemsize, self.coalesce_bytes)

    def open_batch(self, members: Sequence[Unit]) -> GroupReduce:
        """An empty reduce batch for `members` (the schedule's group, in order)."""
        return GroupReduce(members)

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

    # ---- the gather half: unshard / wait_unshard / reshard ----

    def unshard(self, async_op: bool = True, together: Sequence[Unit] = ()) -> None:
        """Issue the all-gather (idempotent: no-op unless SHARDED). `together`: the sharded
        members of this unit's group, this one among them, gathered in one all-gather
        ([Note: coalesced units] in schedule.py)."""
        if self.state is not ShardedState.SHARDED:
            return
        # FSDP2 asks each shard for its all-gather hooks at every gather: hooks patched onto
        # a shard after the first forward gather from the next one on.
        for u in together or (self,):
            if u.hot().extensions_changed() and any([p.refresh_extension()
                                                     for p in u.params]):
                u.set_params(u.params)
        if together:
            c = self.coalesce()
            if c is not None and all((m.coalesce() or c).key == c.key for m in together) and all(
                    m.coalesce() is not None for m in together):
                gather_together(together, async_op)
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
                        rows = kept.rows[i]
                        assert rows is not None
                        if streams is not None:
                            kept.hand_to(streams.copy_in, rows)
                        shard.copy_(rows, non_blocking=True)
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
        ([Note: all-gather extensions] in sharded_param.py)."""
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
        if self.mesh.dp_size > 1:
            # [Note: post-accumulate-grad hooks]: not on a direct parameter's local gradient.
            for p in self.params:
                if p.direct:
                    p.hide_post_accumulate_hooks()
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is ShardedState.SHARDED:
            self.unshard(async_op=False)
        local = self.mesh.shard_size == 1 and self.hot().shares_all
        if self._gathers or self._ext_gather is not None or not local:
            self._fill()
        self._gathers.clear()
        uh = self.hot()  # after the extensions' post hooks, which may make new parameters
        for params, name, t in uh.to_unsharded:
            params[name] = t
        if not uh.shares_all:
            self._gathered_versions = [t._version for t in uh.sharded]
        self.state = ShardedState.UNSHARDED

    def _fill(self) -> None:
        """Wait for the gathers in flight and copy them (one rank: the shards) into the
        unsharded parameters."""
        S = self.mesh.shard_size
        with _NoGrad():
            for pg in self._gathers:
                shared = pg.shared
                if shared is not None:  # [Note: coalesced units]
                    # Waited once (CUDA: every member's stream waits for the event).
                    if shared.waited is None or pg.done is not None:
                        w = self._wait(pg)
                        shared.waited = w if shared.waited is None else shared.waited
                    rows = shared.rows(S, pg.col, pg.bucket.numel)
                    self._copy_out(pg, rows)
                    shared.release(pg.start, pg.blocked)
                    continue
                waited = self._wait(pg)
                self.pool.release(pg.send)
                rows = pg.out.view(S, pg.bucket.numel)
                self._copy_out(pg, rows)
                self.pool.release(pg.out)
                self.emit("all_gather", "all_gather", pg.out.numel() * pg.out.element_size(),
                           pg.start, waited + pg.blocked)
            if self._ext_gather is not None:
                self._finish_extensions(self._ext_gather)
            if S == 1:
                for g in self.buckets:
                    hot = g.hot()
                    _alloc_all(hot.allocs)
                    if hot.local_dsts:
                        torch._foreach_copy_(hot.local_dsts, hot.local_srcs,
                                             non_blocking=True)
                    for p in hot.local_other:
                        p.copy_out(p.padded_shard.view(1, -1), non_blocking=True)

    def _copy_out(self, pg: PendingGather, rows: torch.Tensor) -> None:
        """The gathered (S, chunk) rows of one bucket into its unsharded parameters."""
        hot = pg.bucket.hot()
        _alloc_all(hot.allocs)
        # One fused copy (FSDP2's split_with_sizes_copy). The destinations are `.data`
        # views so the copy does not bump the autograd version counter that tensors
        # saved in forward check in backward (they alias this storage).
        dsts = hot.rows_dsts
        if dsts is not None:
            torch.split_with_sizes_copy(rows, pg.bucket.sizes, dim=1, out=dsts)
        else:
            # A parameter on another dim is copied into its own layout
            # ([Note: layout] in sharded_param.py), on this (compute) stream too.
            for p, part in zip(pg.bucket.gathered, rows.split(pg.bucket.sizes, dim=1)):
                p.copy_out(part)
        self.copied["gather_out"] += rows.numel() * rows.element_size()

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

    def kept_needs_value_check(self) -> bool:
        """Still gathered at a forward's start: reshard now if a write to the shards is known
        on the host; else whether the shards must be compared by value with the peers'
        (`shards_changed_since_gather`, one small all-reduce in context.py).

        Known on the host, and alike on every rank (each runs the same code on its
        DTensor): an in-place write through the sharded Parameter (a for-loop optimizer, a
        `no_grad` update, `load_state_dict`) bumps its version. Not compared: between the
        micro-batches of an accumulation (gradients kept unreduced by no_sync, or an HSDP
        all-reduce deferred), where an update would step from unreduced gradients, FSDP2's
        recipe (`set_reshard_after_backward(False)` with `set_requires_gradient_sync(False)`)
        then pays exactly FSDP2's collectives and no host sync.
        """
        if self.state is not ShardedState.UNSHARDED:
            return False
        uh = self.hot()
        if uh.shares_all:
            return False  # the unsharded parameters are the shards themselves
        if [t._version for t in uh.sharded] != self._gathered_versions:
            self.reshard()
            return False
        return not (self.unsynced or self.partial_reduce)

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
        uh = self.hot()
        for params, name, t in uh.to_sharded:
            params[name] = t
        for ext in uh.exts:
            ext.free()
        for storage in uh.frees:  # ShardedParam.free_unsharded, per unit
            if storage.nbytes() != 0:
                storage.resize_(0)
        self.state = ShardedState.SHARDED
        self.emit("reshard", "", 0, start)

    # ---- the reduce half: reduce_grads / finish_reduce, no_sync accumulation ----

    def has_unreduced_grads(self) -> bool:
        """Whether a gradient waits for a reduction (a pure question: nothing moves).

        Under no_sync, decided alike on every rank: a backward ran for this unit (at the
        same point everywhere, [Note: structure decides]) that kept its gradients. Whether
        this rank holds any is its data's business (a parameter the micro-batches used on
        some ranks only): the unit still reduces on all of them.
        """
        return self.unsynced or any(p.has_local_grad() for g in self.buckets
                                    for p in g.grad_params)

    def reduce_grads(self, batch: GroupReduce | None = None) -> Sequence[PendingReduce]:
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
            if batch is not None and batch.accepts(self):
                # [Note: coalesced units]: packed now, reduced with the group's batch.
                with torch.no_grad():
                    batch.pack(self)
                return ()
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
        with _NoGrad():
            pending = [reduce_bucket(self, g) for g in self.buckets if g.grad_params]
        return [pr for pr in pending if pr is not None]

    def settle(self) -> None:
        """The end of backward: wait for the gradient copies to the host (CPU offload on a
        GPU: the optimizer steps them on the host next), and settle the gradients this rank
        had none for (UnsureGrads: one read of their counts, only when there are any)."""
        for ev in self.offload_events:
            ev.synchronize()
        self.offload_events.clear()
        self.unsure.settle()

    def finish_reduce(self, pr: PendingReduce) -> None:
        """Wait for a reduction and write the result into the sharded gradients."""
        finish_reduce(self, pr)
