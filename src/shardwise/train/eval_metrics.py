"""Validation: the loss, perplexity and token accuracy over the evaluation set, and what they
add to a metrics record.

All three are means over every counted target of the pass (every rank's batches together):
the loss is the summed cross-entropy over the number of counted targets, the perplexity its
exponential, and the accuracy the share of counted targets whose most likely token (argmax
of the logits) is the target.

[Note: evaluation set] The evaluation set's samples (the byte split's windows and its tail;
a Hugging Face run's validation samples in a fixed seeded order, packed tail included) are
dealt to the data-parallel ranks in global batches of batch_size x ranks: batch b gives rank
r the samples (b * ranks + r) * batch_size onwards. train.eval_batches = 0 (model.hf's default)
takes every sample once: the last batch is filled with copies of sample 0 whose targets do
not count, so every rank runs the same forwards (each is a collective) and every counted
token of the set is counted exactly once, at any world size. eval_batches = N > 0 takes the
first N global batches of that order only (a sample of the set, never cycled).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
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


def _rows(val: Any, cfg: Config) -> tuple[int, Callable[[np.ndarray], tuple[Any, ...]]]:
    """(samples, rows of sample ids) of the evaluation set ([Note: evaluation set])."""
    seq = cfg.model.seq_len()
    if cfg.model.hf:
        from .token_parts import eval_rows

        return eval_rows(val, cfg.data.seed)
    return D.eval_rows(val, seq)


def n_batches(n: int, batch_size: int, world: int, max_batches: int) -> int:
    """Global batches of an evaluation pass over n samples (max_batches 0: all of them)."""
    whole = -(-n // (batch_size * world))
    return min(whole, max_batches) if max_batches > 0 else whole


def batches(n: int, rows: Callable[[np.ndarray], tuple[Any, ...]], batch_size: int, rank: int,
            world: int, max_batches: int, device: torch.device | str = "cpu",
            ) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's batches of an evaluation pass: (inputs, targets[, positions]); a row past
    the set's end repeats sample 0 with every target -100."""
    dev = torch.device(device)
    for b in range(n_batches(n, batch_size, world, max_batches)):
        ids = np.arange(batch_size) + (b * world + rank) * batch_size
        past = ids >= n
        x, y, *pos = rows(np.where(past, 0, ids))
        if past.any():
            y = y.clone()
            y[torch.from_numpy(past)] = IGNORE
        yield tuple(t.to(dev) for t in (x, y, *(p for p in pos if p is not None)))


@dataclass(frozen=True)
class EvalScope:
    """What an evaluation pass covers, for the run's header."""

    whole: bool  # every sample of the set once (else the first batches of it)
    samples: int  # sequences evaluated (all ranks)
    total: int  # sequences in the set
    tokens: int  # counted targets evaluated

    def line(self) -> str:
        if self.whole:
            return f"the whole set: {self.samples:,} sequences, {self.tokens:,} tokens"
        return (f"sampled: {self.samples:,} of {self.total:,} sequences, {self.tokens:,} "
                "tokens (train.eval_batches; 0 evaluates the whole set)")


def scope(val: Any, cfg: Config, world: int) -> EvalScope:
    """What each evaluation of this run covers (reads the data, runs no model)."""
    n, rows = _rows(val, cfg)
    b, dp = cfg.train.batch_size, world // cfg.parallel.tp
    used = min(n, n_batches(n, b, dp, cfg.train.eval_batches) * b * dp)
    tokens = 0
    for at in range(0, used, 1024):
        y = rows(np.arange(at, min(at + 1024, used)))[1]
        tokens += int((y != IGNORE).sum())
    return EvalScope(used == n, used, n, tokens)


@torch.no_grad()
def evaluate(built: Built, val: Any, cfg: Config, rank: int, world: int,
             device: torch.device) -> EvalResult:
    """Loss, perplexity and token accuracy over the evaluation set ([Note: evaluation set];
    a collective: one all-reduce of three numbers)."""
    tp = cfg.parallel.tp
    # A TP group shares its batches: only its first rank counts them.
    counts = rank % tp == 0
    n, rows = _rows(val, cfg)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y, *pos in batches(n, rows, cfg.train.batch_size, rank // tp, world // tp,
                              cfg.train.eval_batches, device):
        logits = built.logits(x, *pos)
        if counts:
            totals += sums(logits, y)
    Cm.all_reduce(totals, None, label="validation loss")
    return result(totals)
