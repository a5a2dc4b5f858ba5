"""A user script whose last collective gloo lets go of slowly, after the script has ended.

The deterministic form of the exit race in [Note: gloo teardown] (process_group.py) for
collectives that do not go through shardwise: launched by tests/e2e/test_exit.py under
`torchrun --standalone --nproc-per-node 2`.

Rank 0 gives a tensor to an async `dist.all_reduce` on a process group of its own (as
DeviceMesh's groups are: the exit barrier on the default group does not wait for its work)
and drops every Python reference to it while the collective is still in flight (rank 1
joins a second later). Gloo's worker thread then holds the last reference; when it drops
it, the tensor's Python object dies in that worker thread and a weakref callback runs there,
sleeping SW_EXIT_RELEASE_S seconds with the GIL released: a worker that is slow to let go,
as a worker preempted on a loaded machine is. If the exit drain returns meanwhile, the
interpreter finalizes, the worker asks for the GIL back and is ended by CPython inside a
noexcept destructor: SIGABRT, "terminate called without an active exception".
"""

from __future__ import annotations

import os
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw

rank, world, _ = sw.init_distributed()
# A sharded model, as in any shardwise script (its collectives register the exit drain).
sw.full_state_dict(sw.shard_model(nn.Linear(4, 4), auto_wrap_policy=None))
group = dist.new_group(list(range(world)))
release_s = float(os.environ.get("SW_EXIT_RELEASE_S", "0.5"))


def slow_release(_: object) -> None:
    time.sleep(release_s)


t = torch.ones(1000)
kept = weakref.ref(t, slow_release)  # fires in whichever thread drops the last reference
if rank != 0:
    time.sleep(1.0)  # rank 0's collective is still in flight when it lets go of the tensor
work = dist.all_reduce(t, group=group, async_op=True)
del t, work
