"""The side streams of one model on a GPU, and how the exposed wait on them is measured.

[Note: streams] On CUDA a unit's collectives run off the compute stream, as in FSDP2:

- the copy of the shards into the all-gather's send buffer runs on `copy_in`, and the
  all-gather itself on `all_gather` (waiting for the copy-in by an event), so a prefetch
  issued while unit i computes does not queue behind unit i's kernels;
- the reduce-scatter runs on `reduce_scatter`, after the compute stream packed the
  gradients (the gradients are freed on the stream that made them);
- the compute stream waits for a gather or a reduction by an event (`wait_event`), never the
  host: no host-device sync that FSDP2 does not make;
- the two all-gather streams wait for the compute stream once per step, at the root's
  forward (or for the event given to `set_post_optim_event`), so that the optimizer's
  updates of the shards are visible to the step's gathers and nothing later is waited for.

Pooled buffers cross streams, so `BufferPool` (buffers.py) records an event on the stream
that releases a buffer and makes the stream that takes it next wait for that event.

On CPU none of this exists (`streams_for` returns None) and collectives run as before.
"""

from __future__ import annotations

from typing import Any

import torch


class Streams:
    """FSDP2's three communication streams on one CUDA device (high priority)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_in: Any = torch.cuda.Stream(device=device, priority=-1)
        self.all_gather: Any = torch.cuda.Stream(device=device, priority=-1)
        self.reduce_scatter: Any = torch.cuda.Stream(device=device, priority=-1)

    def step_starts(self, event: Any = None) -> None:
        """The root's forward: the gathers may read what the compute stream (or the
        optimizer's stream, through `event`) wrote to the shards so far."""
        for s in (self.copy_in, self.all_gather):
            if event is not None:
                s.wait_event(event)
            else:
                s.wait_stream(torch.cuda.current_stream(self.device))


def streams_for(device: torch.device) -> Streams | None:
    return Streams(device) if device.type == "cuda" else None


def record(stream: Any) -> Any:
    """An event marking the work queued on `stream` so far."""
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class ExposedWait:
    """How long the compute stream stood still waiting for `event` (CUDA, traced runs only).

    Host time around a `wait_event` reads about 0: the host does not wait. Two timing events
    on the compute stream around the wait measure the stall on the device itself; reading
    them is a host sync, paid only when a trace or the explorer asked for events.
    """

    def __init__(self, event: Any, timed: bool) -> None:
        stream = torch.cuda.current_stream()
        self.start = self.end = None
        if timed:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(stream)
        stream.wait_event(event)
        if timed:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(stream)

    @property
    def seconds(self) -> float:
        if self.start is None or self.end is None:
            return 0.0
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0
