"""One system's training steps alone, for a profiler (py-spy) to attribute the step.

    py-spy record --subprocesses -r 40 --format raw -o prof.raw -- \
        .venv/bin/python benchmarks/profile_step.py bench30m 6 2 ["shardwise FULL_SHARD"]

Arguments: preset, steps (the first is a warm-up), sequences per rank, system name (from
shardwise.bench.systems). Prints each rank's median forward, backward, optimizer and total
seconds per step.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from shardwise.bench.runner import make_config
from shardwise.bench.systems import SYSTEMS
from shardwise.testing import run_distributed


def _worker(rank: int, world: int, preset: str, steps: int, batch: int,
            system: str) -> list[tuple[float, ...]]:
    from shardwise.train.model import GPT

    torch.set_num_threads(1)
    cfg = make_config(preset, 128)
    torch.manual_seed(0)
    model, opt = SYSTEMS[system](GPT(cfg))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (batch, 128), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, 128), generator=g)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        out.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t0))
    return out[1:]


def main() -> None:
    preset, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    system = sys.argv[4] if len(sys.argv) > 4 else "shardwise FULL_SHARD"
    for rank, rows in enumerate(run_distributed(_worker, 2, preset, steps, batch, system)):
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"rank {rank}: forward {med[0]:.3f} s, backward {med[1]:.3f} s, "
              f"optimizer {med[2]:.3f} s, step {med[3]:.3f} s")


if __name__ == "__main__":
    main()
