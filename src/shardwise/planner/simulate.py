"""Two training steps replayed on byte counters: the peak of each phase.

Peaks come from *when* things are alive, not from adding every term: at the end of forward
all activations exist but no gradients; by the end of backward the reverse. So this replays
the engine's own schedule (engine/core/schedule.py: the same `Schedule` object the engine's hooks
drive, over units that count bytes instead of moving them) unit by unit, with the engine's
own `BufferPool` on the meta device doing the pool's bookkeeping. replay.py's walk only says
where the step is, as the hooks do; prefetching, limits, resharding and draining are the
schedule's:

forward   root unshards (and stays unsharded); each unit: wait for its all-gather, prefetch
          the next one (at most 2 in flight; not on the first step, whose order is unknown),
          compute (its activations appear), reshard (FULL_SHARD/HYBRID, not the root);
          the head's logits and loss come last.
backward  the loss and head first (root's full gradients appear), then each unit in reverse:
          gather (again, if resharded), prefetch the previous one, compute (full gradients
          appear, its activations go), reduce-scatter (async, at most 2 in flight: each
          holds a pooled send buffer) and reshard; the root reduces last.
step      the optimizer's state appears on the first step; its temporaries come and go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine.comm.transport import gather_send_numel, kind_for, reduce_recv_numel
from ..engine.core.policies import DEFAULT_COALESCE_BYTES
from ..engine.core.schedule import DEFAULT_LIMITS, Coalesce, Limits, Schedule
from ..engine.core.unit import BufferPool
from .memory import UnitCost, _size
from .replay import ReplayUnit, replay_backward, replay_forward

META = torch.device("meta")


@dataclass(frozen=True)
class StepActivations:
    """Activation bytes of one step on one rank (already multiplied by tokens).

    layer: saved by one transformer block from its forward to its backward.
    layer_backward: extra while one block runs backward (its gradients in flight); with
      activation checkpointing this includes the block's recomputed activations.
    head: saved by the root outside the blocks (embedding ids, final norm, head, loss).
    head_transient: logits and their copies at the end of forward / start of backward.
    """

    layer: int = 0
    layer_backward: int = 0
    head: int = 0
    head_transient: int = 0


@dataclass
class PhasePeaks:
    forward: int = 0
    backward: int = 0
    step: int = 0
    unsharded: int = 0  # most bytes of gathered parameters (and their gather buffers) at once
    comm_buffers: int = 0  # most bytes held by the buffer pool (+ backend scratch) at once
    activations: int = 0  # most activation bytes at once
    dequant: int = 0  # the largest NF4 weight's dequantization, for a moment
    # Most all-gathers (issued ahead) and reductions in flight at once, as the schedule ran.
    gathers_in_flight: int = 0
    reduces_in_flight: int = 0


@dataclass
class _Tally:
    """Bytes alive on the rank; `peak` since the last `mark`."""

    now: int = 0
    peak: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    part_peaks: dict[str, int] = field(default_factory=dict)

    def add(self, n: int, part: str) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.parts[part] = self.parts.get(part, 0) + n
        self.part_peaks[part] = max(self.part_peaks.get(part, 0), self.parts[part])

    def mark(self) -> int:
        p, self.peak = self.peak, self.now
        return p


def terms(cost: UnitCost, shard_size: int, budget: int) -> Coalesce | None:
    """What the engine's `Unit.coalesce` answers for this unit: one bucket, sharded
    ([Note: coalesced units] in engine/core/schedule.py)."""
    if budget <= 0 or shard_size == 1 or cost.direct or len(cost.gather) != 1:
        return None
    dtype, chunk = cost.gather[0]
    if chunk == 0 or len(cost.reduce) > 1:
        return None
    rdtype = cost.reduce[0][0] if cost.reduce else dtype
    return Coalesce((dtype, rdtype), chunk * shard_size * _size(dtype), budget)


class _Shared:
    """A group's one all-gather: its buffers go back when the last member was waited for."""

    def __init__(self, send: torch.Tensor | None, out: torch.Tensor, left: int) -> None:
        self.send, self.out, self.left = send, out, left


class _SimUnit(ReplayUnit):
    """A unit that counts bytes (replay.py's `ReplayUnit`)."""

    def __init__(self, sim: _Sim, i: int, reshard_after_forward: bool) -> None:
        super().__init__(i, reshard_after_forward)
        self.sim, self.cost = sim, sim.costs[i]
        self.gathers: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        self.shared: _Shared | None = None

    def _issue_group_gather(self, members: Sequence[ReplayUnit]) -> None:
        dtype = self.cost.gather[0][0]
        chunk = sum(m.cost.gather[0][1] for m in members)  # type: ignore[attr-defined]
        send, out = self.sim.gather_buffers(dtype, chunk)
        shared = _Shared(send, out, len(members))
        for m in members:
            m.shared = shared  # type: ignore[attr-defined]

    def open_batch(self, members: Sequence[ReplayUnit]) -> _SimBatch:
        return _SimBatch(self.sim, list(members))

    def _issue_gather(self) -> None:
        sim = self.sim
        if sim.S > 1:
            for dtype, chunk in self.cost.gather:
                self.gathers.append(sim.gather_buffers(dtype, chunk))

    def _gathered(self) -> None:
        self.sim.t.add(self.cost.unsharded_bytes, "unsharded")
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.left -= 1
            if not shared.left:
                if shared.send is not None:
                    self.sim.release(shared.send)
                self.sim.release(shared.out)
        for send, out in self.gathers:
            if send is not None:
                self.sim.release(send)
            self.sim.release(out)
        self.gathers.clear()

    def _freed(self) -> None:
        self.sim.t.add(-self.cost.unsharded_bytes, "unsharded")

    def _issue_reduce(self) -> Sequence[_SimReduce]:
        c, sim = self.cost, self.sim
        if not c.reduce:
            return ()
        parts = []
        for rdtype, n, kept in c.reduce:
            rsize = _size(rdtype)
            if sim.S > 1:
                send = sim.get(n * sim.S, rdtype)
                out = n * rsize  # fresh reduce-scatter output
                # What the transport receives into before its local sum, held by the
                # pending work (engine/comm/transport.py).
                extra = reduce_recv_numel(sim.transport, n, sim.S) * rsize
            else:
                send = None
                out = n * rsize  # the packed buffer itself becomes the gradients
                extra = 0
            sim.t.add(out, "grads")
            sim.t.add(extra, "comm")
            parts.append((send, out, extra, kept))
        if not c.direct:
            sim.t.add(-c.full_grad_bytes, "full_grads")  # packed: full gradients freed
        return (_SimReduce(self, parts),)


class _SimBatch:
    """A group's gradients packed into one reduce buffer ([Note: coalesced units])."""

    def __init__(self, sim: _Sim, members: list[_SimUnit]) -> None:
        self.sim, self.members = sim, members
        self.width = sum(m.cost.reduce[0][1] for m in members if m.cost.reduce)
        self.send: torch.Tensor | None = None
        self.kept = 0
        self.lead: _SimUnit | None = None
        self.packed: list[_SimUnit] = []

    def pack(self, unit: _SimUnit) -> None:
        c, sim = unit.cost, self.sim
        if c.reduce:
            self.packed.append(unit)
            if self.send is None:
                self.lead = unit
                self.send = sim.get(self.width * sim.S, c.reduce[0][0])
            self.kept += c.reduce[0][2]
        sim.t.add(-c.full_grad_bytes, "full_grads")  # packed: full gradients freed

    def issue(self) -> Sequence[_SimReduce]:
        send, self.send = self.send, None
        if send is None or self.lead is None:
            return ()
        sim, rdtype = self.sim, self.lead.cost.reduce[0][0]
        out = self.width * _size(rdtype)
        extra = reduce_recv_numel(sim.transport, self.width, sim.S) * _size(rdtype)
        sim.t.add(out, "grads")
        sim.t.add(extra, "comm")
        pr = _SimReduce(self.lead, [(send, out, extra, self.kept)])
        pr.units = list(self.packed)
        return (pr,)


class _SimReduce:
    def __init__(self, unit: _SimUnit, parts: list) -> None:
        self.unit, self.parts = unit, parts
        self.units = [unit]  # a group's: every member ([Note: coalesced units])

    def finish(self) -> None:
        sim = self.unit.sim
        for send, out, extra, kept in self.parts:
            if send is not None:
                sim.release(send)
            sim.t.add(-extra, "comm")
            # What stays as the sharded gradient: the output itself (views) and/or copies
            # cast back to the master dtype.
            sim.t.add(kept - out, "grads")
            sim.grads_alive += kept
        if self.unit.cost.direct:
            # Replaced by the result.
            sim.t.add(-self.unit.cost.full_grad_bytes, "full_grads")


class _Sim:
    def __init__(self, costs: list[UnitCost], shard_size: int, reshard_after_forward: bool,
                 acts: StepActivations, scratch: bool, limits: Limits,
                 coalesce_bytes: int = DEFAULT_COALESCE_BYTES) -> None:
        self.costs = costs
        self.S = shard_size
        self.acts = acts
        self.scratch = scratch  # gloo copies whole collective buffers while in flight
        # The engine's transport for this group (gloo: scratch; engine/comm/transport.py).
        self.transport = kind_for(scratch, shard_size)
        self.t = _Tally()
        self.pool = BufferPool()
        self.units = [_SimUnit(self, i, reshard_after_forward) for i in range(len(costs))]
        for u in self.units:
            u.terms = terms(u.cost, shard_size, coalesce_bytes)
        self.schedule: Schedule[_SimUnit] = Schedule(self.units, limits)
        self.grads_alive = 0

    # --- the pool, through the engine's own class -------------------------------------------

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        before = self.pool.allocated_bytes
        buf = self.pool.get(numel, dtype, META)
        self.t.add(self.pool.allocated_bytes - before, "comm")
        return buf

    def gather_buffers(self, dtype: torch.dtype, chunk: int
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(send, out) of one all-gather of `chunk` elements per rank, as the engine takes
        them: the output first, then the send buffer its transport sizes
        (engine/comm/transport.py)."""
        out = self.get(chunk * self.S, dtype)
        n = gather_send_numel(self.transport, chunk, self.S)
        send = self.get(n, dtype) if n else None
        if self.scratch:
            # gloo gathers into a flat output of its own and copies it out: a copy that
            # lives while the all-gather runs, which is right after issue.
            extra = chunk * self.S * _size(dtype)
            self.t.add(extra, "comm")
            self.t.add(-extra, "comm")
        return send, out

    def release(self, buf: torch.Tensor) -> None:
        before = self.pool.allocated_bytes
        self.pool.release(buf)
        self.t.add(self.pool.allocated_bytes - before, "comm")

    # --- the step's work between the schedule's calls (replay.py's `StepWork`) -------------

    def forward(self, unit: _SimUnit) -> None:
        self.t.add(self.acts.layer * unit.cost.layers, "acts")
        # Its largest NF4 weight dequantized for a moment (at the unit's last linears, with
        # its activations made: [Note: NF4 dequantization] in memory.py).
        self.t.add(unit.cost.dequant_bytes, "dequant")
        self.t.add(-unit.cost.dequant_bytes, "dequant")

    def head_forward(self) -> None:
        a = self.acts
        self.t.add(a.head, "acts")  # the root's head and loss run last
        self.t.add(a.head_transient, "acts")
        self.t.add(-a.head_transient, "acts")

    def head_backward(self) -> None:
        # Loss and head: logits' gradients, the root's full gradients (head weight) appear.
        a = self.acts
        self.t.add(self.units[0].cost.full_grad_bytes, "full_grads")
        self.t.add(a.head_transient, "acts")
        self.t.add(-a.head_transient - a.head, "acts")

    def backward(self, unit: _SimUnit) -> None:
        a = self.acts
        self._compute_backward(a.layer * unit.cost.layers, a.layer_backward * unit.cost.layers,
                               unit.cost.full_grad_bytes, unit.cost.dequant_bytes)

    def root_backward(self) -> None:
        # Blocks attributed to the root (no unit of their own) run inside its backward.
        a, root = self.acts, self.units[0]
        self._compute_backward(a.layer * root.cost.layers, a.layer_backward * root.cost.layers,
                               0, root.cost.dequant_bytes)

    def _compute_backward(self, saved: int, transient: int, full_grads: int,
                          dequant: int = 0) -> None:
        """One unit's backward: its gradients in flight appear; as autograd walks back
        through the unit, saved activations are released while weight gradients appear, so
        the two trade places (the peak is the larger of them, not their sum). An NF4 weight
        is dequantized again for its input gradient, while the saved activations are
        still there (the last linears run backward first)."""
        self.t.add(dequant, "dequant")
        self.t.add(-dequant, "dequant")
        self.t.add(transient, "acts")
        self.t.add(-saved, "acts")
        self.t.add(full_grads, "full_grads")
        self.t.add(-transient, "acts")

    def step(self, first: bool, optimizer_bytes: int, temp_bytes: int) -> None:
        if first:
            self.t.add(optimizer_bytes, "optimizer")  # created lazily by the first step()
        self.t.add(temp_bytes, "optimizer_temp")
        self.t.add(-temp_bytes, "optimizer_temp")

    def zero_grad(self) -> None:
        self.t.add(-self.grads_alive, "grads")
        self.grads_alive = 0


def simulate(costs: list[UnitCost], *, shard_size: int, reshard_after_forward: bool,
             acts: StepActivations, static_bytes: int, optimizer_bytes: int,
             optimizer_temp_bytes: int, scratch: bool,
             limits: Limits = DEFAULT_LIMITS,
             coalesce_bytes: int = DEFAULT_COALESCE_BYTES) -> PhasePeaks:
    """Peaks by phase over two steps (the first builds optimizer state, the second prefetches
    in forward too). `static_bytes`: held throughout (parameter shards, buffers)."""
    sim = _Sim(costs, shard_size, reshard_after_forward, acts, scratch, limits, coalesce_bytes)
    sim.t.add(static_bytes, "static")
    sim.t.mark()
    peaks = PhasePeaks()
    for first in (True, False):
        replay_forward(sim.schedule, sim)
        peaks.forward = max(peaks.forward, sim.t.mark())
        replay_backward(sim.schedule, sim)
        peaks.backward = max(peaks.backward, sim.t.mark())
        sim.step(first, optimizer_bytes, optimizer_temp_bytes)
        peaks.step = max(peaks.step, sim.t.mark())
        sim.zero_grad()
    pp = sim.t.part_peaks
    peaks.unsharded = pp.get("unsharded", 0)
    peaks.comm_buffers = pp.get("comm", 0)
    peaks.activations = pp.get("acts", 0)
    peaks.dequant = pp.get("dequant", 0)
    peaks.gathers_in_flight = sim.schedule.most_gathers
    peaks.reduces_in_flight = sim.schedule.most_reduces
    return peaks
