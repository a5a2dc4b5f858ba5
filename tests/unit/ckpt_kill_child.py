"""A job that saves checkpoints back to back until it is SIGKILLed (test_checkpoint_kill).

Version v of the state is all-v: every parameter and every AdamW moment is filled with v,
so a checkpoint that mixed two saves, or lost a row, cannot load as any single version.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import torch
from torch import nn

import shardwise as sw

# The first AdamW construction in a process pays seconds of lazy imports; pay them here,
# once, in the forkserver that preloads this module (no kernel runs: no threads to fork).
torch.optim.AdamW([nn.Parameter(torch.zeros(1))])

WIDTH = 192  # 4 layers: ~150k parameters, ~1.8 MB per save with AdamW state


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # Odd widths: at 2 ranks the shards are uneven.
    model = nn.Sequential(*[nn.Linear(WIDTH + i, WIDTH + i + 1) for i in range(4)])
    sw.shard_model(model, auto_wrap_policy=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the state
    opt.zero_grad()
    return model, opt


def set_version(model: nn.Module, opt: torch.optim.Optimizer, v: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)
            st = opt.state[p]
            st["exp_avg"].fill_(v)
            st["exp_avg_sq"].fill_(v)
            st["step"].fill_(v)


def version_of(model: nn.Module, opt: torch.optim.Optimizer) -> set[float]:
    """Every distinct value in the state (one element: a clean version)."""
    seen: set[float] = set()
    for t in sw.full_state_dict(model).values():
        seen |= set(t.unique().tolist())
    for st in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            seen |= set(st[k].unique().tolist())
    return seen


def noop() -> None:
    pass


def saver(path: str, start: int, conn: Connection | None, rank: int, world: int,
          port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if world > 1:
        sw.init_distributed("gloo", timeout_s=30)
    model, opt = make()
    v = start
    while True:
        set_version(model, opt, v)
        sw.save_checkpoint(path, model, opt, step=v, extra={"v": v})
        if conn is not None:
            conn.send(v)
        v += 1
