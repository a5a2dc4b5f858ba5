"""Workers of test_token_data.py: the token cache prepared on every rank at once."""

from __future__ import annotations

import hashlib
from typing import Any

from shardwise.train import token_cache as TC
from shardwise.train import token_parts as P


def shared_prepare(rank: int, world: int, data: str, folder: str, cache: str) -> dict[str, Any]:
    try:
        got = TC.prepare_shared(data, folder, cache)
    except ValueError as e:
        return {"error": str(e)}
    train, _ = P.split(got, 0.1, 16, seed=9)
    stream = P.TokenBatchStream(train, 16, 2, rank, world, seed=9)
    steps = [stream.next()[:2] for _ in range(3)]
    return {"key": got.key, "built": got.built,
            "tokens": hashlib.sha256(got.tokens.tobytes() + got.mask.tobytes()).hexdigest(),
            "x": [x.tolist() for x, _ in steps], "y": [y.tolist() for _, y in steps]}
