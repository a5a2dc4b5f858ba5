"""Bad inputs on two ranks: each call fails on every rank, before any collective.

The single-process rows are in bad_inputs.py; tests/unit/test_bad_input.py runs this worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import shardwise as sw

from . import bad_inputs as B

nan = float("nan")

# On 2 ranks: each call fails on every rank, and the ranks stay in step (no rank is left
# inside a collective the other never joined). load_full_state_dict is bad on rank 1 only.
DIST_EXPECT = {
    "shard_model": "sharding_strategy='ZERO3'",
    "clip_grad_norm_": "max_norm=nan",
    "full_state_dict": "rank0_only='yes'",
    "save_checkpoint": "step=-1",
    "load_checkpoint": "no checkpoint directory there",
    "export_safetensors": "max_shard_bytes=0",
    "load_full_state_dict": "state dict does not match the model",
}


def dist_worker(rank: int, world: int, tmp: str) -> list[tuple[str, str, str]]:
    import torch.distributed as dist

    model = B.sharded()
    good = sw.full_state_dict(model)
    calls: dict[str, Callable[[], Any]] = {
        "shard_model": B._sm(sharding_strategy="ZERO3"),
        "clip_grad_norm_": lambda: sw.clip_grad_norm_(model, nan),
        "full_state_dict": lambda: sw.full_state_dict(model, rank0_only="yes"),  # type: ignore
        "save_checkpoint": lambda: sw.save_checkpoint(os.path.join(tmp, "c"), model, step=-1),
        "load_checkpoint": lambda: sw.load_checkpoint(os.path.join(tmp, "none"), model),
        "export_safetensors": lambda: sw.export_safetensors(tmp, model, max_shard_bytes=0),
        "load_full_state_dict": lambda: sw.load_full_state_dict(model, good if rank == 0 else {}),
    }
    out = []
    for name, fn in calls.items():
        try:
            fn()
            out.append((name, "no error", ""))
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            out.append((name, "ValueError" if isinstance(e, ValueError) else type(e).__name__,
                        str(e)))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return out
