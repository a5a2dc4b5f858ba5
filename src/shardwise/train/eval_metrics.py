"""Validation: the loss, perplexity and token accuracy over the fixed validation batches of
every rank, and what they add to a metrics record.

All three are means over every counted target of the pass (every rank's batches together):
the loss is the summed cross-entropy over the number of counted targets, the perplexity its
exponential, and the accuracy the share of counted targets whose most likely token (argmax
of the logits) is the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..engine.comm import collectives as Cm
from . import data as D
from .build import Built
from .config import Config
from .hf_model import IGNORE


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    accuracy: float  # a fraction, 0..1
    tokens: int  # counted targets, all ranks

    def record(self) -> dict[str, float]:
        """The keys metrics.jsonl carries on an evaluation step."""
        return {"val_loss": self.loss, "val_perplexity": self.perplexity,
                "val_accuracy": self.accuracy}


def sums(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(summed cross-entropy, counted targets, correct predictions) of (B, T, V) logits and
    (B, T) targets (-100: does not count), as float64."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    t = y.reshape(-1)
    loss = F.cross_entropy(flat, t, ignore_index=IGNORE, reduction="sum")
    counted = t != IGNORE
    correct = (flat.argmax(dim=-1) == t) & counted
    return torch.stack([loss.double(), counted.sum().double(), correct.sum().double()])


def result(totals: torch.Tensor) -> EvalResult:
    loss_sum, n, correct = (float(v) for v in totals.tolist())
    loss = loss_sum / max(n, 1.0)
    return EvalResult(loss, math.exp(loss) if loss < 700 else math.inf, correct / max(n, 1.0),
                      int(n))


@torch.no_grad()
def evaluate(built: Built, val: Any, cfg: Config, rank: int, world: int,
             device: torch.device) -> EvalResult:
    """Loss, perplexity and token accuracy over the fixed validation batches of every rank
    (a collective: one all-reduce of three numbers)."""
    seq, tp = cfg.model.seq_len(), cfg.parallel.tp
    # A TP group shares its batches: only its first rank counts them.
    counts = rank % tp == 0
    if cfg.model.hf:
        from .token_parts import val_batches

        batches: Any = val_batches(val, seq, cfg.train.batch_size, rank // tp, world // tp,
                                   cfg.train.eval_batches, device, seed=cfg.data.seed)
    else:
        batches = D.val_batches(val, seq, cfg.train.batch_size, rank // tp, world // tp,
                                cfg.train.eval_batches, device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y, *pos in batches:
        logits = built.logits(x, *pos)
        if counts:
            totals += sums(logits, y)
    Cm.all_reduce(totals, None, label="validation loss")
    return result(totals)
