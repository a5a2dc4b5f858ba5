"""What the collective checks cost: step time with SHARDWISE_DEBUG off vs on, side by side.

    .venv/bin/python benchmarks/debug_overhead.py [preset] [rounds]

2 gloo ranks train `shardwise train`'s GPT (default preset 'small', 8 x 128 tokens per rank,
FULL_SHARD, transformer wrap) and alternate debug off / on every round in the same processes,
so both see the same machine. Prints median step times, the ratio, and the collectives checked
per step.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.engine import debug  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.train.model import GPT, preset  # noqa: E402


def worker(rank: int, world: int, name: str, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(preset(name))
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (8, 128), generator=g)
    times: dict[bool, list[float]] = {False: [], True: []}
    checked = 0
    for r in range(rounds * 2 + 1):
        on = r % 2 == 1
        sw.set_debug(on)
        before = sum(debug._sequence.values())
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if r > 0:  # round 0 warms up (first step records the unit order)
                times[on].append(time.perf_counter() - t0)
        if on:
            checked = (sum(debug._sequence.values()) - before) // steps
    sw.set_debug(False)
    return {"off": statistics.median(times[False]), "on": statistics.median(times[True]),
            "checked_per_step": checked}


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "small"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    res = run_distributed(worker, 2, name, rounds, 4, timeout_s=1800)[0]
    print(f"GPT '{name}', 2 gloo ranks, 8 x 128 tokens per rank, FULL_SHARD")
    print(f"  debug off  {res['off'] * 1e3:8.1f} ms/step (median)")
    print(f"  debug on   {res['on'] * 1e3:8.1f} ms/step  ({res['checked_per_step']} collectives "
          f"checked per step)")
    print(f"  overhead   {res['on'] / res['off']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
