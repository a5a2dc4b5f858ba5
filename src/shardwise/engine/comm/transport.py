"""How a process group moves a unit's flat buffers: chosen once per group, kept with its mesh.

[Note: gloo transport] gloo's all_gather_into_tensor and reduce_scatter_tensor are slow on
CPU: measured on 2 ranks over loopback with 12.6 MB units, all_gather took 13.3 ms and
reduce_scatter 25.4 ms (it reduces far more than its share), while all_to_all_single moved
the same bytes in 7.0 ms (gather, input replicated per peer) and 7.9 ms (scatter, plus a
local sum of S segments). Both move the bandwidth-optimal (S-1)/S of the buffer per rank,
and the result is bit-for-bit the same layout. NCCL keeps its native collectives.
SHARDWISE_GLOO_NATIVE=1 selects gloo's native ones (the tests check both agree).

Buffers come from an `Allocator` the caller passes (the unit's buffer pool), as in FSDP2's
allocator protocol: the transport decides how big its buffers are, the caller where they
come from. A buffer the transport takes for itself it gives back when the work is waited.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group as PG
from .work import Issued, Work, all_gather_flat, done, handoff, issue, reduce_scatter_flat


def kind_for(gloo: bool, size: int) -> str:
    """Which transport a group of `size` ranks uses: "native" or "all_to_all"."""
    if not gloo or size == 1 or os.environ.get("SHARDWISE_GLOO_NATIVE", "") == "1":
        return "native"
    return "all_to_all"


def gather_send_numel(kind: str, numel: int, size: int) -> int:
    """Elements of the pooled send buffer of an all-gather of `numel` per rank. The
    planner's memory replay uses this same rule."""
    return {"native": numel, "all_to_all": numel * size}[kind]


def reduce_recv_numel(kind: str, width: int, size: int) -> int:
    """Elements a reduce-scatter of `width` per rank receives into before its local sum (0:
    the backend reduces in place)."""
    return {"native": 0, "all_to_all": width * size}[kind]


class Allocator(Protocol):
    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...
    def release(self, buf: torch.Tensor) -> None: ...


class FreshBuffers:
    """An allocator without reuse (one-off collectives outside a unit)."""

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, buf: torch.Tensor) -> None:
        pass


def use_all_to_all(group: ProcessGroup | None) -> bool:
    """Whether gather/scatter on `group` go through all-to-all ([Note: gloo transport])."""
    return PG.backend(group) == "gloo" and os.environ.get("SHARDWISE_GLOO_NATIVE", "") != "1"


class Transport:
    """Native all-gather / reduce-scatter over `group` (what NCCL uses)."""

    name = "native"

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = PG.world_size(group)

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator) -> torch.Tensor:
        """The send buffer of an all-gather of `numel` elements per rank into `out`; the
        caller fills its first `numel` elements with this rank's shard."""
        return alloc.get(numel, dtype, device)

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, numel: int, async_op: bool,
                   label: str = "") -> Work:
        """Every rank's `send[:numel]` into `out`, rank-major."""
        shard = send[:numel]
        handle, issued = issue("all_gather", label, self.group, shard, lambda: all_gather_flat(
            handoff(out), handoff(shard), group=self.group, async_op=async_op))
        return done(handle, async_op, out, issued)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool,
                       alloc: Allocator, label: str = "") -> Work:
        """Sum `full` (rank-major segments) across the group; this rank keeps its segment."""
        handle, issued = issue("reduce_scatter", label, self.group, full,
                               lambda: reduce_scatter_flat(handoff(out), handoff(full),
                                                           op=dist.ReduceOp.SUM,
                                                           group=self.group, async_op=async_op))
        return done(handle, async_op, out, issued)


class AllToAllTransport(Transport):
    """gloo on CPU: gather and scatter as one all-to-all each ([Note: gloo transport])."""

    name = "all_to_all"

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator) -> torch.Tensor:
        # The shard goes to every peer: an (S, numel) buffer whose first row is the shard.
        return alloc.get(gather_send_numel(self.name, numel, self.size), dtype, device)

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, numel: int, async_op: bool,
                   label: str = "") -> Work:
        rows = send[: numel * self.size].view(self.size, numel)
        rows[1:].copy_(rows[0].expand(self.size - 1, numel))
        handle, issued = issue("all_gather", label, self.group, rows[0],
                               lambda: dist.all_to_all_single(handoff(out), handoff(rows),
                                                              group=self.group,
                                                              async_op=async_op))
        return done(handle, async_op, out, issued)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool,
                       alloc: Allocator, label: str = "") -> Work:
        S = self.size
        recv = alloc.get(reduce_recv_numel(self.name, full.numel() // S, S), full.dtype,
                         full.device)
        handle, issued = issue("reduce_scatter", label, self.group, full,
                               lambda: dist.all_to_all_single(handoff(recv), handoff(full),
                                                              group=self.group,
                                                              async_op=async_op))

        def local_sum() -> None:
            # Elementwise adds in rank order: torch.sum over dim 0 of an (S, n) view measured
            # 8x slower on CPU (1.93 ms vs 0.24 ms for S=2, n=1.6M).
            parts = recv.view(S, -1)
            torch.add(parts[0], parts[1], out=out) if S > 1 else out.copy_(parts[0])
            for r in range(2, S):
                out.add_(parts[r])
            alloc.release(recv)

        if not async_op:
            local_sum()
            return Work(None, out)
        return Work(handle, out, local_sum, issued)


def transport_for(group: ProcessGroup | None) -> Transport:
    kind = kind_for(PG.backend(group) == "gloo", PG.world_size(group))
    return {"native": Transport, "all_to_all": AllToAllTransport}[kind](group)


class CustomTransport(Transport):
    """A unit's collectives through user objects of FSDP2's Comm protocol
    (`set_custom_all_gather` / `set_custom_reduce_scatter`); the other kind stays `base`'s.

    Each call allocates its output with the user's `allocate` and copies the result into the
    engine's buffer when the work is waited for, so the user's object decides the memory
    the collective itself writes, as in FSDP2.
    """

    name = "custom"

    def __init__(self, base: Transport, all_gather: object | None = None,
                 reduce_scatter: object | None = None) -> None:
        prev = base if isinstance(base, CustomTransport) else None
        self.base: Transport = prev.base if prev is not None else base
        super().__init__(self.base.group)
        self.size = self.base.size
        self.ag = all_gather if all_gather is not None else (prev.ag if prev else None)
        self.rs = reduce_scatter if reduce_scatter is not None else (prev.rs if prev else None)

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator) -> torch.Tensor:
        if self.ag is None:
            return self.base.gather_buffer(numel, dtype, device, alloc)
        return alloc.get(numel, dtype, device)

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, numel: int, async_op: bool,
                   label: str = "") -> Work:
        if self.ag is None:
            return self.base.all_gather(out, send, numel, async_op, label)
        comm = self.ag
        shard = send[:numel]
        result = comm.allocate((out.numel(),), dtype=out.dtype,  # type: ignore[attr-defined]
                               device=out.device)
        handle, issued = issue("all_gather", label, self.group, shard, lambda: comm(  # type: ignore[operator]
            output_tensor=result, input_tensor=shard, group=self.group, async_op=async_op))
        return _copied(handle, async_op, out, result, issued)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool,
                       alloc: Allocator, label: str = "") -> Work:
        if self.rs is None:
            return self.base.reduce_scatter(out, full, async_op, alloc, label)
        comm = self.rs
        result = comm.allocate((out.numel(),), dtype=out.dtype,  # type: ignore[attr-defined]
                               device=out.device)
        handle, issued = issue("reduce_scatter", label, self.group, full, lambda: comm(  # type: ignore[operator]
            output_tensor=result, input_tensor=full, group=self.group, op=dist.ReduceOp.SUM,
            async_op=async_op))
        return _copied(handle, async_op, out, result, issued)


def _copied(handle: object, async_op: bool, out: torch.Tensor, result: torch.Tensor,
            issued: Issued) -> Work:
    def post() -> None:
        if result.data_ptr() != out.data_ptr():
            out.copy_(result.view(out.shape))

    if not async_op or handle is None:
        if handle is not None:
            handle.wait()  # type: ignore[attr-defined]
        post()
        return Work(None, out, None, issued)
    return Work(handle, out, post, issued)
