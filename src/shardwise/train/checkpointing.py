"""The trainer's checkpoints: the model and optimizer, plus where training stands (data
position, RNG state, loss scale) in the checkpoint's `extra`."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import torch

import shardwise as sw

from ..engine.comm import collectives as Cm
from . import data as D
from . import rundir

log = logging.getLogger(__name__)


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(s: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))


def save(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         stream: D.BatchStream, scaler: sw.ShardedGradScaler, keep: int, rank: int, *,
         keys: dict[str, str] | None = None, phase: int = 0,
         trainable_only: bool = False, tokens_per_step: int = 0) -> Path:
    """A sharded checkpoint with the data position, RNG state, the run's keys (identity.py)
    and its phase start in `extra`; prune old ones. `trainable_only`: only the parameters
    that train (a LoRA run's adapters; the frozen base is the model.hf folder's).
    `tokens_per_step` is recorded so that a resume at another data-parallel size can say how
    the batch changed.
    """
    path = rundir.checkpoint_path(run_dir, step)
    extra = {"step": step, "data": stream.state_dict(), "rng": _rng_state(),
             "scaler": scaler.state_dict(), "keys": keys or {}, "phase": phase,
             "tokens_per_step": tokens_per_step}
    sw.save_checkpoint(str(path), model, opt, step=step, extra=extra,
                       trainable_only=trainable_only)
    Cm.barrier(label="checkpoint saved")
    if rank == 0:
        pruned = rundir.prune_checkpoints(run_dir, keep)
        log.info("checkpoint %s (pruned %d older)", path, len(pruned))
    return path


def _intact_older(run_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint before `step` whose files all pass their checksums
    (checked by every rank, a share of the files each)."""
    from ..checkpoint.manifest import read_manifest
    from ..checkpoint.reader import verify_files
    from ..checkpoint.sync import agreed

    for s, p in reversed(rundir.checkpoints(run_dir)):
        if s >= step:
            continue
        try:
            with agreed():
                verify_files(str(p), read_manifest(str(p)), Cm.rank(), Cm.world_size())
            return p
        except (sw.CheckpointError, ValueError, OSError):
            continue
    return None


def resume(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
           stream: D.BatchStream, scaler: sw.ShardedGradScaler, *, step: int | None = None,
           reset: bool = False, trainable_only: bool = False,
           keys: dict[str, str] | None = None, name: str = "") -> tuple[int, int]:
    """Load checkpoint `step` (None: the latest); return (the step it was taken after, the
    step its phase started at). With `reset`, only the weights are loaded: the data
    position, optimizer and schedule start afresh at that step ([Note: phases])."""
    found = dict(rundir.checkpoints(run_dir))
    at = step if step is not None else max(found)
    path = found[at]
    try:
        extra = sw.load_checkpoint(str(path), model, None if reset else opt,
                                   trainable_only=trainable_only) or {}
    except sw.CheckpointError as e:
        older = _intact_older(run_dir, at) if step is None else None
        if older is None:
            raise
        raise sw.CheckpointError(
            f"{e}. The older checkpoint {older.name} is intact: resume from it with "
            f"`shardwise train --name {name or run_dir.name} --resume-from {older.name}`"
        ) from None
    if "data" not in extra or "step" not in extra:
        raise RuntimeError(f"checkpoint {str(path)!r} lacks the training position in `extra`")
    if reset:
        return int(extra["step"]), int(extra["step"])
    stream.load_state_dict(extra["data"])
    if "rng" in extra:
        _set_rng_state(extra["rng"])
    if scaler.enabled and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    return int(extra["step"]), int(extra.get("phase", 0))


def saved_tokens_per_step(run_dir: Path) -> int | None:
    """Tokens per step of the run that wrote the latest checkpoint (None: not recorded)."""
    from ..checkpoint.manifest import read_manifest

    found = rundir.checkpoints(run_dir)
    if not found:
        return None
    extra = read_manifest(str(found[-1][1])).extra
    value = extra.get("tokens_per_step") if isinstance(extra, dict) else None
    return int(value) if value else None

