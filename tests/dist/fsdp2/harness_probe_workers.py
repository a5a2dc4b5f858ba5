"""Cases for the grid harness's own tests (test_harness.py): they check the harness, not
shardwise."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.dist.fsdp2.common import Expect


def agree(rank: int, world: int, ex: Expect) -> None:
    """One all-reduce every rank joins: the ranks are still in step."""
    t = torch.ones(1)
    dist.all_reduce(t)
    ex.true(t.item() == world, f"all-reduce gave {t.item()}, not {world}")


def sleeps(rank: int, world: int, ex: Expect, seconds: float, on_rank: int = -1) -> None:
    """Sleep `seconds` on `on_rank` (every rank when -1): a case that takes that long."""
    if on_rank in (-1, rank):
        time.sleep(seconds)
