"""What the engine's checks cost per step, after issue 35 moved the collective ones to debug mode.

    .venv/bin/python benchmarks/step_checks.py [model] [rounds] [steps]

2 gloo ranks train a small model ('mlp': 4 blocks of Linear(64, 64) + Tanh in an
nn.Sequential, each its own unit, batch 8; or a GPT preset of `shardwise train` such as
'small', 8 x 128 tokens per rank), FULL_SHARD, AdamW. Default path and SHARDWISE_DEBUG
(`sw.set_debug`: every collective fingerprinted, the freeze check's all-reduce at every
backward) take turns every `steps` steps in the same processes, so a change of the machine's
load falls on both alike.

Prints the median and mean step time each way, and the host time the default path still
spends in checks per step: the container check ([Note: data-dependent units] in
engine/core/context.py: a counter per unit call inside a holder, a set comparison when the
holder returns). The GPT's blocks sit in an nn.ModuleList under the root, so its root is a
holder; the mlp has none. No check of the default path is a collective.
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
from shardwise.engine.core.context import ContainerCheck  # noqa: E402
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
    inside = [0.0]

    def timed(fn):  # host time spent inside the container check's own calls
        def call(*args: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - t0
        return call

    for attr in ("called", "_holder_starts", "_holder_ends"):
        setattr(ContainerCheck, attr, timed(getattr(ContainerCheck, attr)))
    times: dict[bool, list[float]] = {False: [], True: []}
    spent: list[float] = []
    for r in range(rounds * 2 + 1):
        debug = r % 2 == 1
        sw.set_debug(debug)  # every rank alike: debug mode adds collectives
        for _ in range(steps):
            inside[0] = 0.0
            t0 = time.perf_counter()
            loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad()
            if r > 0:  # round 0 warms up (the first step checks the layout, records order)
                times[debug].append(time.perf_counter() - t0)
                if not debug:
                    spent.append(inside[0])
    sw.set_debug(False)
    med, mean = statistics.median, statistics.fmean
    return {"default_median": med(times[False]), "debug_median": med(times[True]),
            "default_mean": mean(times[False]), "debug_mean": mean(times[True]),
            "check_median": med(spent), "check_mean": mean(spent), "steps": len(spent)}


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    res = run_distributed(worker, 2, name, rounds, steps, timeout_s=3600)
    print(f"model '{name}', 2 gloo ranks, FULL_SHARD, {res[0]['steps']} steps each way, "
          f"alternating rounds of {steps}")
    for rank, r in enumerate(res):
        d = (r["debug_median"] - r["default_median"]) * 1e3
        print(f"  rank {rank}: default {r['default_median'] * 1e3:.3f} ms median "
              f"({r['default_mean'] * 1e3:.3f} mean), SHARDWISE_DEBUG "
              f"{r['debug_median'] * 1e3:.3f} ms median ({r['debug_mean'] * 1e3:.3f} mean): "
              f"debug adds {d:+.3f} ms; the default path's container check "
              f"{r['check_median'] * 1e6:.1f} us/step median ({r['check_mean'] * 1e6:.1f} mean)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
