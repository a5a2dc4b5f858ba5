"""Planned vs measured on this machine: `sw.plan`, calibrated, beside real sharded runs.

    .venv/bin/python benchmarks/plan_vs_measured.py [--rounds 3] [--steps N] [--memory]
        [--out benchmarks/results/plan-vs-measured.json]

Step time at 1, 2 and 3 gloo ranks, FULL_SHARD fp32, for `shardwise train`'s default model
(GPT 'small', 8 x 128 tokens per rank) and bench30m (2 x 128 tokens per rank). Each round
launches every configuration once, in turn: the ranks calibrate this machine together
(planner.calibrate, CPU clock), plan the step, then time `--steps` steps; a configuration's
figures are medians over its rounds of the per-round medians over steps. Measured is the
slowest rank's step, in CPU seconds (what the step costs the rank, whatever else runs) and
in wall seconds; predicted CPU seconds come from the calibrated rates, predicted wall
seconds from them by [Note: CPU time] (planner/profiles.py). The machine's load average and
the cores other tenants took during the timed steps stand beside each figure: a round they
took cores from says little about wall time ("clean": under 0.2 cores taken).

Each rank runs one intra-op thread (`--threads 1`, the default), so that its CPU time is its
work: a rank of two threads whose partner thread is descheduled spins, and CPU time then
grows with the other tenants' load. `--threads 0` sets them as `shardwise train` does
(cores // ranks: 2 at 1 rank), which only a quiet machine measures.

`--memory` adds the memory comparison at 2 ranks (bytes held after an optimizer step,
summed from the tensors, and peak RSS growth over three steps, against the plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests package

from shardwise.bench.runner import make_config  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.train.model import preset  # noqa: E402
from tests.dist.plan_workers import rss_case, states_case, step_time_case  # noqa: E402

WORLDS = (1, 2, 3)
CLEAN = 0.2  # cores other tenants may take while a round still counts as clean


def _gpt(cfg: object) -> dict:
    return {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head",
                                         "d_model")}


MODELS = {
    "small": (_gpt(preset("small")), 8, 128),  # shardwise train's default GPT and batch
    "bench30m": (_gpt(make_config("bench30m", 128)), 2, 128),
}
# Steps timed per round: the small model's step varies by +-20% from one step to the next
# at 2 ranks (how its ranks meet at each exchange), bench30m's by ~2%.
STEPS = {"small": 20, "bench30m": 5}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory() -> None:
    cfg, batch, seq = MODELS["small"]
    held = run_distributed(states_case, 2, cfg, [("FULL_SHARD", None)], 2)[0][0]
    r = run_distributed(rss_case, 2, cfg, batch, seq, 3)[0]
    print("\nGPT 'small', FULL_SHARD, fp32, 2 ranks (rank 0): bytes")
    print(f"| {'quantity':<34} | {'planned':>12} | {'measured':>12} | ratio |")
    print(f"|{'-' * 36}|{'-' * 14}|{'-' * 14}|-------|")
    for t in ("params", "grads", "optimizer"):
        p, m = held["planned"][t], held["held"][t]
        print(f"| {t + ' (bytes)':<34} | {_mib(p):>12} | {_mib(m):>12} | {m / p:5.2f} |")
    p, m = r["planned_total"], r["rss_growth"]
    print(f"| {'peak RSS growth vs planned total':<34} | {_mib(p):>12} | {_mib(m):>12} "
          f"| {m / p:5.2f} |")


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: medians over its rounds (the clean ones, where there are any)."""
    out = []
    for name in MODELS:
        for world in WORLDS:
            mine = [r for r in rows if r["model"] == name and r["world"] == world]
            if not mine:
                continue
            clean = [r for r in mine if r["others_cores"] < CLEAN]
            use = clean or mine

            def med(key: str, use: list[dict] = use) -> float:
                return statistics.median(r[key] for r in use)

            out.append({
                "model": name, "ranks": world, "threads": mine[0]["threads"],
                "rounds": len(mine), "clean_rounds": len(clean),
                "predicted_cpu_s": med("predicted_cpu_s"), "cpu_s": med("cpu_s"),
                "cpu_ratio": statistics.median(r["cpu_s"] / r["predicted_cpu_s"] for r in use),
                "predicted_s": med("predicted_s"), "wall_s": med("wall_s"),
                "wall_ratio": statistics.median(r["wall_s"] / r["predicted_s"] for r in use),
                "load": [min(r["load"] for r in mine), max(r["load"] for r in mine)],
                "others_cores": [min(r["others_cores"] for r in mine),
                                 max(r["others_cores"] for r in mine)],
                "parts_cpu_s": {k: statistics.median(r["parts_cpu_s"][k] for r in use)
                                for k in use[0]["parts_cpu_s"]},
            })
    return out


def print_table(summary: list[dict]) -> None:
    print("\nStep time, FULL_SHARD fp32: predicted (sw.plan, calibrated) vs measured "
          "(slowest rank, median)")
    print("| model | ranks x threads | CPU predicted | CPU measured | ratio | wall predicted "
          "| wall measured | ratio | clean rounds | load avg | others' cores |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for s in summary:
        print(f"| {s['model']} | {s['ranks']} x {s['threads']} "
              f"| {s['predicted_cpu_s']:.3f} s | {s['cpu_s']:.3f} s | {s['cpu_ratio']:.2f} "
              f"| {s['predicted_s']:.3f} s | {s['wall_s']:.3f} s | {s['wall_ratio']:.2f} "
              f"| {s['clean_rounds']}/{s['rounds']} "
              f"| {s['load'][0]:.1f}-{s['load'][1]:.1f} "
              f"| {s['others_cores'][0]:.2f}-{s['others_cores'][1]:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, help="steps timed per round (default: per model)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank (0: cores // ranks, as shardwise train)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated")
    ap.add_argument("--out", type=Path, help="write every round's figures here (JSON)")
    ap.add_argument("--memory", action="store_true", help="also compare bytes and RSS")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for name in models:
            cfg, batch, seq = MODELS[name]
            for world in worlds:
                r = run_distributed(step_time_case, world, cfg, batch, seq,
                                    args.steps or STEPS[name], args.threads, timeout_s=900)[0]
                rows.append({"model": name, "round": rnd, **r})
                print(f"round {rnd} {name} x{world}: predicted {r['predicted_s']:.3f} s "
                      f"(CPU {r['predicted_cpu_s']:.3f}), measured wall {r['wall_s']:.3f} s, "
                      f"CPU {r['cpu_s']:.3f} s; load {r['load']:.1f}, others "
                      f"{r['others_cores']:.2f} cores", flush=True)
    summary = summarize(rows)
    print_table(summary)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rounds": rows}, indent=1))
    if args.memory:
        memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
