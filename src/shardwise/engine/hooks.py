"""Module and autograd hooks that drive the units through a step.

Per unit: forward pre-hook (unshard, prefetch the next unit), forward post-hook (reshard
under FULL_SHARD, hook the outputs for backward), pre-backward (a gradient hook on the
outputs: unshard again, prefetch the previous unit), post-backward (a post-accumulate-grad
hook per parameter: when the last gradient of the unit arrives, reduce and reshard), and a
final callback queued on the autograd engine by the root (flush units whose gradients never
all arrived, wait for every pending reduction, reshard everything).

[Note: prefetch] The order in which units run forward is recorded on every step; the next
step uses the previous step's order to issue unit i+1's all-gather while unit i computes,
and in backward unit i-1's while unit i computes. At most two all-gathers are in flight.
A step whose order differs from the recorded one still computes correctly: a unit that
was not prefetched gathers synchronously, and one prefetched in vain is resharded at the
end of forward. The new order is used from the next step on.
"""

from __future__ import annotations

import enum
import zlib
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..observe.events import EventSink, now
from . import collectives as C
from .unit import PendingReduce, ShardedState, Unit

MAX_GATHERS_IN_FLIGHT = 2
MAX_REDUCES_IN_FLIGHT = 2


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class RootContext:
    """State shared by all units under one root module (one per sharded model)."""

    def __init__(self, root: Unit, units: list[Unit]) -> None:
        self.root = root
        self.units = units
        self.state = TrainingState.IDLE
        # Forward order recorded on the previous step (used to prefetch) and this step's.
        self.order: list[Unit] = []
        self.order_now: list[Unit] = []
        self.prefetch_enabled = True
        # All-gathers issued ahead of need (a statistic; tests check prefetching happens).
        self.prefetches = 0
        self.pending: deque[PendingReduce] = deque()
        self._final_queued = False
        self.sinks: list[EventSink] = []
        # Training step that events are labelled with (set by observe.sinks.set_step).
        self.step = 0
        self._index: dict[int, int] = {}

    # --- forward ------------------------------------------------------------------------

    def pre_forward_root(self) -> None:
        if self.state is TrainingState.BACKWARD:
            # A backward that never reached its final callback (e.g. an exception): reset.
            self.finish_backward()
        self.state = TrainingState.FORWARD
        self.order_now = []

    def record(self, unit: Unit) -> None:
        self.order_now.append(unit)

    def prefetch_forward(self, unit: Unit) -> None:
        if not self.prefetch_enabled or not self.order:
            return
        pos = len(self.order_now) - 1
        if pos >= len(self.order) or self.order[pos] is not unit:
            return  # order changed this step: no guessing
        if pos + 1 < len(self.order):
            self._prefetch(self.order[pos + 1])

    def prefetch_backward(self, unit: Unit) -> None:
        if not self.prefetch_enabled or not self.order:
            return
        i = self._index.get(id(unit))
        if i is not None and i > 0:
            self._prefetch(self.order[i - 1])

    def _prefetch(self, unit: Unit) -> None:
        if unit.state is not ShardedState.SHARDED:
            return
        in_flight = sum(1 for u in self.units if u.state is ShardedState.GATHERING)
        if in_flight < MAX_GATHERS_IN_FLIGHT:
            unit.unshard(async_op=True)
            self.prefetches += 1

    def post_forward_root(self) -> None:
        if [id(u) for u in self.order_now] != [id(u) for u in self.order]:
            self.order = list(self.order_now)
            self._index = {id(u): i for i, u in enumerate(self.order)}
        grad = torch.is_grad_enabled()
        for u in self.units:
            # A prefetch nobody used, or (no grad: no backward will come) anything.
            if u.state is ShardedState.GATHERING or (not grad and u.state is not
                                                     ShardedState.SHARDED):
                u.reshard()
        self.state = TrainingState.IDLE

    # --- backward -----------------------------------------------------------------------

    def ensure_backward(self) -> None:
        """First hook of a backward: reset per-backward state, queue the final callback."""
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            for u in self.units:
                u.start_backward()
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def pre_backward(self, unit: Unit) -> None:
        self.ensure_backward()
        if self.sinks:
            unit.t_compute = now()
        unit.wait_unshard()
        self.prefetch_backward(unit)

    def add_pending_reduce(self, pr: PendingReduce) -> None:
        self.pending.append(pr)
        while len(self.pending) > MAX_REDUCES_IN_FLIGHT:
            # Bound memory: each pending reduce holds a unit-sized buffer.
            old = self.pending.popleft()
            old.unit.finish_reduce(old)

    def finish_backward(self) -> None:
        """Root final callback: every gradient reduced, every unit sharded."""
        # Reverse forward order is the order the units' post-backward would have run.
        seen = {id(u) for u in self.order}
        for u in list(reversed(self.order)) + [u for u in self.units if id(u) not in seen]:
            if not u._reduced_this_backward and (
                u.state is not ShardedState.SHARDED or u._grads_ready
            ):
                u.post_backward()
        while self.pending:
            pr = self.pending.popleft()
            pr.unit.finish_reduce(pr)
        for u in self.units:
            u.reshard()
            u.start_backward()
        self._final_queued = False
        self.state = TrainingState.IDLE


# --- hook functions -----------------------------------------------------------------------


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _lazy_init(unit: Unit) -> RootContext:
    """The first unit to run forward is the root: it gathers every unit beneath it."""
    root_mod = unit.module
    units: list[Unit] = []
    for name, m in root_mod.named_modules():
        u = getattr(m, "_sw_unit", None)
        if u is not None:
            if u.ctx is not None:
                raise RuntimeError(
                    f"unit {name!r} already belongs to another root; call fully_shard on the "
                    "blocks first and on the root last, and run forward on the root"
                )
            u.name = name
            units.append(u)
    _check_same_layout(units)
    ctx = RootContext(unit, units)
    ctx.prefetch_enabled = getattr(root_mod, "_sw_prefetch", True)
    # Sinks attached before the first forward (see observe.sinks.attach_sink).
    ctx.sinks = getattr(root_mod, "_sw_sinks", ctx.sinks)
    ctx.step = getattr(root_mod, "_sw_step", 0)
    for u in units:
        u.ctx = ctx
        # One pool for the whole model: only a few unit-sized buffers are alive at once.
        u.pool = unit.pool
    unit.is_root = True
    return ctx


def _check_same_layout(units: list[Unit]) -> None:
    """Every rank must shard the same model the same way, or collectives would mismatch.

    One small all-reduce at the first forward turns a diverging rank (another model, other
    shapes, another wrap policy) into an error on every rank instead of a hang or garbage.
    """
    desc = ";".join(
        f"{u.name}:" + ",".join(f"{tuple(p.orig_shape)}{p.orig_dtype}{p.compute_dtype}"
                                for p in u.params)
        for u in units
    )
    fingerprint = zlib.crc32(desc.encode()) & 0x7FFFFFFF
    if not C.same_on_all(fingerprint, label="layout check"):
        raise RuntimeError(
            f"rank {C.rank()}: ranks disagree on the sharded model ({len(units)} units here, "
            f"layout fingerprint {fingerprint}); every rank must build the same model and call "
            "shard_model/fully_shard with the same arguments"
        )


def forward_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    ctx = unit.ctx if unit.ctx is not None else _lazy_init(unit)
    if ctx.state is TrainingState.BACKWARD:
        # Activation checkpointing re-runs forward inside backward: the unit is needed
        # unsharded, and nothing about the step's order or resharding may change.
        unit.wait_unshard()
        return args, kwargs
    if unit.is_root:
        ctx.pre_forward_root()
    ctx.record(unit)
    if ctx.sinks:
        unit.t_compute = now()
    unit.wait_unshard()
    ctx.prefetch_forward(unit)
    mp = unit.mp
    if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
        dt = mp.param_dtype
        args, kwargs = tree_map(lambda x: x.to(dt) if _is_float_tensor(x) else x, (args, kwargs))
    return args, kwargs


def forward_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    ctx: RootContext = unit.ctx  # type: ignore[assignment]
    if ctx.state is TrainingState.BACKWARD:
        return output  # a recomputation (activation checkpointing): see forward_pre_hook
    if ctx.sinks:
        unit._emit("forward", "", 0, unit.t_compute)
    if unit.reshard_after_forward and not unit.is_root:
        unit.reshard()
    if torch.is_grad_enabled():
        leaves, _ = tree_flatten(output)
        hook = None
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                hook = hook or _make_pre_backward(ctx, unit)  # one closure per call, not per output
                t.register_hook(hook)
    if unit.is_root:
        mp = unit.mp
        if mp is not None and mp.output_dtype is not None:
            dt = mp.output_dtype
            output = tree_map(lambda x: x.to(dt) if _is_float_tensor(x) else x, output)
        ctx.post_forward_root()
    return output


def _make_pre_backward(ctx: RootContext, unit: Unit):
    def hook(grad: torch.Tensor) -> None:
        ctx.pre_backward(unit)

    return hook


def make_post_accumulate_hook(unit: Unit):
    def hook(param: torch.Tensor) -> None:
        if unit.ctx is not None:
            unit.ctx.ensure_backward()
        unit.on_grad_ready()

    return hook
