"""The only module that calls torch.distributed.

Pure functions over (tensors, group): they hold no state and return what they produce
(a result, or a `Work` handle for async ops). Everything above this layer talks about
units and parameters; everything here talks about flat buffers and process groups.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import debug as D
from . import process_group as PG
from .process_group import destroy_process_group, finish, init_process_group, is_initialized

__all__ = ["destroy_process_group", "finish", "init_process_group", "is_initialized"]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work(NamedTuple):
    """A collective in flight: `handle` is None for ops that completed synchronously.

    `post`, when set, finishes the result locally once the transfer is done (the local sum
    of an all-to-all reduce-scatter); `wait()` runs it exactly where the caller waits.
    `issued` says what it was, so that a failed wait names the collective and unit.
    """

    handle: object | None
    output: torch.Tensor
    post: Callable[[], None] | None = None
    issued: _Issued | None = None

    def wait(self) -> torch.Tensor:
        if self.handle is not None:
            try:
                self.handle.wait()  # type: ignore[attr-defined]
            except Exception as e:
                if self.issued is None or not D.is_comm_failure(e):
                    raise
                raise self.issued.failure(e) from e
        if self.post is not None:
            self.post()
        return self.output


class _Issued(NamedTuple):
    """What a collective was, kept only to explain its failure (see engine/debug.py)."""

    op: str
    label: str
    group: ProcessGroup | None
    tensor: torch.Tensor | None
    seq: int | None
    start: float

    def failure(self, cause: BaseException) -> D.CollectiveError:
        PG.mark_failed()
        return D.failure(D.describe(self.op, self.label, self.tensor), self.seq,
                         group_ranks(self.group), PG.timeout_s,
                         time.perf_counter() - self.start, cause)


def _key(group: ProcessGroup | None) -> int:
    return id(group if group is not None else dist.group.WORLD)


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group`, in group-rank order."""
    if not is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _issue(op: str, label: str, group: ProcessGroup | None, tensor: torch.Tensor | None,
           call: Callable[[], Any]) -> tuple[Any, _Issued]:
    """Check (debug mode), then run `call`; a backend failure becomes a CollectiveError."""
    PG.communicating()
    seq = None
    if D.debug_enabled() and is_initialized() and world_size(group) > 1:
        seq = D.next_sequence(_key(group))
        D.check(seq, D.describe(op, label, tensor), lambda fp: _exchange(fp, group),
                group_ranks(group))
    issued = _Issued(op, label, group, tensor, seq, time.perf_counter())
    try:
        return call(), issued
    except Exception as e:
        if not D.is_comm_failure(e):
            raise
        raise issued.failure(e) from e


# Every tensor given to torch.distributed goes through this: see [Note: gloo teardown].
_h = PG.handoff


def _exchange(fingerprint: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    device = _byte_device(group)
    mine = fingerprint.to(device)
    out = torch.empty(world_size(group) * mine.numel(), dtype=torch.uint8, device=device)
    _all_gather_flat(_h(out), _h(mine), group=group)
    return out.view(world_size(group), -1).cpu()


def use_all_to_all(group: ProcessGroup | None) -> bool:
    """Whether gather/scatter on `group` go through all-to-all (see [Note: gloo transport]).

    [Note: gloo transport] gloo's all_gather_into_tensor and reduce_scatter_tensor are slow on
    CPU: measured on 2 ranks over loopback with 12.6 MB units, all_gather took 13.3 ms and
    reduce_scatter 25.4 ms (it reduces far more than its share), while all_to_all_single moved
    the same bytes in 7.0 ms (gather, input replicated per peer) and 7.9 ms (scatter, plus a
    local sum of S segments). Both move the bandwidth-optimal (S-1)/S of the buffer per rank,
    and the result is bit-for-bit the same layout. NCCL keeps its native collectives.
    SHARDWISE_GLOO_NATIVE=1 selects gloo's native ones (the tests check both agree).
    """
    return backend(group) == "gloo" and os.environ.get("SHARDWISE_GLOO_NATIVE", "") != "1"


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def global_rank_of(group: ProcessGroup | None, group_rank: int) -> int:
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def world_group() -> ProcessGroup:
    """The default process group as an object (what DeviceMesh.from_group needs)."""
    return dist.group.WORLD  # type: ignore[return-value]


def backend(group: ProcessGroup | None = None) -> str:
    return str(dist.get_backend(group)) if is_initialized() else "none"


def new_groups_2d(replicate: int, shard: int) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard group, replicate group) holding this rank in a replicate x shard layout.

    Every rank must create every group in the same order (a torch.distributed rule), so
    all groups are created here and only this rank's are returned.
    """
    me = dist.get_rank()
    mine_shard = mine_rep = None
    for r in range(replicate):
        ranks = list(range(r * shard, (r + 1) * shard))
        g = dist.new_group(ranks)
        if me in ranks:
            mine_shard = g
    for s in range(shard):
        ranks = [r * shard + s for r in range(replicate)]
        g = dist.new_group(ranks)
        if me in ranks:
            mine_rep = g
    assert mine_shard is not None and mine_rep is not None
    return mine_shard, mine_rep


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool,
    scratch: torch.Tensor | None = None,
    label: str = "",
) -> Work:
    """Gather equal flat `shard`s from every rank of `group` into `output` (rank-major).

    `label` names the caller (a unit's module path) in errors and debug fingerprints.

    On the all-to-all path the shard is sent to every peer from an (S, n) buffer: pass it as
    `scratch` (with `shard` = its first row, it is not copied again) or one is allocated.
    The caller must keep `scratch` untouched until the work is waited for.
    """
    if not use_all_to_all(group):
        handle, issued = _issue("all_gather", label, group, shard, lambda: _all_gather_flat(
            _h(output), _h(shard), group=group, async_op=async_op))
        return Work(handle if async_op else None, output, None, issued)
    S, n = world_size(group), shard.numel()
    send = scratch if scratch is not None else torch.empty(S * n, dtype=shard.dtype,
                                                           device=shard.device)
    rows = send.view(S, n)
    if rows[0].data_ptr() != shard.data_ptr():
        rows[0].copy_(shard)
    rows[1:].copy_(rows[0].expand(S - 1, n))
    handle, issued = _issue("all_gather", label, group, shard, lambda: dist.all_to_all_single(
        _h(output), _h(send), group=group, async_op=async_op))
    return Work(handle if async_op else None, output, None, issued)


def reduce_scatter_sum(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool,
    scratch: torch.Tensor | None = None,
    label: str = "",
) -> Work:
    """Sum `full` (rank-major segments) across `group`; this rank keeps its segment.

    On the all-to-all path every rank receives its segment from each peer into `scratch`
    (same size as `full`; allocated when None) and sums the S segments in rank order.
    """
    if not use_all_to_all(group):
        handle, issued = _issue("reduce_scatter", label, group, full, lambda: _reduce_scatter_flat(
            _h(output), _h(full), op=dist.ReduceOp.SUM, group=group, async_op=async_op))
        return Work(handle if async_op else None, output, None, issued)
    S = world_size(group)
    recv = scratch if scratch is not None else torch.empty_like(full)
    handle, issued = _issue("reduce_scatter", label, group, full, lambda: dist.all_to_all_single(
        _h(recv), _h(full), group=group, async_op=async_op))

    def local_sum() -> None:
        # Elementwise adds in rank order: torch.sum over dim 0 of an (S, n) view measured 8x
        # slower on CPU (1.93 ms vs 0.24 ms for S=2, n=1.6M).
        parts = recv.view(S, -1)
        torch.add(parts[0], parts[1], out=output) if S > 1 else output.copy_(parts[0])
        for r in range(2, S):
            output.add_(parts[r])

    if not async_op:
        local_sum()
        return Work(None, output)
    return Work(handle, output, local_sum, issued)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    op: str = "sum",
    async_op: bool = False,
    label: str = "",
) -> Work:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    handle, issued = _issue(f"all_reduce({op})", label, group, tensor, lambda: dist.all_reduce(
        _h(tensor), op=ops[op], group=group, async_op=async_op))
    return Work(handle if async_op else None, tensor, None, issued)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              label: str = "") -> torch.Tensor:
    _issue(f"broadcast(src={src})", label, group, tensor,
           lambda: dist.broadcast(_h(tensor), src=src, group=group))
    return tensor


def agree(flag: bool, group: ProcessGroup | None = None, label: str = "") -> bool:
    """True on every rank iff `flag` is True on every rank (one tiny all-reduce).

    Used so that a check which fails on one rank raises on all of them, instead of
    leaving the others blocked in the next collective.
    """
    if not is_initialized():
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int32)
    if backend(group) == "nccl":
        t = t.cuda()
    _issue("agree", label, group, t,
           lambda: dist.all_reduce(_h(t), op=dist.ReduceOp.MAX, group=group))
    return int(t.item()) == 0


def same_on_all(value: int, group: ProcessGroup | None = None, label: str = "") -> bool:
    """True on every rank iff every rank passed the same integer (two tiny all-reduces)."""
    if not is_initialized() or world_size(group) == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64)
    if backend(group) == "nccl":
        t = t.cuda()
    _issue("same_on_all", label, group, t,
           lambda: dist.all_reduce(_h(t), op=dist.ReduceOp.MAX, group=group))
    return int(t[0].item()) == value and int(-t[1].item()) == value


def barrier(group: ProcessGroup | None = None, label: str = "") -> None:
    if is_initialized():
        _issue("barrier", label, group, None, lambda: dist.barrier(group=group))


def _byte_device(group: ProcessGroup | None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend(group) == "nccl" \
        else torch.device("cpu")


def _padded_bytes(data: bytes, group: ProcessGroup | None) -> tuple[torch.Tensor, list[int]]:
    """(this rank's bytes padded to the longest rank's, every rank's length)."""
    device = _byte_device(group)
    n = world_size(group)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    _issue("exchange bytes", "", group, mine,
           lambda: _all_gather_flat(_h(lengths), _h(mine), group=group))
    sizes = [int(x) for x in lengths.cpu()]
    buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)  # gloo dislikes empty buffers
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device), sizes


def all_gather_bytes(data: bytes, group: ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (no pickling: raw bytes only)."""
    if not is_initialized() or world_size(group) == 1:
        return [data]
    buf, sizes = _padded_bytes(data, group)
    out = torch.empty(len(sizes) * buf.numel(), dtype=torch.uint8, device=buf.device)
    _issue("all_gather bytes", "", group, buf,
           lambda: _all_gather_flat(_h(out), _h(buf), group=group))
    rows = out.view(len(sizes), buf.numel()).cpu()
    return [rows[r, : sizes[r]].numpy().tobytes() for r in range(len(sizes))]


def gather_bytes(data: bytes, dst: int = 0, group: ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data` in rank order on group rank `dst`; [] on the other ranks."""
    if not is_initialized() or world_size(group) == 1:
        return [data]
    buf, sizes = _padded_bytes(data, group)
    me = rank(group)
    bufs = [torch.empty_like(buf) for _ in sizes] if me == dst else None
    _issue(f"gather bytes(dst={dst})", "", group, buf,
           lambda: dist.gather(_h(buf), [_h(b) for b in bufs] if bufs is not None else None,
                              dst=global_rank_of(group, dst), group=group))
    if bufs is None:
        return []
    return [b[:n].cpu().numpy().tobytes() for b, n in zip(bufs, sizes)]


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def broadcast_json(value: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Group rank `src`'s JSON-serializable `value`, on every rank (JSON, never pickle)."""
    import json

    data = json.dumps(value).encode() if rank(group) == src else b""
    return json.loads(all_gather_bytes(data, group)[src]) if world_size(group) > 1 else value


def all_gather_floats(values: list[float], group: ProcessGroup | None = None) -> list[list[float]]:
    """Each rank's list of floats, in rank order, on every rank."""
    import struct

    packed = struct.pack(f"<{len(values)}d", *values)
    return [list(struct.unpack(f"<{len(b) // 8}d", b)) for b in all_gather_bytes(packed, group)]
