"""Module and autograd hooks that drive the units through a step.

Per unit: forward pre-hook (unshard, prefetch the next unit), forward post-hook (reshard
under FULL_SHARD, hook the outputs for backward), pre-backward (a gradient hook on the
outputs: unshard again, prefetch the previous unit), post-backward (an identity autograd
Function on the unit's forward inputs: its backward runs once the gradients for those inputs
exist, which is when the unit's backward is over; then reduce and reshard), and a final
callback queued on the autograd engine by the root (post-backward for units whose inputs
needed no gradient, wait for every pending reduction, reshard everything).

[Note: post-backward] A unit may reshard only when autograd no longer needs its unsharded
parameters. Counting the gradients of its trainable parameters is not enough: a frozen
weight (LoRA's base weight, a frozen attention) is still needed to compute the gradient of
the unit's input after the last trainable gradient has arrived. The gradient of the inputs
is the last thing the unit's backward computes. The autograd engine runs a ready
AccumulateGrad before any other ready node, and the Function's node was created before every
op of the unit's forward, so it runs after them. A unit whose inputs need no gradient (the
first unit, or any unit behind frozen ones) is finished by the root's final callback.

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

from ..observe.events import EventSink, now
from . import collectives as C
from .tp import check_params_in_place
from .traverse import map_tensors, tensors_in
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
        # The user may have frozen or unfrozen parameters since the last step.
        for u in self.units:
            u.follow_requires_grad()
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
        """First hook of a backward: queue the final callback."""
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def pre_backward(self, unit: Unit) -> None:
        self.ensure_backward()
        if self.sinks:
            unit.t_compute = now()
        unit.wait_unshard()
        self.prefetch_backward(unit)

    def post_backward(self, unit: Unit) -> None:
        """The unit's backward is over ([Note: post-backward]): reduce, then reshard."""
        self.ensure_backward()
        for pr in unit.post_backward():
            self.add_pending_reduce(pr)

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
            if u.state is not ShardedState.SHARDED or u.has_unreduced_grads():
                for pr in u.post_backward():
                    self.add_pending_reduce(pr)
        while self.pending:
            pr = self.pending.popleft()
            pr.unit.finish_reduce(pr)
        for u in self.units:
            if u.reshard_after_backward:
                u.reshard()
        self._final_queued = False
        self.state = TrainingState.IDLE


# --- hook functions -----------------------------------------------------------------------


def _cast(obj: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return obj
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, obj)


def _not_traced(fn: Any) -> Any:
    """Run `fn` eagerly even inside torch.compile.

    [Note: compile] The hooks drive collectives, Python state machines and the buffer pool:
    Dynamo tracing them specialized graphs on engine state (recompiling as it changed) and
    replayed stale buffer-pool decisions at step 2. Excluded from tracing, they run between
    the compiled pieces of a module, exactly as in eager mode.
    """
    return torch._dynamo.disable(fn)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, *tensors: torch.Tensor) -> Any:
        ctx.unit = unit
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        unit: Unit = ctx.unit
        if unit.ctx is not None:
            unit.ctx.post_backward(unit)
        return (None, *grads)


def _mark_inputs(unit: Unit, args: Any) -> Any:
    """Route the inputs that need a gradient through _PostBackward ([Note: post-backward])."""
    needs = [t for t in tensors_in(args) if t.requires_grad]
    if not needs:
        return args
    outs = iter(_PostBackward.apply(unit, *needs))
    ids = {id(t) for t in needs}
    return map_tensors(lambda t: next(outs) if id(t) in ids else t, args)


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
    meta = [p.fqn for u in units for p in u.params if p.is_meta]
    if meta:
        raise RuntimeError(
            f"parameters {meta[:5]}{' ...' if len(meta) > 5 else ''} are still on the meta "
            "device: call sw.materialize(model) or sw.load_full_state_dict(model, sd) before "
            "the first forward")
    check_params_in_place(units)
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
        f"{u.name}:" + ",".join(f"{p.global_shape}{p.orig_dtype}{p.compute_dtype}"
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


@_not_traced
def forward_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    ctx = unit.ctx if unit.ctx is not None else _lazy_init(unit)
    mp = unit.mp
    cast_to = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
    if ctx.state is TrainingState.BACKWARD:
        # Activation checkpointing re-runs forward inside backward: the unit is needed
        # unsharded (with the same input casts as the first time), and nothing about the
        # step's order or resharding may change.
        unit.wait_unshard()
        return _cast((args, kwargs), cast_to)
    if unit.is_root:
        ctx.pre_forward_root()
    ctx.record(unit)
    if ctx.sinks:
        unit.t_compute = now()
    unit.wait_unshard()
    ctx.prefetch_forward(unit)
    args, kwargs = _cast((args, kwargs), cast_to)
    if torch.is_grad_enabled():
        args, kwargs = _mark_inputs(unit, (args, kwargs))
    return args, kwargs


@_not_traced
def forward_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    ctx: RootContext = unit.ctx  # type: ignore[assignment]
    out_dtype = unit.mp.output_dtype if unit.mp is not None else None
    if ctx.state is TrainingState.BACKWARD:
        # A recomputation (activation checkpointing): see forward_pre_hook.
        return _cast(output, out_dtype)
    if ctx.sinks:
        unit._emit("forward", "", 0, unit.t_compute)
    if unit.reshard_after_forward and not unit.is_root:
        unit.reshard()
    if torch.is_grad_enabled():
        hook = None
        for t in tensors_in(output):
            if t.requires_grad:
                hook = hook or _make_pre_backward(ctx, unit)  # one closure per call, not per output
                t.register_hook(hook)
    # Each unit's own policy: a block may hand fp32 to the next one while computing in bf16.
    output = _cast(output, out_dtype)
    if unit.is_root:
        ctx.post_forward_root()
    return output


def _make_pre_backward(ctx: RootContext, unit: Unit):
    def hook(grad: torch.Tensor) -> None:
        ctx.pre_backward(unit)

    return hook

