"""GPU workers that look inside one training step: host-device syncs and exposed waits.

Both shard a small dense model (three blocks on float inputs, a linear head) with
FULL_SHARD on NCCL, one rank per GPU. It has no embedding and no integer targets on
purpose: torch's own kernels for those may synchronize, and these checks are about what the
engine adds to the step, not about torch's kernels.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

import shardwise as sw
from tests.models import Block

WIDTH = 256
DELAY_S = 0.5


class Dense(nn.Module):
    def __init__(self, d: int = WIDTH, n_layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _sharded(mp: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Dense()
    sw.shard_model(model, sharding_strategy="FULL_SHARD",
                   auto_wrap_policy=sw.transformer_policy({Block}), mixed_precision=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch already on this rank's GPU: a host-to-device copy of pageable memory is
    itself a sync, and it is the caller's, not the step's."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    device = torch.device("cuda", torch.cuda.current_device())
    return x.to(device), y.to(device)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y) ** 2).mean()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> None:
    _loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _mode_catches_a_sync(x: torch.Tensor) -> bool:
    """The control: under "error" a plain `.item()` must raise, or the check below could
    not fail on this build."""
    try:
        x.sum().item()
    except RuntimeError:
        return True
    return False


def no_host_sync(rank: int, world: int, mp: str | None) -> dict:
    """A forward and backward after one warm-up step, under sync debug mode "error": any
    host-device sync in them raises here, with the traceback of the op that made it. The
    optimizer step stays outside (it is the user's, and its foreach kernels are torch's)."""
    model, opt = _sharded(mp)
    warm, checked = _batch(rank, 0), _batch(rank, 1)
    _step(model, opt, *warm)  # lazy init, NCCL communicators, the recorded unit order
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        caught = _mode_catches_a_sync(checked[0])
        loss = _loss(model, *checked)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    opt.step()
    opt.zero_grad()
    return {"mode_catches_a_sync": caught, "loss": loss.item()}


def traced_gather_waits(rank: int, world: int, trace_dir: str) -> list[float]:
    """The exposed waits of one traced step's all-gathers, where rank 0 joins DELAY_S late.

    After the trace starts (a collective both ranks leave together) rank 0 sleeps on the
    host, so rank 1's first all-gather cannot finish for about DELAY_S. Rank 1's host does
    not wait for it (NCCL; the compute stream waits by an event), so only CUDA events on the
    compute stream around that wait can see the stall: host time around it reads about 0.
    """
    model, opt = _sharded(None)
    x, y = _batch(rank, 0)
    _step(model, opt, x, y)  # warm-up, untraced
    torch.cuda.synchronize()
    with sw.trace(trace_dir, model) as t:
        t.step(1)
        if rank == 0:
            time.sleep(DELAY_S)
        _step(model, opt, x, y)
        torch.cuda.synchronize()
    waits = [e.wait for e in t.events if e.collective == "all_gather" and e.step == 1]
    assert all(math.isfinite(w) for w in waits), waits
    return waits
