"""A user's training script that one rank stops on cue (tests/e2e/test_stop_library.py).

`python stop_script.py OUT` under torchrun or as Slurm-style tasks (SLURM_* variables, no
RANK: `sw.init_distributed()` takes the ranks from Slurm's variables); `python stop_script.py
OUT --spawn N` starts N ranks with torch.multiprocessing.spawn. SW_STOP_CAUSE (exception,
sigint, timeout) fires on rank SW_STOP_RANK before step 3, writing the moment to OUT/fired;
every rank writes OUT/rank{r}.json at start-up (rank, world, whether RANK is in os.environ).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import shardwise as sw


def train(out: Path) -> None:
    rank, world, _ = sw.init_distributed()
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": world, "rank_in_env": "RANK" in os.environ}))
    torch.manual_seed(0)
    model = sw.shard_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                           auto_wrap_policy=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cause, who = os.environ.get("SW_STOP_CAUSE", ""), int(os.environ.get("SW_STOP_RANK", "0"))
    for step in range(1, 10_000):
        if step == 3 and rank == who and cause:
            (out / "fired").write_text(repr(time.time()))
            if cause == "exception":
                raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
            if cause == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
            if cause == "timeout":
                time.sleep(float(os.environ.get("SW_STOP_STALL_S", "10")))
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)


def spawned(rank: int, world: int, port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    train(out)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if "--spawn" in sys.argv:
        import torch.multiprocessing as mp

        from shardwise.engine.comm.process_group import free_port

        world = int(sys.argv[sys.argv.index("--spawn") + 1])
        mp.spawn(spawned, args=(world, free_port(), out), nprocs=world)
    else:
        train(out)
