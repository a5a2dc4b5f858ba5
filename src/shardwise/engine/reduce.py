"""A unit's gradient reduction: pack or send, reduce-scatter, divide, write the shards.

The unit decides *that* its gradients reduce (unit.py, called by the schedule); this file
is *how*: one reduction per flat bucket, in flight as a `PendingReduce` until the schedule
finishes it, which writes the reduced rows into the sharded gradients.

Two paths move the bytes. The packed path copies every gradient into one rank-major buffer
(pack.py) and hands it to the transport's reduce-scatter. The parts path ([Note: parameter
messages] in comm/transport.py), taken by the pair transport, sends each gradient's peer
rows straight from the gradient and receives the peer's contribution to this rank's rows
into one buffer; the local sum then writes the result. No pack: the gradient is the send
buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .comm import collectives as C
from .comm.transport import own_message, reduces_in_parts
from .comm.work import Work
from .events import Span, now
from .pack import pack_grad, prescale

if TYPE_CHECKING:
    from .bucket import FlatBucket
    from .sharded_param import ShardedParam
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
    # Sent in parts ([Note: parameter messages]): the local sum ran inside the wait.
    parts: bool = False
    # In parts: the pooled pack of small gradients and flags (both directions), or None.
    pack: torch.Tensor | None = None
    # Set once the result is in the sharded gradients: finishing twice would release the
    # send buffer twice and add the gradient twice.
    finished: bool = False
    released: bool = False

    def finish(self) -> None:
        """Wait for the reduction and write its result (idempotent)."""
        if not self.finished:
            self.finished = True
            finish_reduce(self.unit, self)

    def release(self) -> None:
        """After `finish`: once the peer has read what this rank sent (in parts: gradient
        rows, the small pack), let go of it ([Note: one-copy release]). Idempotent."""
        if self.released or not self.finished:
            return
        self.released = True
        if self.parts:
            self.work.wait_sent()
            if self.pack is not None:
                self.unit.pool.release(self.pack)


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
    # the schedule calls this at the same point on every rank ([Note: lockstep]).
    grads = [p.local_grad() for p in g.grad_params]
    if mesh.dp_size == 1 and all(p.direct for p in g.grad_params):
        return None  # one rank, no casts: the gradients already are the result
    start = now()
    dtype = unit.reduce_dtype_for[g.dtype]
    complete = all(x is not None for x in grads)
    flags = _flags(unit, g, grads, dtype, complete)
    # Decided from the bucket's compute dtype, never from this rank's gradients: one
    # accumulated under no_sync is already in the reduce dtype (unit.py), so ranks that used
    # a parameter in different micro-batches would take different paths (and their
    # messages would not match).
    if S > 1 and reduces_in_parts(unit.transport, dtype, [g.dtype]):
        return _reduce_in_parts(unit, g, grads, dtype, flags, complete, start)
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
        work = unit.transport.reduce_scatter(out, send, True, unit.pool, label=unit.label)
        return PendingReduce(unit, g, send, out, work, start, complete, post)
    work = (C.all_reduce(send, mesh.replicate_group, async_op=True, label=unit.label)
            if mesh.replicate_size > 1 else Work(None, send))
    return PendingReduce(unit, g, None, send, work, start, complete, post)


def _rows(p: ShardedParam, rank: int) -> tuple[int, int]:
    """(start, length) in elements of shard-rank `rank`'s valid rows of p, flattened."""
    start = min(rank * p.chunk_rows, p.dim0)
    end = min(start + p.chunk_rows, p.dim0)
    return start * p.row_numel, (end - start) * p.row_numel


def _reduce_in_parts(unit: Unit, g: FlatBucket, grads: list[torch.Tensor | None],
                     dtype: torch.dtype, flags: torch.Tensor, complete: bool,
                     start: float) -> PendingReduce:
    """[Note: parameter messages]: each gradient's peer rows go out as they are; what the
    peer sends for this rank's rows lands in `recv`, and the local sum writes `out`."""
    mesh, transport = unit.mesh, unit.transport
    me, peer = transport.me, transport.peer  # type: ignore[attr-defined]
    width = g.grad_numel + len(g.grad_params)
    out = torch.empty(width, dtype=dtype, device=mesh.device)
    recv = unit.pool.get(width, dtype, mesh.device)
    sends, recvs, sums = [], [], []
    k = len(g.grad_params)
    # Gradients too small for a message of their own, and the flags, travel in one pack:
    # a slot of chunk_numel per such parameter (the peer's rows, zero-padded), then the flags.
    small = [i for i, p in enumerate(g.grad_params)
             if p.chunk_numel and not own_message(p.chunk_numel, dtype.itemsize)]
    small_w = sum(g.grad_params[i].chunk_numel for i in small) + k
    pack = unit.pool.get(2 * small_w, dtype, mesh.device)
    s_send, s_recv = pack[:small_w], pack[small_w:]
    slot = dict(zip(small, _offsets([g.grad_params[i].chunk_numel for i in small])))
    for i, (p, off, grad) in enumerate(zip(g.grad_params, g.grad_offsets, grads)):
        flat = None if grad is None else grad.detach().reshape(-1)
        if flat is not None and not flat.is_contiguous():
            flat = flat.contiguous()
        p_start, p_len = _rows(p, peer)
        m_start, m_len = _rows(p, me)
        own = flat[m_start : m_start + m_len] if flat is not None and m_len else None
        if i in slot:
            so = slot[i]
            if flat is not None and p_len:
                s_send[so : so + p_len].copy_(flat[p_start : p_start + p_len])
            s_send[so + (p_len if flat is not None else 0) : so + p.chunk_numel].zero_()
            if m_len:
                sums.append((own, s_recv[so : so + m_len], out[off : off + m_len]))
        else:
            if p_len:
                sends.append(flat[p_start : p_start + p_len] if flat is not None
                             else torch.zeros(p_len, dtype=dtype, device=mesh.device))
            if m_len:
                recvs.append(recv[off : off + m_len])
                sums.append((own, recv[off : off + m_len], out[off : off + m_len]))
        p.drop_local_grad()  # the views above keep the gradient alive until the sum
    n_grad = g.grad_numel
    s_send[small_w - k :].copy_(flags)
    sends.append(s_send)
    recvs.append(s_recv)
    sums.append((flags, s_recv[small_w - k :], out[n_grad:]))
    unit.copied["pack"] += s_send.numel() * s_send.element_size()
    scale, post = divide(unit, dtype)

    def local_sum() -> None:
        # Rank order, as every other transport sums: rank 0's part + rank 1's part.
        for own, theirs, dst in sums:
            if own is None:
                dst.copy_(theirs)
            elif me == 0:
                torch.add(own, theirs, out=dst)
            else:
                torch.add(theirs, own, out=dst)
        passes = 1
        if scale is not None:
            # Power-of-two scaling after the sum: the same bits as before it (a second pass).
            out[:n_grad].mul_(scale)
            passes = 2
        unit.copied["reduce_sum"] += passes * out.numel() * out.element_size()

    work = transport.exchange_parts(sends, recvs, "reduce_scatter", unit.label,  # type: ignore[attr-defined]
                                    out, local_sum)
    return PendingReduce(unit, g, recv, out, work, start, complete, post, parts=True,
                         pack=pack)


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


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
        ones = unit._ones.get((id(g), dtype))
        if ones is None:
            ones = unit._ones[(id(g), dtype)] = torch.ones(len(grads), dtype=dtype,
                                                           device=unit.mesh.device)
        return ones
    return torch.tensor([0.0 if x is None else 1.0 for x in grads], dtype=dtype,
                        device=unit.mesh.device)


def finish_reduce(unit: Unit, pr: PendingReduce) -> None:
    """Wait for a reduction and write the result into the sharded gradients."""
    with Span() as wait:
        # In parts, the sends (gradient rows, the small pack) stay the peer's to read until
        # `release` ([Note: one-copy release]).
        out = pr.work.wait_received() if pr.parts else pr.work.wait()
    waited = wait.seconds
    mesh = unit.mesh
    nbytes = pr.out.numel() * pr.out.element_size()
    if pr.send is not None:
        if mesh.transport.name != "native" and not pr.parts:
            unit.copied["reduce_sum"] += nbytes  # the transport's local sum
        unit._emit("reduce_scatter", "reduce_scatter", nbytes * mesh.shard_size, pr.start,
                   waited)
        unit.pool.release(pr.send)  # in parts, the receive buffer: this rank's alone
        if mesh.replicate_size > 1:
            with Span() as call:
                C.all_reduce(out, mesh.replicate_group, label=unit.label)
            # Synchronous: the whole call is exposed (and ends where the call did, not
            # wherever this thread got the GIL back after a one-copy reader thread).
            unit._emit("all_reduce", "all_reduce", nbytes, call.start, call.seconds, call.end)
    elif mesh.replicate_size > 1:
        unit._emit("all_reduce", "all_reduce", nbytes, pr.start, waited)
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
            if grad.dtype != p.orig_dtype or grad.device != p.host_device:
                grad = grad.to(device=p.host_device, dtype=p.orig_dtype)
                unit.copied["reduce_out"] += n * grad.element_size()
            have = p.shard_grad
            if p.direct or have is None:
                # Direct params accumulated locally; the reduced sum replaces it.
                p.set_shard_grad(grad)
                if p.direct:
                    p.mark_reduced()
            else:
                have.add_(grad)  # the DTensor gradient's local tensor: no dispatch


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
