"""Attaching event sinks to a sharded model, and ready-made sinks."""

from __future__ import annotations

import json
from typing import IO

from torch import nn

from .events import Event, EventSink


def _units(model: nn.Module) -> list:
    units = [m._sw_unit for m in model.modules() if getattr(m, "_sw_unit", None) is not None]
    if not units:
        raise ValueError(f"{type(model).__name__} is not sharded: nothing emits events")
    return units


def attach_sink(model: nn.Module, sink: EventSink) -> None:
    """Receive every engine `Event` of `model` (call after sharding; works before forward).

    Collective events arrive with `group` set (see [Note: communication bytes]).
    """
    sinks = getattr(model, "_sw_sinks", None)
    if sinks is None:
        sinks = []
        model._sw_sinks = sinks  # type: ignore[attr-defined]
    sinks.append(sink)
    for u in _units(model):
        if u.ctx is not None:
            u.ctx.sinks = sinks


def detach_sink(model: nn.Module, sink: EventSink) -> None:
    sinks = getattr(model, "_sw_sinks", [])
    if sink in sinks:
        sinks.remove(sink)


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
