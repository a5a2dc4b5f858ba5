"""The training job's losses over ranks: the counted targets of a step (validation:
eval_metrics.py).

Masked targets (`--model.hf` data: prompt tokens and padding are not counted) make each
micro-batch's own mean a weight-blind average: the loss is the mean over every counted
target of the step, every rank's micro-batches together (docs/training.md).
"""

from __future__ import annotations

import torch

from ..engine.comm import collectives as Cm
from .hf_model import IGNORE


def counted_targets(batches: list[tuple[torch.Tensor, ...]], device: torch.device) -> float:
    """Counted targets of a step's micro-batches, over every rank (TP ranks each count
    their group's)."""
    n = torch.tensor(float(sum(int((b[1] != IGNORE).sum()) for b in batches)),
                     dtype=torch.float64, device=device)
    Cm.all_reduce(n, None, label="counted targets")
    return n.item()


