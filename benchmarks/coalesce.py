"""Choosing `coalesce_bytes` by measurement (issue 43 part 2, [Note: coalesced units]).

Models: `nn.Sequential` of 48 blocks `Linear(W, W) + Tanh`, each block `fully_shard`ed, then
the root; SGD; batch 4 per rank; W in `--widths` (32: 4 KiB per unit, 128: 64 KiB, 512:
1 MiB). For each budget in `--budgets` (bytes; 0 = each unit alone, FSDP2's way) the same
model is built and stepped, the budgets alternating round by round in one process group;
each step starts at a barrier, and a budget's step time is the median of its steps, the
slowest rank's. Printed per width: step ms per budget, its ratio to budget 0, the
collectives per step (all-gathers + reduce-scatters, counted on the unit's events) and the
largest all-gather a step issued (the memory the group's output buffer costs).

    python benchmarks/coalesce.py [--world 2] [--widths 32,128,512]
        [--budgets 0,65536,262144,1048576,4194304,16777216] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from shardwise.testing import run_distributed

UNITS = 48
BATCH = 4


def build(width: int, budget: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    import shardwise as sw

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                            for _ in range(UNITS)])
    for block in model:
        sw.fully_shard(block, coalesce_bytes=budget)
    sw.fully_shard(model, coalesce_bytes=budget)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _timer(rank: int, world: int, width: int, budgets: list[int], rounds: int,
           steps: int) -> dict[str, Any]:
    import shardwise as sw
    from shardwise.engine.core.context import context_of

    torch.set_num_threads(1)
    sw.init_distributed("gloo")
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    built = {b: build(width, b) for b in budgets}
    counts: dict[int, tuple[int, int]] = {}
    for b in budgets:
        model, opt = built[b]
        step(model, opt, x)  # lazy init and the recorded order
        events: list[Any] = []
        ctx = context_of(model)
        assert ctx is not None
        ctx.sinks.append(events.append)
        step(model, opt, x)
        ctx.sinks.remove(events.append)
        colls = [e for e in events if e.collective in ("all_gather", "reduce_scatter")]
        largest = max((e.bytes for e in colls if e.collective == "all_gather"), default=0)
        counts[b] = (len(colls), largest)
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(rounds):
        order = budgets[r % len(budgets):] + budgets[: r % len(budgets)]
        for b in order:
            model, opt = built[b]
            for _ in range(steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step(model, opt, x)
                times[b].append(time.perf_counter() - t0)
    return {"times": times, "counts": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--widths", default="32,128,512")
    ap.add_argument("--budgets", default="0,65536,262144,1048576,4194304,16777216")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    for width in (int(w) for w in a.widths.split(",")):
        per_rank = run_distributed(_timer, a.world, width, budgets, a.rounds, a.steps,
                                   timeout_s=1200)
        t = {b: max(statistics.median(r["times"][b]) for r in per_rank) for b in budgets}
        unit_kib = (width * width + width) * 4 / 1024
        print(f"{a.world} ranks, {UNITS} units of {unit_kib:.0f} KiB (Linear({width}, "
              f"{width})), {a.rounds} rounds x {a.steps} steps:", flush=True)
        for b in budgets:
            n, largest = per_rank[0]["counts"][b]
            print(f"  coalesce_bytes {b:>9}: step {t[b] * 1e3:8.2f} ms  "
                  f"x{t[b] / t[budgets[0]]:.2f} of budget {budgets[0]}  "
                  f"collectives/step {n:4d}  largest all-gather {largest / 1024:8.0f} KiB",
                  flush=True)


if __name__ == "__main__":
    main()
