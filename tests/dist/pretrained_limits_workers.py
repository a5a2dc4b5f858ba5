"""sw.load_pretrained's limits on real ranks: NaN/inf in the stored weights are named at
load on every rank; the file bytes a rank has mapped never exceed the read buffer."""

from __future__ import annotations

import os
from typing import Any

import torch

import shardwise as sw
from shardwise.checkpoint import block_reader, pretrained
from shardwise.engine.core.context import sharded_params
from tests import hf_models as H
from tests.dist.pretrained_workers import _raises, assert_equal_to, full, shard


def nonfinite(rank: int, world: int, folder: str, expected: dict[str, int]) -> None:
    """`expected`: stored key -> NaN/inf count (from safetensors' own load of the files).
    Every rank raises one ValueError naming each file, key and the count over all ranks,
    though each rank read only its rows; nothing was committed. allow_nonfinite loads."""
    m = shard(H.meta_model(folder), "FULL_SHARD", world)
    msg = _raises(ValueError, lambda: sw.load_pretrained(m, folder), "not finite",
                  "allow_nonfinite=True", "nothing was loaded")
    files = H.safetensors_files(folder)
    for key, n in expected.items():
        where = [f for f in files if key in _keys(f)]
        assert f"{where[0]}: {key} has {n} NaN/inf values" in msg, (key, n, msg)
    assert "raised on rank" not in msg  # every rank's own complete verdict
    assert all(sp.is_meta for sp in sharded_params(m)), "a refused load committed shards"
    r = sw.load_pretrained(m, folder, allow_nonfinite=True)
    assert not r.missing_keys
    for key, n in expected.items():
        p = full(m.get_parameter(key).detach())
        assert int((~torch.isfinite(p)).sum()) == n, key


def _keys(path: Any) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def _mapped_rss(folder: str) -> int:
    """Resident bytes of this process's mappings of files in `folder` (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's line
                mine = len(head) >= 6 and head[5].startswith(folder + os.sep)
            elif mine and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def bounded(rank: int, world: int, folder: str, budget: int) -> dict[str, int]:
    """A model in many files loaded into bf16 shards (every chunk converts through the
    staging buffer) with a `budget`-byte buffer: the folder's files mapped in this process
    are sampled before every tensor's read and never exceed the budget; the staging buffer
    never does either; the weights equal from_pretrained's."""
    real_owned, real_buffer = pretrained.owned_block, block_reader.BlockReader._buffer
    seen = {"mapped": 0, "buffer": 0, "samples": 0}

    def owned(sp: Any) -> Any:
        seen["mapped"] = max(seen["mapped"], _mapped_rss(folder))
        seen["samples"] += 1
        return real_owned(sp)

    def buffer(self: Any, nbytes: int) -> torch.Tensor:
        seen["buffer"] = max(seen["buffer"], nbytes)
        return real_buffer(self, nbytes)

    m = shard(H.meta_model(folder, torch.bfloat16), "FULL_SHARD", world)
    pretrained.owned_block = owned  # type: ignore[assignment]
    block_reader.BlockReader._buffer = buffer  # type: ignore[method-assign]
    old_budget = pretrained.DEFAULT_BUFFER_BYTES
    pretrained.DEFAULT_BUFFER_BYTES = budget
    try:
        sw.load_pretrained(m, folder)
    finally:
        pretrained.owned_block = real_owned  # type: ignore[assignment]
        block_reader.BlockReader._buffer = real_buffer  # type: ignore[method-assign]
        pretrained.DEFAULT_BUFFER_BYTES = old_budget
    assert seen["samples"] > 10, seen
    assert seen["mapped"] <= budget, (rank, seen, budget)
    assert 0 < seen["buffer"] <= budget, (rank, seen, budget)
    assert_equal_to(m, H.reference(folder, torch.bfloat16), "bf16 from many files")
    return seen
