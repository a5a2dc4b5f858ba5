"""Planned vs measured on this machine: `sw.plan` beside real sharded runs (2 gloo ranks).

    .venv/bin/python benchmarks/plan_vs_measured.py

For `shardwise train`'s default model (GPT 'small', 8 x 128 tokens per rank, FULL_SHARD,
fp32) and a larger GPT whose memory dwarfs the process's own noise: bytes held after an
optimizer step (summed from the tensors), peak RSS growth over three steps, and step time
against a plan calibrated right before each step (medians; CPU time beside wall time, since
a shared machine's wall clock mostly measures its other tenants). The step-time ratio
was a timed test (within 30%) until it moved here: a benchmark prints, a test must not
depend on a machine's load.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests package

from shardwise.testing import run_distributed  # noqa: E402
from shardwise.train.model import preset  # noqa: E402
from tests.dist.plan_workers import rss_and_time_case, states_case  # noqa: E402

SMALL = preset("small")
MODELS = {
    "GPT 'small' (shardwise train default), 8 x 128 tokens": (
        dict(vocab_size=SMALL.vocab_size, block_size=SMALL.block_size, n_layer=SMALL.n_layer,
             n_head=SMALL.n_head, d_model=SMALL.d_model), 8, 128),
    "GPT 4 x 512 (12.8M params), 4 x 128 tokens": (
        dict(vocab_size=256, block_size=128, n_layer=4, n_head=8, d_model=512), 4, 128),
}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> int:
    for title, (cfg, batch, seq) in MODELS.items():
        held = run_distributed(states_case, 2, cfg, [("FULL_SHARD", None)], 2)[0][0]
        r = run_distributed(rss_and_time_case, 2, cfg, batch, seq, 3)[0]
        rounds = r["rounds"]
        cpu = statistics.median(x["measured_s"] for x in rounds)
        wall = statistics.median(x["wall_s"] for x in rounds)
        pred = statistics.median(x["predicted_s"] for x in rounds)
        rows = [(f"{t} (bytes)", _mib(held["planned"][t]), _mib(held["held"][t]),
                 held["held"][t] / held["planned"][t]) for t in ("params", "grads", "optimizer")]
        rows.append(("peak RSS growth vs planned total", _mib(r["planned_total"]),
                     _mib(r["rss_growth"]), r["rss_growth"] / r["planned_total"]))
        rows.append(("step time, CPU clock", f"{pred:.3f} s", f"{cpu:.3f} s", r["time_ratio"]))
        rows.append(("step time, wall clock", f"{pred:.3f} s", f"{wall:.3f} s", wall / pred))
        print(f"\n{title}, FULL_SHARD, fp32, 2 ranks (rank 0)")
        print(f"| {'quantity':<34} | {'planned':>12} | {'measured':>12} | ratio |")
        print(f"|{'-' * 36}|{'-' * 14}|{'-' * 14}|-------|")
        for name, p, m, ratio in rows:
            print(f"| {name:<34} | {p:>12} | {m:>12} | {ratio:5.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
