"""The evaluation set is covered once ([Note: evaluation set] in train/eval_metrics.py): every
counted target of the validation data is a target of exactly one rank's batch, at any world
size, whether the set divides into global batches or not; a sampled pass never cycles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.train import data as D
from shardwise.train import eval_metrics as E
from shardwise.train import token_parts as P
from shardwise.train.token_cache import TokenData

IGNORE = -100


def _targets(n: int, rows, batch: int, world: int, max_batches: int = 0) -> list[int]:
    """Every counted target of every rank's batches, in order of (batch, rank, row)."""
    got = [list(E.batches(n, rows, batch, r, world, max_batches)) for r in range(world)]
    assert len({len(g) for g in got}) == 1, "every rank runs the same number of forwards"
    out: list[int] = []
    for b in range(len(got[0])):
        for r in range(world):
            y = got[r][b][1]
            out.extend(int(v) for v in y[y != IGNORE])
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bytes_every_target_once(world: int) -> None:
    tokens = torch.arange(1, 200, dtype=torch.uint8)  # 199 bytes: 198 targets, 16 a window
    n, rows = D.eval_rows(tokens, 16)
    assert n == 13  # 12 full windows (192 targets) and a tail of 6
    assert sorted(_targets(n, rows, 2, world)) == list(range(2, 200))


def test_bytes_sample_never_cycles() -> None:
    tokens = torch.arange(1, 200, dtype=torch.uint8)
    n, rows = D.eval_rows(tokens, 16)
    got = _targets(n, rows, 2, 2, max_batches=100)  # more batches than the set holds
    assert sorted(got) == list(range(2, 200))
    assert len(_targets(n, rows, 2, 2, max_batches=1)) == 4 * 16


def _data(lengths: list[int], mask_every: int = 1) -> TokenData:
    ids = np.arange(sum(lengths), dtype=np.int64) % 97 + 3
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[::mask_every] = 1
    docs = np.cumsum([0, *lengths[:-1]])
    return TokenData(tokens=ids, mask=mask, docs=docs, key="k", meta={"eos_id": 0},
                     path=Path("."), built=False)


def _counted(data: TokenData) -> list[int]:
    """Every token the set counts: in its mask and not a document's first token."""
    out = []
    for d, start in enumerate(data.docs):
        end = data.docs[d + 1] if d + 1 < len(data.docs) else len(data.tokens)
        out += [int(data.tokens[i]) for i in range(start + 1, end) if data.mask[i]]
    return sorted(out)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_token_part_every_target_once(packed: bool, world: int) -> None:
    lengths = [5, 9, 3, 7, 12, 4, 6]  # 46 tokens; every document shorter than a window
    data = _data(lengths, mask_every=2)
    p = P.pieces(data, 9)
    part = P.TokenPart(data, p, np.ones(len(p.start), dtype=bool), 8, packed, tail=True)
    n, rows = P.eval_rows(part, seed=5)
    assert sorted(_targets(n, rows, 2, world)) == _counted(data)
