"""The training job's losses over ranks: validation, and the counted targets of a step.

Masked targets (`--model.hf` data: prompt tokens and padding are not counted) make each
micro-batch's own mean a weight-blind average: the loss is the mean over every counted
target of the step, every rank's micro-batches together (docs/training.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.comm import collectives as Cm
from . import data as D
from .build import Built
from .config import Config
from .hf_model import IGNORE


@torch.no_grad()
def evaluate(built: Built, val: Any, cfg: Config, rank: int, world: int,
             device: torch.device) -> float:
    """Mean loss over the fixed validation batches of every rank."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    seq = cfg.model.seq_len()
    tp = cfg.parallel.tp  # a TP group shares its batches; the sum counts each tp times
    if cfg.model.hf:
        from .token_cache import val_batches
    else:
        val_batches = D.val_batches
    batches = val_batches(val, seq, cfg.train.batch_size, rank // tp, world // tp,
                          cfg.train.eval_batches, device)
    if built.loss_sum is not None:  # masked targets: the mean over every counted one
        both = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in batches:
            s, n = built.loss_sum(x, y)
            both += torch.stack([s.double(), n.double()])
        Cm.all_reduce(both, None, label="validation loss")
        return both[0].item() / max(both[1].item(), 1.0)
    for x, y in batches:
        total += built.loss(x, y).double()
    Cm.all_reduce(total, None, label="validation loss")
    return total.item() / (world * cfg.train.eval_batches)


def counted_targets(batches: list[tuple[torch.Tensor, torch.Tensor]],
                    device: torch.device) -> float:
    """Counted targets of a step's micro-batches, over every rank (TP ranks each count
    their group's)."""
    n = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in batches)),
                     dtype=torch.float64, device=device)
    Cm.all_reduce(n, None, label="counted targets")
    return n.item()


