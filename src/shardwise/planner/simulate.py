"""Two training steps replayed on byte counters: the peak of each phase.

Peaks come from *when* things are alive, not from adding every term: at the end of forward
all activations exist but no gradients; by the end of backward the reverse. So this replays
the engine's schedule (engine/hooks.py, [Note: prefetch]) unit by unit, with the engine's
own `BufferPool` on the meta device doing the pool's bookkeeping:

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

from collections import deque
from dataclasses import dataclass, field

import torch

from ..engine.buffers import BufferPool
from ..engine.hooks import MAX_GATHERS_IN_FLIGHT, MAX_REDUCES_IN_FLIGHT
from .memory import UnitCost, _size

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


class _Sim:
    def __init__(self, costs: list[UnitCost], shard_size: int, reshard_after_forward: bool,
                 acts: StepActivations, scratch: bool) -> None:
        self.costs = costs
        self.S = shard_size
        self.reshard_after_forward = reshard_after_forward
        self.acts = acts
        self.scratch = scratch  # gloo copies whole collective buffers while in flight
        self.t = _Tally()
        self.pool = BufferPool()
        self.state = ["sharded"] * len(costs)
        self.gathers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in costs]
        self.pending: deque[tuple[int, list]] = deque()
        self.grads_alive = 0

    # --- the pool, through the engine's own class -------------------------------------------

    def _get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        before = self.pool.allocated_bytes
        buf = self.pool.get(numel, dtype, META)
        self.t.add(self.pool.allocated_bytes - before, "comm")
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        before = self.pool.allocated_bytes
        self.pool.release(buf)
        self.t.add(self.pool.allocated_bytes - before, "comm")

    # --- unit state machine (engine/unit.py) ------------------------------------------------

    def unshard(self, i: int) -> None:
        if self.state[i] != "sharded":
            return
        if self.S > 1:
            for dtype, chunk in self.costs[i].gather:
                send = self._get(chunk, dtype)
                out = self._get(chunk * self.S, dtype)
                if self.scratch:
                    # gloo gathers into a flat output of its own and copies it out: a copy
                    # that lives while the all-gather runs, which is right after issue.
                    extra = chunk * self.S * _size(dtype)
                    self.t.add(extra, "comm")
                    self.t.add(-extra, "comm")
                self.gathers[i].append((send, out))
        self.state[i] = "gathering"

    def wait_unshard(self, i: int) -> None:
        if self.state[i] == "unsharded":
            return
        self.unshard(i)
        self.t.add(self.costs[i].unsharded_bytes, "unsharded")
        for send, out in self.gathers[i]:
            self._release(send)
            self._release(out)
        self.gathers[i].clear()
        self.state[i] = "unsharded"

    def reshard(self, i: int) -> None:
        if self.state[i] == "sharded":
            return
        self.wait_unshard(i)
        self.t.add(-self.costs[i].unsharded_bytes, "unsharded")
        self.state[i] = "sharded"

    def prefetch(self, i: int) -> None:
        in_flight = sum(1 for s in self.state if s == "gathering")
        if 0 <= i < len(self.costs) and self.state[i] == "sharded" \
                and in_flight < MAX_GATHERS_IN_FLIGHT:
            self.unshard(i)

    def reduce(self, i: int) -> None:
        c = self.costs[i]
        if not c.reduce:
            return
        parts = []
        for rdtype, n, kept in c.reduce:
            rsize = _size(rdtype)
            if self.S > 1:
                send = self._get(n * self.S, rdtype)
                out = n * rsize  # fresh reduce-scatter output
                # gloo reduces a copy of the whole input, kept by the pending work.
                extra = n * self.S * rsize if self.scratch else 0
            else:
                send = None
                out = n * rsize  # the packed buffer itself becomes the gradients
                extra = 0
            self.t.add(out, "grads")
            self.t.add(extra, "comm")
            parts.append((send, out, extra, kept))
        if not c.direct:
            self.t.add(-c.full_grad_bytes, "full_grads")  # packed: full gradients freed
        self.pending.append((i, parts))
        while len(self.pending) > MAX_REDUCES_IN_FLIGHT:
            self.finish(*self.pending.popleft())

    def finish(self, i: int, parts: list) -> None:
        for send, out, extra, kept in parts:
            if send is not None:
                self._release(send)
            self.t.add(-extra, "comm")
            # What stays as the sharded gradient: the output itself (views) and/or copies
            # cast back to the master dtype.
            self.t.add(kept - out, "grads")
            self.grads_alive += kept
        if self.costs[i].direct:
            self.t.add(-self.costs[i].full_grad_bytes, "full_grads")  # replaced by the result

    # --- phases ------------------------------------------------------------------------------

    def forward(self, first: bool) -> None:
        n, a = len(self.costs), self.acts
        for i in range(n):
            self.wait_unshard(i)
            if not first:
                self.prefetch(i + 1)
            self.t.add(a.layer * self.costs[i].layers, "acts")
            if self.reshard_after_forward and i != 0:
                self.reshard(i)
        self.t.add(a.head, "acts")  # the root's head and loss run last
        self.t.add(a.head_transient, "acts")
        self.t.add(-a.head_transient, "acts")
        for i in range(n):
            if self.state[i] == "gathering":  # a prefetch nobody used
                self.reshard(i)

    def backward(self) -> None:
        n, a = len(self.costs), self.acts
        root = self.costs[0]
        # Loss and head: logits' gradients, the root's full gradients (head weight) appear.
        self.wait_unshard(0)
        self.t.add(root.full_grad_bytes, "full_grads")
        self.t.add(a.head_transient, "acts")
        self.t.add(-a.head_transient - a.head, "acts")
        for i in range(n - 1, 0, -1):
            c = self.costs[i]
            self.wait_unshard(i)
            self.prefetch(i - 1)
            self._compute_backward(a.layer * c.layers, a.layer_backward * c.layers,
                                   c.full_grad_bytes)
            self.reduce(i)
            self.reshard(i)
        # Blocks attributed to the root (no unit of their own) run inside its backward.
        self._compute_backward(a.layer * root.layers, a.layer_backward * root.layers, 0)
        self.reduce(0)
        while self.pending:
            self.finish(*self.pending.popleft())
        for i in range(n):
            self.reshard(i)

    def _compute_backward(self, saved: int, transient: int, full_grads: int) -> None:
        """One unit's backward: its gradients in flight appear; as autograd walks back
        through the unit, saved activations are released while weight gradients appear, so
        the two trade places (the peak is the larger of them, not their sum)."""
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
             optimizer_temp_bytes: int, scratch: bool) -> PhasePeaks:
    """Peaks by phase over two steps (the first builds optimizer state, the second prefetches
    in forward too). `static_bytes`: held throughout (parameter shards, buffers)."""
    sim = _Sim(costs, shard_size, reshard_after_forward, acts, scratch)
    sim.t.add(static_bytes, "static")
    sim.t.mark()
    peaks = PhasePeaks()
    for first in (True, False):
        sim.forward(first)
        peaks.forward = max(peaks.forward, sim.t.mark())
        sim.backward()
        peaks.backward = max(peaks.backward, sim.t.mark())
        sim.step(first, optimizer_bytes, optimizer_temp_bytes)
        peaks.step = max(peaks.step, sim.t.mark())
        sim.zero_grad()
    pp = sim.t.part_peaks
    peaks.unsharded = pp.get("unsharded", 0)
    peaks.comm_buffers = pp.get("comm", 0)
    peaks.activations = pp.get("acts", 0)
    return peaks
