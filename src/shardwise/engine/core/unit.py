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
from .events import Event, EventSink, Span, now
from .layout import full_into_rows
from .policies import CPUOffloadPolicy, MeshInfo, MixedPrecisionPolicy
from .schedule import Schedule, ShardedState, TrainingState
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
#   gradients (the gradients are freed on the stream that made them);
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
    """FSDP2's three communication streams on one CUDA device (high priority)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_in: Any = torch.cuda.Stream(device=device, priority=-1)
        self.all_gather: Any = torch.cuda.Stream(device=device, priority=-1)
        self.reduce_scatter: Any = torch.cuda.Stream(device=device, priority=-1)

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

    def all_flags(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ones = self._all_flags.get(dtype)
        if ones is None:
            ones = self._all_flags[dtype] = torch.ones(len(self.grad_params), dtype=dtype,
                                                       device=device)
        return ones

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


def keep(unit: Unit, hpz: Hpz) -> list[torch.Tensor | None]:
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
    return kept


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
    # Every parameter had a gradient here, so every count is >= 1 (no need to read them).
    complete: bool = True
    # What is left to divide by after the sum (1: the pack divided already, [Note: divide
    # in the pack]).
    post: float = 1.0
    # Set once the result is in the sharded gradients: finishing twice would release the
    # send buffer twice and add the gradient twice.
    finished: bool = False
    # CUDA: an event after the reduce-scatter on its own stream ([Note: streams]).
    done: Any = None

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
    if mesh.dp_size == 1 and all(p.direct for p in g.grad_params):
        return None  # one rank, no casts: the gradients already are the result
    start = now()
    dtype = unit.reduce_dtype_for[g.dtype]
    complete = all(x is not None for x in grads)
    flags = _flags(unit, g, grads, dtype, complete)
    k = len(g.grad_params)
    width = g.grad_numel + k
    # With S == 1 the packed buffer becomes the gradients: not pooled.
    send = (unit.pool.get(width * S, dtype, mesh.device) if S > 1
            else torch.empty(width, dtype=dtype, device=mesh.device))
    rows = send.view(S, width)
    scale, post = divide(unit, dtype)
    for p, off, grad in zip(g.grad_params, g.grad_offsets, grads):
        pack_grad(p, grad, rows[:, off : off + p.chunk_numel], scale)
        p.drop_local_grad()
    rows[:, g.grad_numel :].copy_(flags)
    unit.copied["pack"] += send.numel() * send.element_size()
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
            return PendingReduce(unit, g, send, out, work, start, complete, post, done=done)
        work = unit.transport.reduce_scatter(out, send, True, unit.pool, label=unit.label)
        return PendingReduce(unit, g, send, out, work, start, complete, post)
    work = (C.all_reduce(send, mesh.replicate_group, async_op=True, label=unit.label)
            if mesh.replicate_size > 1 else Work(None, send))
    return PendingReduce(unit, g, None, send, work, start, complete, post)


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


def _flags(unit: Unit, g: FlatBucket, grads: list, dtype: torch.dtype,
           complete: bool) -> torch.Tensor:
    """[Note: unused gradients] flags; all ones (the usual case) is made once per layout."""
    if complete:
        return g.all_flags(dtype, unit.mesh.device)
    return torch.tensor([0.0 if x is None else 1.0 for x in grads], dtype=dtype,
                        device=unit.mesh.device)


def finish_reduce(unit: Unit, pr: PendingReduce) -> None:
    """Wait for a reduction and write the result into the sharded gradients."""
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
        if mesh.replicate_size > 1:
            if not unit.requires_all_reduce:
                _defer(unit, pr, out)
                return
            out = _take_deferred(unit, pr, out)
            with Span() as call:
                C.all_reduce(out, mesh.replicate_group, label=unit.label)
            # Synchronous: the whole call is exposed.
            unit.emit("all_reduce", "all_reduce", nbytes, call.start, call.seconds, call.end)
    elif mesh.replicate_size > 1:
        unit.emit("all_reduce", "all_reduce", nbytes, pr.start, waited)
    n_grad = pr.bucket.grad_numel
    # Counts of contributing ranks ([Note: unused gradients]); read only when needed.
    counts = None if pr.complete else out[n_grad:].tolist()
    # The mean over ranks of each rank's mean loss gradient: what the pack did not divide
    # yet is divided now (divide()).
    hook = unit.all_reduce_hook
    if hook is not None and unit.force_sum_reduction:
        _run_hook(unit, hook, out[:n_grad])  # FSDP2: the hook sees the sum, then divides
    if pr.post != 1:
        out[:n_grad].div_(pr.post)
    if hook is not None and not unit.force_sum_reduction:
        _run_hook(unit, hook, out[:n_grad])
    with torch.no_grad():
        for i, (p, off) in enumerate(zip(pr.bucket.grad_params, pr.bucket.grad_offsets)):
            if counts is not None and counts[i] == 0:
                continue  # no rank computed it: the gradient stays as it was (None)
            n = p.local_rows * p.row_numel
            grad = out[off : off + n].view(p.local.shape)
            have = p.shard_grad
            if grad.dtype != p.orig_dtype or grad.device != p.host_device:
                grad = _to_host(unit, grad, p.orig_dtype, p.host_device, have is None)
                unit.copied["reduce_out"] += n * grad.element_size()
            if p.direct or have is None:
                # Direct params accumulated locally; the reduced sum replaces it.
                p.set_shard_grad(grad)
                if p.direct:
                    p.mark_reduced()
            else:
                have.add_(grad)  # the DTensor gradient's local tensor: no dispatch


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


def _take_deferred(unit: Unit, pr: PendingReduce, out: torch.Tensor) -> torch.Tensor:
    have = unit.partial_reduce.pop(id(pr.bucket), None)
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


def _to_host(unit: Unit, grad: torch.Tensor, dtype: torch.dtype, host: torch.device,
             fresh: bool) -> torch.Tensor:
    """The reduced gradient in the master dtype on the shard's device.

    CPU offload on a GPU: copied device -> host without blocking, into pinned memory, and
    an event recorded after the copy; the unit synchronizes on its events once, at the end
    of backward (`Unit.settle_offload`), as FSDP2 does, instead of one blocking copy per
    parameter inside backward. A gradient accumulated into one that exists already must be
    there now, so that copy blocks.
    """
    grad = grad.to(dtype)
    if grad.device == host:
        return grad
    if not (fresh and grad.is_cuda and host.type == "cpu"):
        return grad.to(host)
    pinned = torch.empty(grad.shape, dtype=dtype, device=host, pin_memory=True)
    pinned.copy_(grad, non_blocking=True)
    unit.offload_events.append(record(torch.cuda.current_stream(grad.device)))
    return pinned


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
        # hpZ ([Note: hpZ] in unit.py): the block of ranks forward reshards to (None: the
        # whole shard group), and per bucket the rows kept between forward and backward.
        self.hpz: Hpz | None = None
        self.post_forward: list[torch.Tensor | None] | None = None
        # Ranks of the all-gather last issued (the shard group, or the hpZ block): events.
        self._gather_size = mesh.shard_size
        # False (set_requires_all_reduce, HYBRID_SHARD): reduce-scatter, but keep the
        # result here, per bucket, instead of all-reducing it across replicas; the next
        # reduction that all-reduces adds it in (unit.py, [Note: deferred all-reduce]).
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

    # ---- the gather half: unshard / wait_unshard / reshard ----

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
