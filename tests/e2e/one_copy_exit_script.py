"""Rank 0 ends right after a forward that left its parameters gathered, and tears the group
down itself; rank 1 is late to read them. Launched by test_one_copy_exit.py under torchrun
with 2 ranks. Argument: a folder; rank 1 writes there whether its output was right, and
each rank whether gloo let go of everything at once after the teardown (the freeze check
of that forward is still in flight: no backward settled it)."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.engine.comm import one_copy
from shardwise.engine.comm import process_group as PG

rank, world, _ = sw.init_distributed()
torch.manual_seed(0)
# 512 x 300 fp32 at 2 ranks: 300 KB per rank, a message of its own; the bias goes packed.
model = nn.Linear(512, 300)
ref = copy.deepcopy(model)
sw.fully_shard(model)  # the root keeps its parameters after forward
x = torch.randn(4, 512)
with torch.no_grad():
    model(x)  # the first forward: layout check and channel set-up on both ranks
if rank == 1:
    # Rank 1 comes late to read rank 0's rows: rank 0 has computed and is on its way out.
    wait_read = one_copy.Exchange._wait_read

    def late(self: one_copy.Exchange) -> None:
        time.sleep(2.0)
        wait_read(self)

    one_copy.Exchange._wait_read = late  # type: ignore[method-assign]
out = model(x)  # grad mode, no backward: nothing releases the gathered rows here
if rank == 1:
    same = torch.equal(out, ref(x))
    Path(sys.argv[1], "rank1.txt").write_text("equal" if same else "DIFFERENT")
dist.destroy_process_group()  # no barrier: rank 0 reaches its exit first
# What the exit drain runs next: before, the check's work object kept its tensor's alias
# alive, and the drain waited out its whole bound (10 s) at every such exit.
Path(sys.argv[1], f"drained{rank}.txt").write_text(str(PG.wait_for_gloo_drops(2.0)))
