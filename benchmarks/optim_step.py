"""The optimizer step alone on a sharded model, at 2 ranks on CPU (gloo).

Issue 14 made sharded parameters DTensors; AdamW then dispatches through DTensor. This
measures `opt.step()` only (no forward/backward communication), against the same step on
plain tensors of the same local shapes in the same process, so the printed ratio
(sharded step / plain step) is comparable across versions of the engine on a noisy machine.

    .venv/bin/python benchmarks/optim_step.py [--steps 30] [--foreach default|0|1]

`--foreach default` (the default) builds `torch.optim.AdamW(params, lr=1e-3)` with torch's own
choice, which on CPU is the per-parameter path.

    .venv/bin/python benchmarks/optim_step.py --impls [--params 16_000_000]

prints AdamW's three implementations side by side ([Note: optimizer implementation] in
train/optim.py): fused, foreach and the per-parameter for-loop, each on plain tensors in one
process and one thread, and on the sharded model at 2 ranks (through the optimizer fast
path), with each one's time over the for-loop's.
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
    """AdamW under another class name. While shardwise had an optimizer fast path (a global
    hook for the exact torch classes, removed with issue 35), this measured the step
    dispatching through DTensor; now both classes take that same path."""


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


IMPLS = ("fused", "foreach", "for-loop")


def _impl_times(params: list[torch.Tensor], steps: int, rounds: int) -> dict[str, float]:
    from shardwise.train.optim import adamw

    for p in params:
        p.grad = torch.ones_like(p)
    opts = {i: adamw(params, impl=i, lr=1e-3)[0] for i in IMPLS}
    for o in opts.values():
        _time(o, 2)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for r in range(rounds):
        for name in IMPLS[r % 3:] + IMPLS[: r % 3]:
            times[name].append(_time(opts[name], steps))
    return {k: statistics.median(v) for k, v in times.items()}


def _impls_worker(rank: int, world: int, n_params: int, steps: int,
                  rounds: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, n_params // width**2))])
    sw.shard_model(model, auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
    return _impl_times(list(model.parameters()), steps, rounds)


def compare_impls(n_params: int, steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    width = 1024
    plain = [torch.zeros(width, width, requires_grad=True)
             for _ in range(max(1, n_params // width**2))]
    one = _impl_times(plain, steps, rounds)
    two = run_distributed(_impls_worker, 2, n_params, steps, rounds)[0]
    n = len(plain) * width * width
    print(f"AdamW step, {n / 1e6:.1f}M fp32 parameters, 1 thread per process, median of "
          f"{rounds} alternating rounds of {steps} steps:")
    print(f"  {'implementation':<16}{'plain, 1 rank':>16}{'sharded, 2 ranks':>20}"
          f"{'plain / loop':>14}{'sharded / loop':>16}")
    for i in IMPLS:
        print(f"  {i:<16}{one[i] * 1e3:>13.1f} ms{two[i] * 1e3:>17.1f} ms"
              f"{one[i] / one['for-loop']:>14.2f}{two[i] / two['for-loop']:>16.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--foreach", choices=("default", "0", "1"), default="default")
    ap.add_argument("--impls", action="store_true",
                    help="fused vs foreach vs for-loop instead")
    ap.add_argument("--params", type=int, default=16_000_000)
    a = ap.parse_args()
    if a.impls:
        compare_impls(a.params, a.steps, a.rounds)
        return
    foreach = None if a.foreach == "default" else a.foreach == "1"
    t = run_distributed(_worker, 2, a.steps, foreach, a.rounds)[0]
    print(f"optimizer step (AdamW, foreach={foreach}, 2 ranks, rank 0, median of "
          f"{a.rounds} alternating rounds of {a.steps} steps):")
    for name, v in t.items():
        print(f"  {name:20s} {v * 1e3:7.2f} ms  {v / t['plain']:.2f}x plain")


if __name__ == "__main__":
    main()
