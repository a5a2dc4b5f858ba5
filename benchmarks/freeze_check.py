"""What the freeze check costs per step ([Note: freeze check] in engine/freeze_check.py).

    .venv/bin/python benchmarks/freeze_check.py [model] [rounds] [steps]

2 gloo ranks train a small model (model 'mlp': 4 blocks of Linear(64, 64) + Tanh, each its
own unit, batch 8; or a GPT preset of `shardwise train` such as 'small', 8 x 128 tokens per
rank), FULL_SHARD, AdamW, with the check on and off in alternating rounds in the same
processes (default 200 rounds of 1 step each way: on and off take turns every step, so a
change of the machine's load, large on a shared 2-core machine, falls on both alike).

Prints the median and mean step times each way, their difference, and the host time spent
inside the check itself per step (start: the fingerprint at the forward's start and the issue
at the first backward hook, which carries the hooked agreement; settle: the wait where the
schedule first needs it, [Note: hooked agreement] in engine/schedule_lockstep.py). Off, the
schedule decides on this rank's own hooked flags (the same decisions here: every unit is
hooked on every rank).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.engine.core.freeze_check import FreezeCheck  # noqa: E402
from shardwise.engine.core.inspect import context_of  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402


def _model(name: str) -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        for block in model:
            sw.fully_shard(block)
        sw.fully_shard(model)
        x = torch.randn(8, 64)
        return model, x, lambda out: out.square().mean()
    from shardwise.train.model import GPT, preset

    cfg = preset(name)
    model = GPT(cfg)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer")
    x = torch.randint(0, cfg.vocab_size, (8, min(128, cfg.block_size)))
    return model, x, lambda out: nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())


def worker(rank: int, world: int, name: str, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    model, x, loss_of = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inside = {"start": 0.0, "settle": 0.0}

    def timed(fn, key: str):  # host time spent inside the check's own calls
        def call(self: FreezeCheck, *args: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                inside[key] += time.perf_counter() - t0
        return call

    FreezeCheck.start = timed(FreezeCheck.start, "start")  # type: ignore[method-assign]
    FreezeCheck.issue = timed(FreezeCheck.issue, "start")  # type: ignore[method-assign]
    FreezeCheck.settle = timed(FreezeCheck.settle, "settle")  # type: ignore[method-assign]
    times: dict[bool, list[float]] = {False: [], True: []}
    spent: dict[str, list[float]] = {"start": [], "settle": []}
    for r in range(rounds * 2 + 1):
        on = r % 2 == 1
        for _ in range(steps):
            ctx = context_of(model)
            if ctx is not None and ctx.ready:
                ctx.freeze_check.enabled = on  # every rank alike: the check is a collective
            inside.update(start=0.0, settle=0.0)
            t0 = time.perf_counter()
            loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad()
            if r > 0:  # round 0 warms up (the first step checks the layout, records order)
                times[on].append(time.perf_counter() - t0)
                if on:
                    for k in spent:
                        spent[k].append(inside[k])
    n = len(times[True])
    med, mean = statistics.median, statistics.fmean
    return {"off_median": med(times[False]), "on_median": med(times[True]),
            "off_mean": mean(times[False]), "on_mean": mean(times[True]),
            "start": med(spent["start"]), "settle": med(spent["settle"]),
            "inside_mean": mean(a + b for a, b in zip(spent["start"], spent["settle"])),
            "steps": n}


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    res = run_distributed(worker, 2, name, rounds, steps, timeout_s=3600)
    print(f"model '{name}', 2 gloo ranks, FULL_SHARD, {res[0]['steps']} steps each way, "
          f"alternating rounds of {steps}")
    for rank, r in enumerate(res):
        d_med = (r["on_median"] - r["off_median"]) * 1e3
        d_mean = (r["on_mean"] - r["off_mean"]) * 1e3
        print(f"  rank {rank}: off {r['off_median'] * 1e3:.3f} ms median "
              f"({r['off_mean'] * 1e3:.3f} mean), on {r['on_median'] * 1e3:.3f} ms median "
              f"({r['on_mean'] * 1e3:.3f} mean): {d_med:+.3f} ms median "
              f"({d_med / (r['off_median'] * 1e3):+.1%}), {d_mean:+.3f} ms mean; "
              f"inside the check: start {r['start'] * 1e3:.3f} + settle "
              f"{r['settle'] * 1e3:.3f} ms/step median ({r['inside_mean'] * 1e3:.3f} mean)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
