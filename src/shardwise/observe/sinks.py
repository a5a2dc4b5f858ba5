"""Attaching event sinks to a sharded model, and ready-made sinks."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import IO

from torch import nn

from .events import Event, EventSink


def _units(model: nn.Module) -> list:
    units = [m._sw_unit for m in model.modules() if getattr(m, "_sw_unit", None) is not None]
    if not units:
        raise ValueError(f"{type(model).__name__} is not sharded: nothing emits events")
    return units


class _WithGroup:
    """Hands `sink` each event with its `group` filled in from the emitting unit's mesh.

    The engine's events carry the buffer size but not the group it was split over; the
    group sizes are fixed once a model is sharded, so they are read here, once.
    """

    def __init__(self, model: nn.Module, sink: EventSink) -> None:
        self.model = model
        self.sink = sink
        # unit name -> (shard group size, replicate group size); read when first needed:
        # units take their final names at the root's lazy init (the first forward).
        self.sizes: dict[str, tuple[int, int]] = {}

    def __call__(self, ev: Event) -> None:
        if ev.collective and not ev.group:
            if ev.unit not in self.sizes:
                self.sizes = {u.name: (u.mesh.shard_size, u.mesh.replicate_size)
                              for u in _units(self.model)}
            shard, replicate = self.sizes.get(ev.unit, (1, 1))
            ev = replace(ev, group=replicate if ev.collective == "all_reduce" else shard)
        self.sink(ev)


def attach_sink(model: nn.Module, sink: EventSink) -> None:
    """Receive every engine `Event` of `model` (call after sharding; works before forward).

    Collective events arrive with `group` set (see [Note: communication bytes]).
    """
    sinks = getattr(model, "_sw_sinks", None)
    if sinks is None:
        sinks = []
        model._sw_sinks = sinks  # type: ignore[attr-defined]
    sinks.append(_WithGroup(model, sink))
    for u in _units(model):
        if u.ctx is not None:
            u.ctx.sinks = sinks


def detach_sink(model: nn.Module, sink: EventSink) -> None:
    sinks = getattr(model, "_sw_sinks", [])
    for wrapped in [s for s in sinks if s is sink or getattr(s, "sink", None) is sink]:
        sinks.remove(wrapped)


def set_step(model: nn.Module, step: int) -> None:
    """Label the following events with training step `step`."""
    for u in _units(model):
        if u.ctx is not None:
            u.ctx.step = step
    model._sw_step = step  # type: ignore[attr-defined]


class ListSink:
    """Collects events in memory (tests, the explorer)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)

    def drain(self) -> list[Event]:
        out, self.events = self.events, []
        return out


class JsonlSink:
    """Appends one JSON object per event to a file (per-rank engine logs)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, ev: Event) -> None:
        self.stream.write(json.dumps(ev.to_dict()) + "\n")
