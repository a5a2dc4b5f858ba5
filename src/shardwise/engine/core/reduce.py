"""A unit's gradient reduction: pack, reduce-scatter, divide, write the shards.

The unit decides *that* its gradients reduce (unit_reduce.py, called by the schedule); this file
is *how*: one reduction per flat bucket, in flight as a `PendingReduce` until the schedule
finishes it, which writes the reduced rows into the sharded gradients. Every gradient is
copied into one rank-major buffer (pack.py) that the transport reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..comm import collectives as C
from ..comm.work import Work
from .events import Span, now
from .pack import pack_grad, prescale
from .streams import ExposedWait, record

if TYPE_CHECKING:
    from .bucket import FlatBucket
    from .unit import Unit


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
