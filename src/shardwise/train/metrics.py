"""What a run measures: memory per rank, bytes communicated, and the metrics.jsonl file."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import IO, Any

import torch

from ..engine.events import Event

MB = 2**20
# Bytes per parameter of training state under AdamW in fp32: the parameter, its gradient,
# and the two moment estimates (exp_avg, exp_avg_sq).
STATE_BYTES_PER_PARAM = 4 + 4 + 8


def training_state_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(this rank's, an unsharded replica's) bytes of parameters, plus the gradient and
    AdamW's two moments of each trainable one, all in the parameter's own dtype (torch
    creates them like it). A frozen parameter (LoRA's base weights) has neither, and a bf16
    model's are 2 bytes: a flat STATE_BYTES_PER_PARAM per parameter counted a LoRA run's
    state at ~4x and a bf16 model's at 2x what it holds."""
    from ..engine.dtensor import local_of

    local = full = 0
    for p in model.parameters():  # tied parameters once
        per = p.element_size() * (4 if p.requires_grad else 1)
        local += local_of(p).numel() * per
        full += p.numel() * per  # a DTensor's numel is the global one
    return local, full


def memory_mb(device: torch.device) -> float:
    """This process's memory now: CUDA allocated on a GPU, resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MB
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except (OSError, ValueError, IndexError):  # not Linux: fall back to the peak
        return peak_memory_mb(device)


def peak_memory_mb(device: torch.device) -> float:
    """The high-water mark: CUDA max allocated, or the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return peak / (MB if os.uname().sysname == "Darwin" else 1024)


class ByteCounter:
    """An event sink summing, per step, the bytes this rank sent (and received alike)
    through collectives: [Note: communication bytes] in engine/events.py."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, int]] = {}
        # Set around validation and sampling: their gathers are not a training step's.
        self.paused = False

    def __call__(self, ev: Event) -> None:
        if ev.collective and not self.paused:
            step = self.by_step.setdefault(ev.step, {})
            step[ev.collective] = step.get(ev.collective, 0) + ev.wire_bytes

    def last_step(self) -> dict[str, int]:
        """Bytes by collective in the last step seen (later steps repeat it exactly)."""
        return dict(self.by_step[max(self.by_step)]) if self.by_step else {}


class MetricsFile:
    """metrics.jsonl: one JSON object per line, flushed per line so a crash loses nothing."""

    REQUIRED = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_mb")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in self.REQUIRED if k not in record]
        assert not missing, f"metrics record lacks {missing}"
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
