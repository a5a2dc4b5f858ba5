"""The optimizer step alone on a sharded model, at 2 ranks on CPU (gloo).

Issue 14 made sharded parameters DTensors; AdamW then dispatches through DTensor. This
measures `opt.step()` only (no forward/backward communication), against the same step on
plain tensors of the same local shapes in the same process, so the printed ratio
(sharded step / plain step) is comparable across versions of the engine on a noisy machine.

    .venv/bin/python benchmarks/optim_step.py [--steps 30] [--foreach default|0|1]

`--foreach default` (the default) builds `torch.optim.AdamW(params, lr=1e-3)` with torch's own
choice, which on CPU is the per-parameter path.
"""

from __future__ import annotations

import argparse
import statistics
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


class _DTensorAdamW(torch.optim.AdamW):
    """AdamW under another class name: shardwise's fast path ([Note: optimizer fast path]
    in engine/optim_step.py) applies to the exact torch classes, so this measures the step
    dispatching through DTensor, as it ran before the fast path."""


def _time(opt: torch.optim.Optimizer, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t) / steps


def _worker(rank: int, world: int, steps: int, foreach: bool | None,
            rounds: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = _model()
    sw.shard_model(model, auto_wrap_policy=lambda m: isinstance(m, nn.Sequential) and m
                   is not model)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    kw = {} if foreach is None else {"foreach": foreach}
    opts = {"sharded": torch.optim.AdamW(params, lr=1e-3, **kw),
            "sharded via DTensor": _DTensorAdamW(params, lr=1e-3, **kw)}
    # The same local shapes as plain tensors: what the step costs without any wrapper.
    plain = [torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p,
                              requires_grad=True) for p in params]
    for p in plain:
        p.grad = torch.ones_like(p)
    opts["plain"] = torch.optim.AdamW(plain, lr=1e-3, **kw)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for o in opts.values():
        _time(o, 2)  # state allocation, warm-up
    for r in range(rounds):  # alternating rounds, rotated order: the machine is noisy
        names = list(opts)
        for name in names[r % 3:] + names[: r % 3]:
            times[name].append(_time(opts[name], steps))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--foreach", choices=("default", "0", "1"), default="default")
    a = ap.parse_args()
    foreach = None if a.foreach == "default" else a.foreach == "1"
    t = run_distributed(_worker, 2, a.steps, foreach, a.rounds)[0]
    print(f"optimizer step (AdamW, foreach={foreach}, 2 ranks, rank 0, median of "
          f"{a.rounds} alternating rounds of {a.steps} steps):")
    for name, v in t.items():
        print(f"  {name:20s} {v * 1e3:7.2f} ms  {v / t['plain']:.2f}x plain")


if __name__ == "__main__":
    main()
