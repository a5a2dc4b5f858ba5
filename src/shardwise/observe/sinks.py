"""Attaching event sinks to a sharded model, and ready-made sinks."""

from __future__ import annotations

import json
from typing import IO

from torch import nn

from ..engine.core.context import ModelContext, context_of
from ..engine.core.events import Event, EventSink


def _context(model: nn.Module) -> ModelContext:
    ctx = context_of(model)
    if ctx is None:
        raise ValueError(f"{type(model).__name__} is not sharded: nothing emits events")
    return ctx


def attach_sink(model: nn.Module, sink: EventSink) -> None:
    """Receive every engine `Event` of `model` (call after sharding; works before forward).

    Collective events arrive with `group` set (see [Note: communication bytes]).
    """
    _context(model).sinks.append(sink)


def detach_sink(model: nn.Module, sink: EventSink) -> None:
    sinks = _context(model).sinks
    if sink in sinks:
        sinks.remove(sink)


def set_step(model: nn.Module, step: int) -> None:
    """Label the following events with training step `step`."""
    _context(model).step = step


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
