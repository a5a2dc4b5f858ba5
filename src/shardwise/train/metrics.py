"""What a run measures: memory per rank, bytes communicated, and the metrics.jsonl file."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import IO, Any

import torch

from ..engine.core.events import Event

MB = 2**20
# Bytes per parameter of training state under AdamW in fp32: the parameter, its gradient,
# and the two moment estimates (exp_avg, exp_avg_sq).
STATE_BYTES_PER_PARAM = 4 + 4 + 8


def training_state_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(this rank's, an unsharded replica's) bytes of parameters, plus the gradient and
    AdamW's two moments of each trainable one, all in the parameter's own dtype (torch
    creates them like it). A frozen parameter (LoRA's base weights) has neither, and a bf16
    model's are 2 bytes: a flat STATE_BYTES_PER_PARAM per parameter counted a LoRA run's
    state at ~4x and a bf16 model's at 2x what it holds. A quantized (NF4) weight counts
    the bytes its shard holds, not its dtype's (4 bytes a value for an fp32 QLoRA base,
    8x what it keeps)."""
    from ..engine.core.dtensor import local_of

    local = full = 0
    for p in model.parameters():  # tied parameters once
        shard = local_of(p)
        held = stored_bytes(shard)
        per = held / max(shard.numel(), 1) * (4 if p.requires_grad else 1)
        local += round(shard.numel() * per)
        full += round(p.numel() * per)  # a DTensor's numel is the global one
    return local, full


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes `t` keeps: a tensor subclass's inner tensors (torchao's NF4: 4-bit codes and
    its scalers), a plain tensor's numel x element size."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return t.numel() * t.element_size()
    names, _ = flatten()
    return sum(stored_bytes(getattr(t, n)) for n in names)


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
    through collectives: [Note: communication bytes] in engine/core/events.py."""

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


def reserved_peak_mb(device: torch.device) -> float:
    """The most memory this process held from the system: on a GPU the caching allocator's
    peak reserved pool (torchtitan's memory/max_reserved), on a CPU the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / MB
    return peak_memory_mb(device)


class MetricLog:
    """Rank 0's metric output: metrics.jsonl, and the sinks chosen with --log.to, which get
    each record's scalars under torchtitan's names (observe/metric_sinks.py)."""

    def __init__(self, run_dir: Path, sinks: list[str], name: str, config: dict[str, Any],
                 world: int, resumed_at: int = 0) -> None:
        from ..observe.metric_sinks import open_sinks

        self.file = MetricsFile(run_dir / "metrics.jsonl")
        self.world = world
        self.sinks = open_sinks(sinks, run_dir, name, config, resumed_at)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(record)
        if self.sinks:
            from ..observe.metric_sinks import torchtitan_scalars

            scalars = torchtitan_scalars(record, self.world)
            for sink in self.sinks:
                sink.log(scalars, record["step"])

    def close(self) -> None:
        self.file.close()
        for sink in self.sinks:
            sink.close()


def open_metric_log(cfg: Any, run_dir: Path, world: int, resumed_at: int = 0) -> MetricLog:
    """The MetricLog of a `shardwise train` run (`cfg`: its train.config.Config; resumed_at:
    the step it resumes from, 0 for a fresh run)."""
    import dataclasses

    from ..observe.metric_sinks import parse_sinks

    flat: dict[str, Any] = {}
    for key, value in dataclasses.asdict(cfg).items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return MetricLog(run_dir, parse_sinks(cfg.log.to), cfg.name, flat, world, resumed_at)
