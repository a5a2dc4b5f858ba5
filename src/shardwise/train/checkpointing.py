"""The trainer's checkpoints: the model and optimizer, plus where training stands (data
position, RNG state, loss scale) in the checkpoint's `extra`."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import torch

import shardwise as sw

from ..engine import collectives as Cm
from . import data as D
from . import rundir

log = logging.getLogger(__name__)


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(s: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))


def save(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         stream: D.BatchStream, scaler: sw.ShardedGradScaler, keep: int, rank: int,
         tokens_per_step: int = 0) -> Path:
    """A sharded checkpoint with the data position and RNG state in `extra`; prune old ones.

    `tokens_per_step` is recorded so that a resume at another data-parallel size can say how
    the batch changed.
    """
    path = rundir.checkpoint_path(run_dir, step)
    extra = {"step": step, "data": stream.state_dict(), "rng": _rng_state(),
             "scaler": scaler.state_dict(), "tokens_per_step": tokens_per_step}
    sw.save_checkpoint(str(path), model, opt, step=step, extra=extra)
    Cm.barrier(label="checkpoint saved")
    if rank == 0:
        pruned = rundir.prune_checkpoints(run_dir, keep)
        log.info("checkpoint %s (pruned %d older)", path, len(pruned))
    return path


def resume(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
           stream: D.BatchStream, scaler: sw.ShardedGradScaler) -> int:
    """Load the latest checkpoint; return the step it was taken after."""
    step, path = rundir.checkpoints(run_dir)[-1]
    extra = sw.load_checkpoint(str(path), model, opt) or {}
    if "data" not in extra or "step" not in extra:
        raise RuntimeError(f"checkpoint {str(path)!r} lacks the training position in `extra`")
    stream.load_state_dict(extra["data"])
    if "rng" in extra:
        _set_rng_state(extra["rng"])
    if scaler.enabled and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    return int(extra["step"])


def saved_tokens_per_step(run_dir: Path) -> int | None:
    """Tokens per step of the run that wrote the latest checkpoint (None: not recorded)."""
    from ..checkpoint.manifest import read_manifest

    found = rundir.checkpoints(run_dir)
    if not found:
        return None
    extra = read_manifest(str(found[-1][1])).extra
    value = extra.get("tokens_per_step") if isinstance(extra, dict) else None
    return int(value) if value else None

