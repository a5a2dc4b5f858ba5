"""Peak memory per rank with the optimizer stepped in backward, against the default step
after backward, for shardwise and torch FSDP2 running the same recipe (issue 43 part 3).

The model is `shardwise bench`'s bench30m (GPT, 10 layers, d=512: 31.7M parameters), one
unit per block and the root, fp32 AdamW (fused), 2 x 128 tokens per rank, 2 ranks on gloo.
"default" steps one whole-model AdamW after backward; "in backward" is PyTorch's recipe:
one AdamW per parameter, stepped from the parameter's post-accumulate-grad hook (both
engines run it on the sharded parameter once its reduced gradient is written), the gradient
set to None at once. `shardwise train --train.optim_in_backward` runs the same recipe.

Each system runs alone in fresh processes, every system once per round, rounds alternating
the order. The high-water mark of RSS (VmHWM) is reset once the model is built and sharded
(the unsharded model built first is freed by then) and read after the steps, with glibc's
mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_`) so freed tensors go back to the
system and the peak follows the live tensors rather than the allocator's reuse. Printed, MiB
per rank: the peak RSS during training; its growth over the RSS before the first step (the
gradients, AdamW's state, activations and the step's transients); the RSS over that base
right after backward (the default holds every sharded gradient there, the recipe none); and
the ratios side by side. Two shapes: the bench's 2 x 128 tokens, where the forward's
activations (about 127 MiB) set the peak, and 1 x 32, where the model state does.

    python benchmarks/optim_in_backward.py [--rounds 2] [--steps 3] [--world 2] \
        [--shapes 2x128,1x32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

import torch  # noqa: E402

from shardwise.testing import run_distributed  # noqa: E402

SYSTEMS = ("shardwise default", "shardwise in backward", "FSDP2 default", "FSDP2 in backward")
MB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _shard(model: torch.nn.Module, engine: str) -> None:
    from shardwise.train.model import Block

    if engine == "shardwise":
        import shardwise as sw

        sw.shard_model(model, auto_wrap_policy="transformer")
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for m in list(model.modules()):
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _worker(rank: int, world: int, system: str, steps: int, batch: int,
            seq: int) -> dict[str, float]:
    import gc

    from shardwise.bench.runner import make_config
    from shardwise.train.model import GPT

    torch.set_num_threads(1)
    import shardwise as sw

    sw.init_distributed("gloo")
    cfg = make_config("bench30m", 128)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, mode = system.split(" ", 1)
    _shard(model, engine.lower() if engine == "shardwise" else "fsdp2")
    params = list(model.parameters())
    if mode == "in backward":
        opts = {p: torch.optim.AdamW([p], lr=1e-4, fused=True) for p in params}

        def step(p: torch.Tensor) -> None:
            opts[p].step()
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(step)
        opt = None
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    # Built and sharded (the full model built first is gone): the high-water mark from here.
    gc.collect()
    torch.distributed.barrier()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    losses = []
    after_backward = 0
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        # Where the recipe differs: every gradient exists here in the default, none in it.
        after_backward = max(after_backward, _status("VmRSS") - base)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    peak = _status("VmHWM")
    return {"peak": peak / MB, "growth": (peak - base) / MB, "after_bw": after_backward / MB,
            "loss": losses[-1]}


KEYS = ("peak", "growth", "after_bw")


def measure(world: int, rounds: int, steps: int, batch: int, seq: int
            ) -> dict[str, dict[str, float]]:
    got: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[: r % len(SYSTEMS)]
        for s in order:
            per_rank = run_distributed(_worker, world, s, steps, batch, seq, timeout_s=600)
            # The rank with the highest peak sets what a machine must hold.
            got[s].append(max(per_rank, key=lambda d: d["peak"]))
            d = got[s][-1]
            print(f"{batch} x {seq}, round {r + 1}: {s:<22} peak {d['peak']:7.1f} MiB, growth "
                  f"{d['growth']:6.1f}, after backward {d['after_bw']:6.1f}", file=sys.stderr)
    return {s: {k: statistics.median(d[k] for d in got[s]) for k in KEYS} for s in SYSTEMS}


def report(med: dict[str, dict[str, float]], world: int, rounds: int, steps: int, batch: int,
           seq: int) -> None:
    print(f"\nbench30m, {world} ranks, fp32 AdamW, {batch} x {seq} tokens per rank, {rounds} "
          f"rounds x {steps} steps (median of rounds; each the higher rank's)")
    print(f"{'system':<24}{'peak RSS':>10}{'growth':>9}{'after bw':>10}"
          f"{'growth / sw default':>21}{'growth / FSDP2 same':>21}")
    for s in SYSTEMS:
        same = "FSDP2 " + s.split(" ", 1)[1]
        m = med[s]
        print(f"{s:<24}{m['peak']:>10.1f}{m['growth']:>9.1f}{m['after_bw']:>10.1f}"
              f"{m['growth'] / med['shardwise default']['growth']:>21.2f}"
              f"{m['growth'] / med[same]['growth']:>21.2f}")
    pairs = (("shardwise in backward", "shardwise default"),
             ("shardwise in backward", "FSDP2 in backward"),
             ("FSDP2 in backward", "FSDP2 default"))
    for a, b in pairs:
        print(f"{a} / {b}: " + ", ".join(
            f"{k} {med[a][k] / med[b][k]:.2f}" for k in KEYS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shapes", default="2x128,1x32",
                    help="batch x sequence per rank, comma-separated (2x128: the bench's)")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in t.split("x")) for t in a.shapes.split(",")]
    results = [(b, t, measure(a.world, a.rounds, a.steps, b, t)) for b, t in shapes]
    for b, t, med in results:
        report(med, a.world, a.rounds, a.steps, b, t)


if __name__ == "__main__":
    main()
