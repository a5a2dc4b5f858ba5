"""The per-model context: one per sharded root, made when the root is sharded.

It owns what the units under one root share: the step `Schedule` (prefetch order, pending
reductions, the in-flight limits), the event sinks and the step number events are labelled
with, and the buffer pool. `fully_shard(module)` makes a context for `module`'s unit and
takes in the contexts of the units already sharded below it, so the settings a user makes
before the first forward (sinks, prefetch, limits) live here from the start.

What needs every rank (the layout check) or a finished model (no meta parameters) waits for
the first forward (`ensure_ready`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.debug import debug_enabled
from .containers import ContainerCheck, find_holders
from .events import EventSink
from .freeze_check import check_same_trainable
from .inspect import unit_of
from .mesh import agreement_groups
from .schedule import Limits, Schedule, ShardedState, TrainingState
from .streams import Streams, streams_for
from .tp import check_params_in_place
from .unit import Unit


class ModelContext:
    def __init__(self, top: Unit) -> None:
        self.top = top
        self.units: list[Unit] = [top]
        self.schedule: Schedule[Unit] = Schedule(self.units)
        self.sinks: list[EventSink] = []
        # Training step that events are labelled with (observe.sinks.set_step).
        self.step = 0
        self.ready = False
        self._final_queued = False
        # set_post_optim_event: waited for at the start of the next root forward.
        self.post_optim_event: object | None = None
        # CUDA: the side streams of [Note: streams] (None on CPU); made at the first forward.
        self.streams: Streams | None = None
        # Holders of containers of units ([Note: data-dependent units] in containers.py).
        self.containers: ContainerCheck | None = None
        # Under SHARDWISE_DEBUG: the freeze check is due at this backward's first hook.
        self._check_trainable = False
        # The groups the checks above agree over: the model's ranks ([Note: model group]
        # in mesh.py), set at the first forward.
        self.groups: list[Any] = [None]

    @classmethod
    def create(cls, top: Unit) -> ModelContext:
        """A context for `top`, taking in every unit already sharded beneath its module."""
        ctx = cls(top)
        units: list[Unit] = []
        seen: set[int] = set()
        for name, m in _named_modules(top.modules):
            u = unit_of(m)
            if u is None or id(u) in seen:
                continue  # a list-form unit is reached through each of its modules
            seen.add(id(u))
            old = u.ctx
            if old is not None and old is not ctx:
                if old.ready:
                    raise RuntimeError(
                        f"unit {name!r} already ran forward as its own root; call "
                        "fully_shard on the blocks first and on the root last, then run "
                        "forward on the root")
                ctx.sinks.extend(s for s in old.sinks if s not in ctx.sinks)
                ctx.schedule.prefetch = ctx.schedule.prefetch and old.schedule.prefetch
                ctx.schedule.limits = old.schedule.limits
                ctx.step = max(ctx.step, old.step)
            ctx._adopt(u, name)
            units.append(u)
        ctx.units[:] = units
        return ctx

    def _adopt(self, u: Unit, name: str) -> None:
        u.ctx = self
        u.name = name
        u.is_root = u is self.top
        # One pool for the whole model: only a few unit-sized buffers are alive at once.
        u.pool = self.top.pool

    @property
    def limits(self) -> Limits:
        return self.schedule.limits

    @property
    def in_backward(self) -> bool:
        return self.schedule.state is TrainingState.PRE_BACKWARD

    # --- first forward ------------------------------------------------------------------

    def ensure_ready(self, unit: Unit) -> ModelContext:
        """At the first forward through `unit`; returns the context that runs it."""
        if self.ready:
            return self
        if unit is not self.top:
            # Forward started below the sharded root: that unit's subtree runs on its own
            # (the root's own first forward then reports the conflict).
            return ModelContext.create(unit).ensure_ready(unit)
        taken = [u.label for u in self.units if u.ctx is not self]
        if taken:
            raise RuntimeError(
                f"units {taken[:5]} already belong to another root (they ran forward as their "
                "own root first); call fully_shard on the blocks first and on the root last, "
                "and run forward on the root")
        meta = [p.fqn for u in self.units for p in u.params if p.is_meta]
        if meta:
            raise RuntimeError(
                f"parameters {meta[:5]}{' ...' if len(meta) > 5 else ''} are still on the "
                "meta device: call sw.materialize(model) or sw.load_full_state_dict(model, "
                "sd) before the first forward")
        for u in self.units:
            # FSDP2's monkey-patch recipe: hooks patched onto the shards after sharding
            # gather through them from the first forward on ([Note: all-gather extensions]).
            if any([p.refresh_extension() for p in u.params]):
                u.set_params(u.params)
        check_params_in_place(self.units)
        self.groups = agreement_groups(self.units)
        _check_same_layout(self.units, self.groups)
        self.streams = streams_for(self.top.mesh.device)
        # A module's own attribute: a CheckpointWrapper forwards lookups to the unit inside.
        holders = find_holders(_named_modules(self.top.modules),
                               lambda m: vars(m).get("_sw_unit") is not None)
        if holders:
            self.containers = ContainerCheck(holders, lambda: self.in_backward)
        self.ready = True
        return self

    # --- step boundaries ----------------------------------------------------------------

    def begin_forward(self) -> None:
        event, self.post_optim_event = self.post_optim_event, None
        if self.streams is not None:
            self.streams.step_starts(event)  # [Note: streams]
        elif event is not None:
            event.wait()  # type: ignore[attr-defined]  # the current stream waits for it
        if self.schedule.state is TrainingState.PRE_BACKWARD:
            # A backward that never reached its final callback (e.g. an exception): reset.
            self.finish_backward()
        # The user may have frozen or unfrozen parameters since the last step.
        for u in self.units:
            u.follow_requires_grad()
        # Still gathered from a forward that no backward followed (grad enabled, the root
        # and reshard_after_forward=False units keep their parameters), or kept by
        # reshard_after_backward=False, and the shards changed since (an optimizer step, a
        # write through `.data`): the full parameters are stale. Decided alike on every
        # rank: a rank whose shard is empty sees no change where the others do, and a
        # reshard on some ranks only would gather on those alone.
        kept = [u for u in self.units if u.state is ShardedState.UNSHARDED]
        if kept:
            stale = C.max_over([int(u.shards_changed_since_gather()) for u in kept],
                               self.groups, label="stale gathered parameters")
            for u, s in zip(kept, stale):
                if s:
                    u.reshard()
        self._check_trainable = torch.is_grad_enabled() and debug_enabled()
        self.schedule.begin_forward()

    def ensure_backward(self) -> None:
        """Every backward hook calls this: the first one queues the final callback (and,
        under SHARDWISE_DEBUG, checks that every rank trains the same parameters before
        any reduction, [Note: freeze check])."""
        if self._check_trainable:
            self._check_trainable = False
            try:
                check_same_trainable(self.units, self.groups)
            except RuntimeError:
                self.reset_iter_state()
                raise
        self.schedule.state = TrainingState.PRE_BACKWARD
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """Root final callback: every gradient reduced, every unit sharded."""
        self.schedule.end_backward()
        for u in self.units:
            if u.offload_events:
                u.settle_offload()
        self._final_queued = False

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for the collectives in flight (every
        rank issued them), drop their results and every unreduced gradient, reshard."""
        sched = self.schedule
        self._check_trainable = False
        while sched.pending:
            pr: Any = sched.pending.popleft()
            pr.work.wait()
            if pr.done is not None:  # [Note: streams]: before its buffers are reused
                torch.cuda.current_stream().wait_event(pr.done)
            if pr.send is not None:
                pr.unit.pool.release(pr.send)
        for u in self.units:
            u.reshard()
            u.post_forward = None
            u.partial_reduce.clear()  # deferred reductions of the failed step (FSDP2 too)
            for p in u.params:
                if not p.direct:
                    p.unsharded.grad = None
                    p.acc_grad = None
            u.training_state = TrainingState.IDLE
        sched.state = TrainingState.IDLE
        sched.order_now = []
        sched.reduced = set()
        self._final_queued = False


def _named_modules(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    if len(modules) == 1:
        return list(modules[0].named_modules())
    # The list form: names are relative to each module, prefixed by its position.
    return [(f"{i}.{n}" if n else str(i), m) for i, top in enumerate(modules)
            for n, m in top.named_modules()]


def _check_same_layout(units: list[Unit], groups: list[Any]) -> None:
    """Every rank must shard the same model the same way, or collectives would mismatch.

    One small all-reduce at the first forward turns a diverging rank (another model, other
    shapes, another wrap policy, an all-gather extension subclass on one rank only, which
    gathers other bytes) into an error on every rank instead of a hang or garbage.
    """
    desc = ";".join(
        f"{u.name}:" + ",".join(f"{p.global_shape}{p.orig_dtype}{p.compute_dtype}{p.subclass}"
                                f"d{p.shard_dim}"
                                for p in u.params)
        for u in units
    )
    fingerprint = zlib.crc32(desc.encode()) & 0x7FFFFFFF
    hi, neg_lo = C.max_over([fingerprint, -fingerprint], groups, label="layout check")
    if (hi, -neg_lo) != (fingerprint, fingerprint):
        raise RuntimeError(
            f"rank {C.rank()}: ranks disagree on the sharded model ({len(units)} units here, "
            f"layout fingerprint {fingerprint}); every rank must build the same model and call "
            "shard_model/fully_shard with the same arguments"
        )
