"""Reusable flat communication buffers.

All-gather outputs and reduce-scatter inputs are unit-sized and short-lived; allocating them
fresh for every unit of every step is pure allocator churn. A pool per (dtype, device) hands
out the smallest free buffer that is large enough (a slice of it) and takes it back when the
collective that used it has completed. At most two all-gathers and two reduce-scatters are in
flight, so the pool never holds more than a few unit-sized buffers.

On CUDA a buffer crosses streams ([Note: streams] in streams.py): the stream that releases it
records an event, and the stream that takes it next waits for that event before using it.
"""

from __future__ import annotations

from typing import Any

import torch


class BufferPool:
    def __init__(self, max_free: int = 4) -> None:
        # Free buffers per (dtype, device); each is a flat tensor.
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # CUDA: id(buffer) -> the event recorded where it was released.
        self._released: dict[int, Any] = {}
        self._max_free = max_free
        # Bytes currently allocated by the pool (free and lent), for memory accounting.
        self.allocated_bytes = 0

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of exactly `numel` elements (a view of a pooled buffer)."""
        free = self._free.setdefault((dtype, torch.device(device)), [])
        best = None
        for i, buf in enumerate(free):
            if buf.numel() >= numel and (best is None or buf.numel() < free[best].numel()):
                best = i
        if best is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.allocated_bytes += buf.numel() * buf.element_size()
        else:
            buf = free.pop(best)
            ev = self._released.pop(id(buf), None)
            if ev is not None:
                torch.cuda.current_stream(buf.device).wait_event(ev)
        return buf[:numel] if buf.numel() != numel else buf

    def release(self, view: torch.Tensor) -> None:
        """Give back a tensor obtained from `get` (its whole underlying buffer)."""
        base = view._base if view._base is not None else view
        free = self._free.setdefault((base.dtype, base.device), [])
        free.append(base)
        if base.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(base.device))
            self._released[id(base)] = ev
        if len(free) > self._max_free:
            free.sort(key=lambda t: t.numel())
            dropped = free.pop(0)
            self._released.pop(id(dropped), None)
            if dropped.is_cuda:
                # Freed here, but other streams may still be reading it: the allocator waits.
                dropped.record_stream(torch.cuda.current_stream(dropped.device))
            self.allocated_bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        self._free.clear()
        self._released.clear()
        self.allocated_bytes = 0
