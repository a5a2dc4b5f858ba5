"""The engine's own cost per unit: 96 tiny units, shardwise against torch FSDP2 (issue 43).

The model is `nn.Sequential` of 96 blocks, each `Linear(32, 32) + Tanh`, each block
`fully_shard`ed, then the root; SGD (lr 0.01); a batch of 4 rows per rank. The compute is
tiny, so a step's time is almost all the engine's host work (1 rank) plus one all-gather
forward, one in backward and one reduce-scatter per unit (2 ranks on gloo). The same script
runs shardwise, FSDP2 and the unsharded model, alternating the systems round by round in one
process group; every step starts at a barrier, and a system's step time is the median over
its steps of all rounds, the slowest rank's. Printed per world size:

    cost per unit = (step time - unsharded step time) / 96

and the ratio shardwise / FSDP2. `--profile` instead runs cProfile over steps at 1 rank and
prints, per step and per unit, the microseconds inside each hook (pre-forward, post-forward,
pre-backward, post-backward, the end-of-backward callback) and the optimizer step, for both
engines (cProfile's own overhead inflates every figure alike; read them as shares).

    python benchmarks/unit_cost.py [--worlds 1,2] [--rounds 4] [--steps 10]
    python benchmarks/unit_cost.py --profile [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from shardwise.testing import run_distributed

UNITS = 96
WIDTH = 32
BATCH = 4
# "shardwise": the default options (small units coalesced: [Note: coalesced units] in
# engine/core/schedule.py); "shardwise alone": coalesce_bytes=0, one collective per unit
# and kind, as FSDP2.
SYSTEMS = ("unsharded", "shardwise", "shardwise alone", "FSDP2")


def build(system: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                            for _ in range(UNITS)])
    if system.startswith("shardwise"):
        import shardwise as sw

        budget = 0 if system == "shardwise alone" else None
        for block in model:
            sw.fully_shard(block, coalesce_bytes=budget)
        sw.fully_shard(model, coalesce_bytes=budget)
    elif system == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _timer(rank: int, world: int, rounds: int, steps: int) -> dict[str, list[float]]:
    import shardwise as sw

    torch.set_num_threads(1)
    sw.init_distributed("gloo")
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    built = {s: build(s) for s in SYSTEMS}
    for s in SYSTEMS:
        step(*built[s], x)  # warm-up: lazy init, the recorded order
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        for s in SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[: r % len(SYSTEMS)]:
            model, opt = built[s]
            for _ in range(steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step(model, opt, x)
                times[s].append(time.perf_counter() - t0)
    return times


def measure(world: int, rounds: int, steps: int) -> dict[str, float]:
    per_rank = run_distributed(_timer, world, rounds, steps, timeout_s=900)
    # The slowest rank's median sets the pace.
    return {s: max(statistics.median(r[s]) for r in per_rank) for s in SYSTEMS}


# Where each engine's hooks live: (category, file suffix, function name).
HOOKS = {
    "shardwise": [
        ("pre-forward", "engine/core/hooks.py", "forward_pre_hook"),
        ("post-forward", "engine/core/hooks.py", "forward_post_hook"),
        ("pre-backward", "engine/core/hooks.py", "hook"),
        ("post-backward", "engine/core/hooks.py", "backward"),
        ("end of backward", "engine/core/context.py", "finish_backward"),
        ("optimizer step", "torch/optim/sgd.py", "step"),
    ],
    "FSDP2": [
        ("pre-forward", "_fully_shard/_fsdp_state.py", "_pre_forward"),
        ("post-forward", "_fully_shard/_fsdp_state.py", "_post_forward"),
        ("pre-backward", "_fully_shard/_fsdp_state.py", "_pre_backward"),
        ("post-backward", "_fully_shard/_fsdp_param_group.py", "backward"),
        ("end of backward", "_fully_shard/_fsdp_state.py", "_root_post_backward_final_callback"),
        ("optimizer step", "torch/optim/sgd.py", "step"),
    ],
}


def _profiler(rank: int, world: int, system: str, steps: int) -> dict[str, Any]:
    import cProfile
    import pstats

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init_distributed("gloo")
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    model, opt = build(system)
    for _ in range(3):
        step(model, opt, x)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x)
    plain = (time.perf_counter() - t0) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(model, opt, x)
    prof.disable()
    st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out: dict[str, Any] = {"step_us": plain * 1e6}
    if system == "unsharded":
        return out
    for cat, suffix, name in HOOKS[system]:
        ct = sum(v[3] for (f, _, fn), v in st.items() if f.endswith(suffix) and fn == name)
        calls = sum(v[1] for (f, _, fn), v in st.items() if f.endswith(suffix) and fn == name)
        out[cat] = (ct / steps * 1e6, calls / steps)
    # The heaviest functions by own time, to see what the categories are made of.
    own = sorted(((v[2] / steps * 1e6, f"{f.split('site-packages/')[-1].split('src/')[-1]}:"
                   f"{ln}({fn})", v[1] / steps) for (f, ln, fn), v in st.items()),
                 reverse=True)[:25]
    out["top"] = own
    out["total_us"] = sum(v[2] for v in st.values()) / steps * 1e6
    return out


def profile(steps: int) -> None:
    res = {s: run_distributed(_profiler, 1, s, steps, timeout_s=900)[0]
           for s in ("unsharded", "shardwise", "FSDP2")}
    base = res["unsharded"]["step_us"]
    print(f"\n1 rank, {UNITS} units, {steps} steps; unprofiled step: " + ", ".join(
        f"{s} {res[s]['step_us']:.0f} us" for s in res))
    print("  cost per unit unprofiled: " + ", ".join(
        f"{s} {(res[s]['step_us'] - base) / UNITS:.1f} us" for s in ("shardwise", "FSDP2")))
    print("\nunder cProfile, per step / per unit (us), calls per step:")
    print(f"{'':<18}{'shardwise':>22}{'FSDP2':>22}")
    for cat, _, _ in HOOKS["shardwise"]:
        a, b = res["shardwise"][cat], res["FSDP2"][cat]
        print(f"{cat:<18}{a[0]:>9.0f} /{a[0] / UNITS:>6.1f} ({a[1]:>3.0f})"
              f"{b[0]:>9.0f} /{b[0] / UNITS:>6.1f} ({b[1]:>3.0f})")
    for s in ("shardwise", "FSDP2"):
        print(f"\n{s}: own time per step, top functions (us, calls per step); "
              f"all Python under the profiler: {res[s]['total_us']:.0f} us")
        for us, where, calls in res[s]["top"]:
            print(f"  {us:8.0f}  {calls:6.0f}  {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.profile:
        profile(a.steps)
        return
    for world in (int(w) for w in a.worlds.split(",")):
        t = measure(world, a.rounds, a.steps)
        per = {s: (t[s] - t["unsharded"]) / UNITS for s in SYSTEMS[1:]}
        print(f"{world} rank(s), {UNITS} units, batch {BATCH}, {a.rounds} rounds x {a.steps} "
              f"steps: step ms " + ", ".join(f"{s} {t[s] * 1e3:.1f}" for s in SYSTEMS)
              + f" | unsharded per layer {t['unsharded'] / UNITS * 1e6:.0f} us | cost per "
              f"unit: shardwise {per['shardwise'] * 1e6:.0f} us, shardwise alone "
              f"{per['shardwise alone'] * 1e6:.0f} us, FSDP2 {per['FSDP2'] * 1e6:.0f} us | "
              f"shardwise / FSDP2 {per['shardwise'] / per['FSDP2']:.2f}, alone / FSDP2 "
              f"{per['shardwise alone'] / per['FSDP2']:.2f}", flush=True)


if __name__ == "__main__":
    main()
