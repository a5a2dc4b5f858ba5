"""How a process group moves a unit's flat buffers: chosen once per group, kept with its mesh.

[Note: gloo transport] gloo's all_gather_into_tensor and reduce_scatter_tensor are slow on
CPU: measured on 2 ranks over loopback with 12.6 MB units, all_gather took 13.3 ms and
reduce_scatter 25.4 ms (it reduces far more than its share), while all_to_all_single moved
the same bytes in 7.0 ms (gather, input replicated per peer) and 7.9 ms (scatter, plus a
local sum of S segments). Both move the bandwidth-optimal (S-1)/S of the buffer per rank,
and the result is bit-for-bit the same layout. NCCL keeps its native collectives.
SHARDWISE_GLOO_NATIVE=1 selects gloo's native ones (the tests check both agree).

[Note: pair transport] With two ranks in the group there is one peer, and a point-to-point
send/receive pair moves exactly the peer's bytes with no staging: the shard is written
straight into this rank's row of the gather output and sent from there (no send buffer, no
per-peer replica: all-to-all needs the shard copied into every row), and a reduce-scatter
sends the peer's row of the packed buffer and sums this rank's row with what arrives (gloo's
all-to-all first copies the local row into its output). Measured on 2 ranks, loopback,
3.2 MB rows: 5.6 ms vs 7.8 ms for all_to_all_single; at 12.8 MB, 72 ms vs 90 ms (loaded).
Gathers and reductions use separate tags, so a prefetch in flight beside a reduction never
pairs with it.

[Note: parameter messages] At two ranks the pair transport also moves a unit in parts: one
send and one receive per parameter, straight between the parameters' own storage. A gather
then receives the peer's chunk of each parameter into that parameter's unsharded buffer (no
rank-major output to copy out of: 241 of the 542 MB a bench30m step copied), and a
reduce-scatter sends each gradient's peer rows from the gradient itself (no pack: 121 MB).
Measured on 2 ranks, loopback, one 12.6 MB transformer block (12 parameters): 6.1 ms for the
24 messages against 8.9 ms for one message plus the copy-out (each message costs about
35 us), so parameters under `PART_MIN_BYTES` per rank (norms, biases: 256 KiB is about
what a copy moves in that time) travel packed together in one more message per bucket, with
the reduction's flags. The parts path is taken where it is exact: the pair transport,
gradients already in the reduce dtype, and not fp16, whose overflow guard divides before
the sum (reduce.py).

Buffers come from an `Allocator` the caller passes (the unit's buffer pool), as in FSDP2's
allocator protocol: the transport decides how big its buffers are, the caller where they
come from. A buffer the transport takes for itself it gives back when the work is waited.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import one_copy, one_copy_setup
from . import process_group as PG
from .work import Issued, Work, all_gather_flat, done, handoff, issue, reduce_scatter_flat


def kind_for(gloo: bool, size: int) -> str:
    """Which transport a group of `size` ranks uses: "native", "all_to_all" or "pair"."""
    if not gloo or os.environ.get("SHARDWISE_GLOO_NATIVE", "") == "1":
        return "native"
    if size == 2 and os.environ.get("SHARDWISE_GLOO_PAIR", "1") != "0":
        return "pair"
    return "all_to_all"


def gather_send_numel(kind: str, numel: int, size: int) -> int:
    """Elements of the pooled send buffer of an all-gather of `numel` per rank (0: the shard
    is written into the output: [Note: pair transport]). The planner's memory replay uses this
    same rule."""
    return {"native": numel, "all_to_all": numel * size, "pair": 0}[kind]


def reduce_recv_numel(kind: str, width: int, size: int) -> int:
    """Elements a reduce-scatter of `width` per rank receives into before its local sum (0:
    the backend reduces in place)."""
    return {"native": 0, "all_to_all": width * size, "pair": width}[kind]


# Below this many bytes per rank a parameter is not worth a message of its own: the small
# ones of a bucket travel packed together in one ([Note: parameter messages]).
PART_MIN_BYTES = 256 * 1024


def own_message(chunk_numel: int, itemsize: int) -> bool:
    """Whether a parameter's chunk travels as a message of its own when moving in parts."""
    return chunk_numel * itemsize >= PART_MIN_BYTES


def gathers_in_parts(transport: Transport) -> bool:
    """Whether a unit's all-gather goes parameter by parameter ([Note: parameter messages])."""
    return transport.name == "pair"


def reduces_in_parts(transport: Transport, reduce_dtype: torch.dtype,
                     grad_dtypes: list[torch.dtype]) -> bool:
    """Whether a bucket's reduce-scatter goes parameter by parameter: the pair transport,
    every gradient already in the reduce dtype, and not fp16 (divided before the sum)."""
    return (transport.name == "pair" and reduce_dtype != torch.float16
            and all(d == reduce_dtype for d in grad_dtypes))


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

    # True: gather_buffer returns a view of the output (nothing to give back to the pool).
    gather_in_place = False

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator, out: torch.Tensor | None = None) -> torch.Tensor:
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
                      alloc: Allocator, out: torch.Tensor | None = None) -> torch.Tensor:
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


class _Both:
    """The handle of a send and a receive issued together."""

    def __init__(self, *handles: object) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()  # type: ignore[attr-defined]
        self.handles = ()  # waited: a second wait (the release) returns at once

    # gloo's send completes without the peer: both sides are done together.
    wait_received = wait


_GATHER_TAG, _REDUCE_TAG = 23001, 23002

class PairTransport(AllToAllTransport):
    """gloo on CPU with two ranks: one send and one receive ([Note: pair transport])."""

    name = "pair"
    gather_in_place = True

    def __init__(self, group: ProcessGroup | None) -> None:
        super().__init__(group)
        me = PG.rank(group)
        self.me, self.peer = me, 1 - me
        self.peer_global = PG.global_rank_of(group, self.peer)
        self.channel: one_copy.Channel | None = None

    def _channel(self, tensors: list[torch.Tensor]) -> one_copy.Channel | None:
        """The one-copy channel to the peer ([Note: one-copy exchange]) when these tensors
        can use it, else None: gloo it is."""
        if not one_copy.usable(tensors):
            return None
        if self.channel is None:
            timeout = one_copy_setup.group_timeout_s(self.group,
                                               PG.timeout_s or PG.DEFAULT_TIMEOUT_S)
            self.channel = one_copy_setup.channel_for(self.group, self.me, self.peer_global,
                                                timeout)
        return self.channel

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor,
                  tag: int) -> _Both | one_copy.Exchange:
        channel = self._channel([send, recv])
        if channel is not None:
            return one_copy.Exchange(channel, [send], [recv], tag)
        s = dist.isend(handoff(send), self.peer_global, group=self.group, tag=tag)
        r = dist.irecv(handoff(recv), self.peer_global, group=self.group, tag=tag)
        return _Both(s, r)

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:  # a caller without an output yet: a plain send buffer
            return alloc.get(numel, dtype, device)
        return out[self.me * numel : (self.me + 1) * numel]

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, numel: int, async_op: bool,
                   label: str = "") -> Work:
        rows = out.view(2, numel)
        if send.data_ptr() != rows[self.me].data_ptr():
            rows[self.me].copy_(send[:numel])
        handle, issued = issue("all_gather", label, self.group, rows[self.me],
                               lambda: self._exchange(rows[self.me], rows[self.peer],
                                                      _GATHER_TAG))
        if not async_op:
            handle.wait()
        return done(handle, async_op, out, issued)

    def exchange_parts(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], op: str,
                       label: str, output: torch.Tensor,
                       post: Callable[[], None] | None = None,
                       async_op: bool = True) -> Work:
        """Send `sends` and receive `recvs` in order ([Note: parameter messages]): the peer
        issues the same lists, its sends matching these receives one for one."""
        tag = _GATHER_TAG if op == "all_gather" else _REDUCE_TAG
        # What the debug check compares across ranks: elements sent plus received (the same
        # on both ranks even where their rows differ in number), as one flat shape.
        moved = sum(t.numel() for t in sends) + sum(t.numel() for t in recvs)
        sent = torch.empty(moved, dtype=output.dtype, device="meta")

        def call() -> _Both | one_copy.Exchange:
            # Set up inside the issue, after the debug check: a divergence at a group's
            # first exchange is then named, not a stall in the set-up's gloo messages.
            channel = self._channel(sends + recvs)
            if channel is not None:
                return one_copy.Exchange(channel, sends, recvs, tag)
            peer, group = self.peer_global, self.group
            return _Both(*[dist.isend(handoff(t), peer, group=group, tag=tag) for t in sends],
                         *[dist.irecv(handoff(t), peer, group=group, tag=tag) for t in recvs])

        handle, issued = issue(op, label, self.group, sent, call)
        if not async_op:
            # The receives are in; the sends stay the peer's to read until the caller's
            # `wait_sent` ([Note: one-copy release]).
            handle.wait_received()
            if post is not None:
                post()
            return Work(handle, output, None, issued)
        return Work(handle, output, post, issued)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool,
                       alloc: Allocator, label: str = "") -> Work:
        rows = full.view(2, -1)
        recv = alloc.get(reduce_recv_numel(self.name, rows.shape[1], 2), full.dtype,
                         full.device)
        handle, issued = issue("reduce_scatter", label, self.group, full,
                               lambda: self._exchange(rows[self.peer], recv, _REDUCE_TAG))

        def local_sum() -> None:
            # Rank order, as the all-to-all sum: rank 0's row + rank 1's row.
            a, b = (rows[0], recv) if self.me == 0 else (recv, rows[1])
            torch.add(a, b, out=out)
            alloc.release(recv)

        if not async_op:
            handle.wait()
            local_sum()
            return Work(None, out)
        return Work(handle, out, local_sum, issued)


def transport_for(group: ProcessGroup | None) -> Transport:
    kind = kind_for(PG.backend(group) == "gloo", PG.world_size(group))
    return {"native": Transport, "all_to_all": AllToAllTransport,
            "pair": PairTransport}[kind](group)


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

    @property
    def gather_in_place(self) -> bool:  # type: ignore[override]
        # The user's all-gather gets its own send buffer; without one, the base decides.
        return self.ag is None and self.base.gather_in_place

    def gather_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                      alloc: Allocator, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.ag is None:
            return self.base.gather_buffer(numel, dtype, device, alloc, out)
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
