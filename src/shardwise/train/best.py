"""`checkpoints/best`: the weights with the lowest validation loss a run has reached.

After each evaluation whose loss is below the best so far, every rank saves the model (its
weights only: what export and generate need, half the bytes of a checkpoint with AdamW's
state) with `sw.save_checkpoint`, which replaces the previous best only once the new one is
complete ([Note: atomic publish]). The step and loss are in the checkpoint's `extra`, so a
resumed run compares against the best of its earlier invocations. The folder does not match
`step-N`: rotation (checkpoint.keep) never prunes it and a resume never loads it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import shardwise as sw

from ..engine.comm import collectives as Cm
from . import rundir

NAME = "best"


def best_path(run_dir: Path) -> Path:
    return run_dir / rundir.CKPT_DIR / NAME


def saved_loss(run_dir: Path) -> float:
    """The validation loss of the run's best checkpoint (inf: none yet). Raises ValueError
    for a `best` folder that shardwise did not write, which it will not replace."""
    from ..checkpoint.atomic import is_complete
    from ..checkpoint.manifest import read_manifest

    path = best_path(run_dir)
    if not path.exists():
        return math.inf
    extra = read_manifest(str(path)).extra if is_complete(str(path)) else None
    if not (isinstance(extra, dict) and isinstance(extra.get("val_loss"), (int, float))):
        raise ValueError(f"{str(path)!r} is not a best checkpoint written by shardwise train "
                         "(no val_loss in its manifest): move it elsewhere, or set "
                         "checkpoint.best=false")
    return float(extra["val_loss"])


class BestKeeper:
    """Offers each validation loss; saves the weights when it is the lowest so far."""

    def __init__(self, run_dir: Path, enabled: bool, trainable_only: bool) -> None:
        self.run_dir, self.enabled, self.trainable_only = run_dir, enabled, trainable_only
        # Read by rank 0 and broadcast: every rank must decide alike whether to save.
        found: dict[str, object] = {}
        if enabled and Cm.rank() == 0:
            try:
                found = {"loss": saved_loss(run_dir)}
            except (ValueError, sw.CheckpointError) as e:
                found = {"error": str(e)}
        found = Cm.broadcast_json(found, src=0) if enabled else {}
        if "error" in found:
            raise ValueError(str(found["error"]))
        self.loss = float(found.get("loss", math.inf))  # type: ignore[arg-type]
        self.step = 0

    def offer(self, model: torch.nn.Module, step: int, val_loss: float) -> bool:
        """Save `model` as the best when `val_loss` beats it (every rank: a collective)."""
        if not self.enabled or not val_loss < self.loss:  # NaN never wins
            return False
        sw.save_checkpoint(str(best_path(self.run_dir)), model, None, step=step,
                           extra={"step": step, "val_loss": val_loss, "best": True},
                           trainable_only=self.trainable_only)
        self.loss, self.step = val_loss, step
        return True
