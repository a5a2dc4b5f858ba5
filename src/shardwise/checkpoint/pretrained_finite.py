"""`load_pretrained` refuses NaN/inf in the stored weights, naming file, key and count.

A pretrained folder with a damaged data region (bytes of 0xff read as NaN) loaded without a
word; the first training step then stopped on a non-finite loss and blamed training. Each
rank counts NaN/inf in the blocks it read (block_reader.py); the ranks read different rows,
so they agree on the verdict (one tiny all-reduce on every load) and, only when some rank
found any, gather what each found so that every rank raises the same complete message.

Counts add up over distinct blocks: ranks that read the same block (replicas of HYBRID_SHARD,
buffers and unsharded parameters that every rank reads whole) count it once.
"""

from __future__ import annotations

import json

from ..engine.core.context import ModelGroup

Found = dict[tuple[str, str, tuple[tuple[int, int], ...]], int]


def _encode(found: Found) -> bytes:
    return json.dumps([[f, k, [list(b) for b in block], n]
                       for (f, k, block), n in sorted(found.items())]).encode()


def totals(blobs: list[bytes]) -> list[tuple[str, str, int]]:
    """(file, key, NaN/inf count) from every rank's findings, each block counted once."""
    per_key: dict[tuple[str, str], dict[tuple[tuple[int, int], ...], int]] = {}
    for blob in blobs:
        for f, k, block, n in json.loads(blob or b"[]"):
            per_key.setdefault((f, k), {})[tuple(tuple(b) for b in block)] = n
    return [(f, k, sum(blocks.values())) for (f, k), blocks in sorted(per_key.items())]


def agree_finite(found: Found, path: str, group: ModelGroup, in_place: bool) -> None:
    """Raise ValueError on every rank of `group` if any rank read a NaN/inf value.

    `in_place`: some parameters were materialized before the load and were read in place
    (they now hold what was read); meta parameters are never committed after a refusal.
    """
    if group.agree(not found, label="load_pretrained finite"):
        return
    mine = _encode(found)
    blobs = group.all_gather_bytes(mine) if group.size > 1 else [mine]
    bad = totals(blobs)
    limit = 8
    lines = "; ".join(f"{f}: {k} has {n} NaN/inf value{'s' if n != 1 else ''}"
                      for f, k, n in bad[:limit])
    more = f"; and {len(bad) - limit} more tensors" if len(bad) > limit else ""
    state = ("parameters that were already materialized were read in place and hold these "
             "values" if in_place else "nothing was loaded")
    raise ValueError(
        f"{path}: the stored weights are not finite (counted in the model's dtypes): "
        f"{lines}{more}. The files are damaged or were saved from a diverged model; "
        f"{state}. sw.load_pretrained(..., allow_nonfinite=True) loads them anyway")
