"""The optimizer step alone on a sharded model, at 2 ranks on CPU (gloo).

Issue 14 made sharded parameters DTensors; AdamW then dispatches through DTensor. This
measures `opt.step()` only (no forward/backward communication), against the same step on
plain tensors of the same local shapes in the same process, so the printed ratio
(sharded step / plain step) is comparable across versions of the engine on a noisy machine.

    .venv/bin/python benchmarks/optim_step.py [--steps 30] [--foreach 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import shardwise as sw
from shardwise.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
              for _ in range(8)]
    return nn.Sequential(*blocks)


def _time(opt: torch.optim.Optimizer, steps: int) -> float:
    for _ in range(3):
        opt.step()
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t) / steps


def _worker(rank: int, world: int, steps: int, foreach: bool) -> tuple[float, float]:
    torch.set_num_threads(1)
    model = _model()
    sw.shard_model(model, auto_wrap_policy=lambda m: isinstance(m, nn.Sequential) and m
                   is not model)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    sharded = _time(opt, steps)
    # The same local shapes as plain tensors: what the step costs without any wrapper.
    plain = [torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p,
                              requires_grad=True) for p in params]
    for p in plain:
        p.grad = torch.ones_like(p)
    popt = torch.optim.AdamW(plain, lr=1e-3, foreach=foreach)
    return sharded, _time(popt, steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--foreach", type=int, default=1)
    a = ap.parse_args()
    out = run_distributed(_worker, 2, a.steps, bool(a.foreach))
    sharded, plain = out[0]
    print(f"optimizer step (AdamW, foreach={bool(a.foreach)}, 2 ranks, rank 0): "
          f"sharded {sharded * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms, "
          f"ratio {sharded / plain:.2f}x")


if __name__ == "__main__":
    main()
