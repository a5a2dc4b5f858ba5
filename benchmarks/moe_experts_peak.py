"""Per-expert units with skewed routing: peak memory and step time, one at a time vs all
together ([Note: data-dependent units] in engine/core/context.py, docs/moe.md).

    PYTHONPATH=src .venv/bin/python benchmarks/moe_experts_peak.py [--world 2] [--experts 8]
        [--hidden 512] [--mlp 2048] [--layers 2] [--steps 6]

A model of `--layers` MoE layers (a router and `--experts` expert MLPs in an nn.ModuleList,
routed by token id so that every rank sends no token to some expert at every layer and step),
trained a few AdamW steps on CPU (gloo), each configuration in fresh ranks:

- one at a time: `fully_shard` on each expert, each layer, the root (this engine's groups:
  a skipped expert gathers and releases at its place in container order);
- all together: the layer as one unit, which gathers every expert of the layer at the
  layer's call and keeps their gradients until the layer's reduction: the bytes a scheme
  gathering the whole group at the holder's call would hold, with one collective per layer
  instead of one per expert.

Per rank (max over ranks): the most bytes of gathered parameters alive at once (counted at
every gather and reshard), the peak RSS over the steps (VmHWM, reset after the first step),
and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from shardwise.testing import run_distributed

MB = 2**20


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Layer(nn.Module):
    def __init__(self, d: int, f: int, e: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(e))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), -1)
        out = torch.zeros_like(h)
        for e, ex in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, ex(h[idx]) * probs[idx, e:e + 1])
        return h + out


class Net(nn.Module):
    def __init__(self, d: int, f: int, e: int, n: int) -> None:
        super().__init__()
        self.e = e
        self.embed = nn.Embedding(64, d)
        self.layers = nn.ModuleList(Layer(d, f, e) for _ in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, (ids + i) % self.e)
        return h.square().mean()


def _run(rank: int, world: int, layout: str, d: int, f: int, e: int, n: int,
         steps: int) -> dict[str, Any]:
    import shardwise as sw
    from shardwise.engine.core.schedule import ShardedState
    from shardwise.engine.core.unit import Unit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(d, f, e, n)
    for layer in model.layers:
        if layout == "one at a time":
            for ex in layer.experts:
                sw.fully_shard(ex)
        sw.fully_shard(layer)
    sw.fully_shard(model)
    units: list[Unit] = []
    live = {"now": 0, "peak": 0}

    def count(u: Unit) -> None:
        live["now"] = sum(sum(p.unsharded.numel() * p.unsharded.element_size()
                              for p in x.params)
                          for x in units if x.state is ShardedState.UNSHARDED and not x.is_root)
        live["peak"] = max(live["peak"], live["now"])

    wait, reshard = Unit.wait_unshard, Unit.reshard

    def wait_and_count(self: Unit) -> None:
        wait(self)
        count(self)

    def count_and_reshard(self: Unit) -> None:
        count(self)
        reshard(self)

    Unit.wait_unshard, Unit.reshard = wait_and_count, count_and_reshard  # type: ignore[method-assign]
    from shardwise.engine.core.context import units_of
    units.extend(units_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Rank r sends no token to expert r (mod e) at any layer: ids avoid that residue.
    allowed = torch.tensor([t for t in range(64) if (t % e) != rank % e])
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        ids = allowed[torch.randint(0, len(allowed), (32,), generator=g)]
        t0 = time.perf_counter()
        model(ids).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step == 0:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # VmHWM := VmRSS: the later steps' peak from here
    Unit.wait_unshard, Unit.reshard = wait, reshard  # type: ignore[method-assign]
    return {"gathered": live["peak"] / MB, "rss": _status("VmHWM"),
            "time": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    expert_mb = 2 * a.hidden * a.mlp * 4 / MB
    print(f"{a.layers} MoE layers x {a.experts} experts of {expert_mb:.1f} MiB (fp32), "
          f"{a.world} ranks, gloo on CPU; per rank, max over ranks")
    print(f"{'':16}{'gathered peak MiB':>19}{'peak RSS MiB':>14}{'step s':>9}")
    for layout in ("one at a time", "all together"):
        res = run_distributed(_run, a.world, layout, a.hidden, a.mlp, a.experts, a.layers,
                              a.steps, timeout_s=1200, collective_timeout_s=600)
        print(f"{layout:16}{max(r['gathered'] for r in res):19.1f}"
              f"{max(r['rss'] for r in res):14.1f}{max(r['time'] for r in res):9.3f}")


if __name__ == "__main__":
    main()
