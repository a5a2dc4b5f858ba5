"""What the trainer records for a bounded number of steps: engine events and the --trace window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..observe.sinks import JsonlSink, attach_sink, detach_sink
from ..observe.trace import Trace
from .config import Config
from .metrics import ByteCounter


class EventLog:
    """The engine's events for a bounded number of steps: counted, and written per rank."""

    def __init__(self, model: nn.Module, path: Path, write: bool) -> None:
        self.model = model
        self.counter = ByteCounter()
        self.file = path.open("a") if write else None
        self.sinks: list[Any] = [self.counter]
        if self.file is not None:
            self._jsonl = JsonlSink(self.file)
            self.sinks.append(self._write)
        for sink in self.sinks:
            attach_sink(model, sink)

    def _write(self, ev: Any) -> None:
        # Paused with the counter (validation, sampling): their gathers are not the step's,
        # and the replay summed them into it (1.71x the step's bytes on an evaluation step).
        if not self.counter.paused:
            self._jsonl(ev)

    def stop(self) -> None:
        """Detach (the engine pays nothing from here on) and close; idempotent."""
        for sink in self.sinks:
            detach_sink(self.model, sink)
        self.sinks = []
        if self.file is not None:
            self.file.close()
            self.file = None


class TraceWindow:
    """`--trace`: a `Trace` over log.trace_steps steps after log.trace_after warm-up steps."""

    def __init__(self, cfg: Config, run_dir: Path, model: nn.Module, start: int) -> None:
        self.first = self.last = -1  # no step matches: nothing is traced
        if cfg.trace:
            self.first = min(start + 1 + cfg.log.trace_after, cfg.train.steps)
            self.last = min(self.first + cfg.log.trace_steps - 1, cfg.train.steps)
        # A resumed run keeps its earlier trace: the new one goes beside it.
        d = run_dir / "trace"
        if d.exists() and any(d.iterdir()):
            d = run_dir / f"trace-step{self.first}"
        self.trace = Trace(d, model)
        self.summary: dict[str, Any] = {}

    @property
    def paused(self) -> bool:
        return self.trace.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.trace.paused = value  # evaluation's forwards are not training steps

    def before(self, step: int) -> None:
        if step == self.first:
            self.trace.start()
        if self.first <= step <= self.last:
            self.trace.step(step)

    def after(self, step: int) -> None:
        if step == self.last:
            report = self.trace.stop()
            self.summary = {"dir": str(self.trace.dir), "merged": str(self.trace.merged_path),
                            "report": report.to_dict()}
