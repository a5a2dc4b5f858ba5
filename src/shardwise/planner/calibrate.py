"""Measure this machine, so a plan can predict a local run: FLOP/s, memory bandwidth and
collective bandwidth, with every rank busy at once (the ranks share the cores, so a lone
measurement would flatter them).

`calibrate(nproc)` starts `nproc` local ranks with PyTorch's elastic launcher
(shardwise.launch) and returns a `Calibration`; inside an existing process group, every rank
calls `calibrate_in_group()` instead. `Calibration.device()` / `.interconnect()` are profiles
`plan(device=..., interconnect=...)` accepts.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.comm import collectives as C
from .measure import (
    CLOCKS,
    MIN_SAMPLE_S,
    _median_seconds,
    block_elementwise_bandwidth,
    clock_of,
    measure_attention_efficiency,
    measure_block_seconds,
    measure_elementwise_bandwidth,
    measure_matmul_flops,
    measure_memory_bandwidth,
    measure_optimizer,
)
from .profiles import DeviceProfile, InterconnectProfile, cpu_device, cpu_seconds_scale
from .shape import TransformerShape

__all__ = ["CLOCKS", "Calibration", "_median_seconds", "calibrate", "calibrate_in_group",
           "clock_of", "measure_attention_efficiency", "measure_block_seconds",
           "measure_collectives", "measure_elementwise_bandwidth", "measure_matmul_flops",
           "measure_memory_bandwidth", "measure_optimizer", "measure_unit_overhead"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _one_collective(kind: str, nbytes: int, world: int, group: object | None) -> Callable:
    n = max(1, nbytes // 4 // world)  # elements per rank's chunk
    if kind == "all_gather":
        send, out = torch.ones(n), torch.empty(n * world)
        return lambda: C.all_gather(out, send, group, False)
    if kind == "reduce_scatter":
        full, out = torch.ones(n * world), torch.empty(n)
        return lambda: C.reduce_scatter_sum(out, full, group, False)
    buf = torch.ones(n * world)
    return lambda: C.all_reduce(buf, group)


def _collective_seconds(fn: Callable[[], object], repeats: int, clock: str,
                        group: object | None, min_s: float) -> tuple[float, float]:
    """As `_median_seconds` for a collective, on `clock` and on the wall clock at once:
    every rank makes the same number of calls (the most any rank needs for `min_s` per
    sample), or they would not pair up."""
    now = clock_of(clock)
    C.barrier(group)
    t0 = now()
    fn()
    one = now() - t0
    calls = torch.tensor([max(1, int(min_s / max(one, 1e-6) + 0.999)) if min_s > 0 else 1])
    C.all_reduce(calls, group, op="max")
    n = int(calls.item())
    times, walls = [], []
    for _ in range(repeats):
        t0, w0 = now(), time.perf_counter()
        for _ in range(n):
            fn()
        times.append((now() - t0) / n)
        walls.append((time.perf_counter() - w0) / n)
    return max(statistics.median(times), 1e-9), max(statistics.median(walls), 1e-9)


def _fit(sizes: tuple[int, int], t: list[float], factor: int,
         world: int) -> tuple[float, float]:
    """(bytes/s, latency per ring step) through two (size, seconds) points; where the sizes
    cannot be told apart (equal, or the larger no slower), the larger one's rate alone."""
    sent = [factor * (world - 1) * s / world for s in sizes]
    if sent[1] > 1.5 * sent[0] and t[1] > t[0]:
        bw = (sent[1] - sent[0]) / (t[1] - t[0])
        return bw, max(t[0] - sent[0] / bw, 0.0) / (factor * (world - 1))
    return sent[1] / t[1], 0.0


def measure_collectives(sizes: tuple[int, int] = (64 * 2**10, 16 * 2**20), repeats: int = 5,
                        group: object | None = None, clock: str = "wall",
                        min_s: float = 0.0) -> tuple[dict[str, float], float]:
    """({kind: bytes/s per rank}, latency per ring step), fitted over two buffer sizes
    (whole buffers in bytes: best the model's smallest and largest unit).

    Bandwidth counts what each rank sends, as the time model does: (g-1)/g of the buffer for
    all-gather and reduce-scatter, twice that for all-reduce. Every rank reports the slowest
    rank's median, so all ranks agree.
    """
    fits = _measure_collectives(sizes, repeats, group, clock, min_s)
    return fits[0]


def _measure_collectives(sizes: tuple[int, int], repeats: int, group: object | None,
                         clock: str, min_s: float
                         ) -> tuple[tuple[dict[str, float], float], tuple[dict[str, float], float]]:
    """measure_collectives' figures on `clock` and on the wall clock, from the same runs."""
    world = C.world_size(group)
    if world < 2:
        raise ValueError("measure_collectives needs a process group of at least 2 ranks")
    small, large = sorted(sizes)
    out: list[tuple[dict[str, float], list[float]]] = [({}, []), ({}, [])]
    for kind in KINDS:
        factor = 2 if kind == "all_reduce" else 1
        both = [_collective_seconds(_one_collective(kind, size, world, group), repeats,
                                    clock, group, min_s) for size in (small, large)]
        t = _slowest([x for pair in both for x in pair], group)
        for which, (bw, lat) in enumerate(out):
            bw[kind], latency = _fit((small, large), t[which::2], factor, world)
            lat.append(latency)
    return tuple((bw, statistics.median(lat)) for bw, lat in out)  # type: ignore[return-value]


class _TinyUnit(nn.Module):
    """A unit of `params` small parameters (8 x 8 linears and their biases)."""

    def __init__(self, params: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(max(1, params // 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def measure_unit_overhead(units: int = 5, params: int = 6, repeats: int = 5,
                          clock: str = "wall", min_s: float = 0.0) -> float:
    """Seconds the engine itself adds to a training step, per unit: hooks, the schedule,
    issuing and finishing each gather and reduction (the fixed cost of their collectives
    included), the optimizer step's hooks. A model of `units` units (the root included) of
    `params` tiny parameters each (best the model's own counts), sharded over the whole world,
    against the same model unsharded: the work is next to nothing, so the difference is the
    engine's. Every rank calls this at the same time."""
    from ..engine.api.fully_shard import fully_shard

    torch.manual_seed(0)
    # The root holds parameters of its own, as a model's root does (embedding, head).
    plain = nn.Sequential(*[_TinyUnit(params) for _ in range(max(units, 2))])
    sharded = copy.deepcopy(plain)
    for m in list(sharded)[1:]:
        fully_shard(m)
    fully_shard(sharded)
    x = torch.randn(4, 8)

    def stepper(model: nn.Module) -> Callable[[], None]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    base = _median_seconds(stepper(plain), repeats, clock, warmup=2, min_s=min_s)
    step = stepper(sharded)
    step()  # the first step records the order
    engine = _collective_seconds(step, repeats, clock, None, min_s)[0]
    return max(engine - base, 0.0) / max(units, 2)


# The engine's cost per unit is a small difference of two step times, and at 2 ranks it
# varies by 2x from one sample to the next (how the ranks' threads meet): longer samples,
# more of them.
OVERHEAD_SAMPLE_S = 0.2
OVERHEAD_REPEATS = 7


def _slowest(values: list[float], group: object | None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    C.all_reduce(t, group, op="max")
    return t.tolist()


@dataclass(frozen=True)
class Calibration:
    """What one rank of this machine achieves while `world_size` ranks run at once."""

    world_size: int
    threads: int  # torch threads per rank during the measurement
    flops: dict[str, float]  # matmul FLOP/s per rank by dtype name
    memory_bandwidth: float  # bytes/s per rank
    attention_efficiency: float  # fused causal attention vs the matmul rate
    elementwise_bandwidth: float  # see measure_elementwise_bandwidth
    collective_bandwidth: dict[str, float] = field(default_factory=dict)  # bytes/s per rank
    latency_s: float = 0.0
    memory_bytes: int = 0
    clock: str = "wall"  # what the seconds above measured (see CLOCKS)
    # torch's AdamW: bytes/s per pass over a state array, and seconds per parameter tensor
    # (measure_optimizer; 0: not measured, the memory bandwidth stands in).
    optimizer_bandwidth: float = 0.0
    optimizer_tensor_s: float = 0.0
    cores: int = 0  # cores this rank may run on (0: unknown)
    # The engine's own seconds per unit per step (measure_unit_overhead; 0: not measured).
    # With it, latency_s is 0: a collective's fixed cost is part of it.
    unit_overhead_s: float = 0.0
    # The collectives on the wall clock, from the same runs (clock "cpu": they take longer
    # than the CPU they use, waiting on the peer and the kernel).
    wall_collective_bandwidth: dict[str, float] = field(default_factory=dict)
    wall_latency_s: float = 0.0

    @staticmethod
    def median(cals: list[Calibration]) -> Calibration:
        """Field-wise median of several calibrations (taken between timed steps, say)."""
        if not cals:
            raise ValueError("Calibration.median needs at least one calibration")

        def med(get: Callable[[Calibration], float]) -> float:
            return statistics.median(get(c) for c in cals)

        first = cals[0]
        return Calibration(
            first.world_size, first.threads,
            {k: med(lambda c, k=k: c.flops[k]) for k in first.flops},
            med(lambda c: c.memory_bandwidth), med(lambda c: c.attention_efficiency),
            med(lambda c: c.elementwise_bandwidth),
            {k: med(lambda c, k=k: c.collective_bandwidth[k])
             for k in first.collective_bandwidth},
            med(lambda c: c.latency_s), first.memory_bytes, first.clock,
            med(lambda c: c.optimizer_bandwidth), med(lambda c: c.optimizer_tensor_s),
            first.cores, med(lambda c: c.unit_overhead_s),
            {k: med(lambda c, k=k: c.wall_collective_bandwidth[k])
             for k in first.wall_collective_bandwidth},
            med(lambda c: c.wall_latency_s))

    @property
    def seconds_scale(self) -> float:
        """Wall seconds per second of these rates ([Note: CPU time] in profiles.py)."""
        if self.clock != "cpu":
            return 1.0
        return cpu_seconds_scale(self.world_size, self.threads, self.cores)

    def device(self) -> DeviceProfile:
        """This CPU as a device: the measured rates count as its achievable peak."""
        return cpu_device(self.memory_bytes, self.flops["fp32"], self.memory_bandwidth,
                          ranks_per_node=self.world_size, name="local-cpu",
                          attention_efficiency=self.attention_efficiency,
                          elementwise_bandwidth=self.elementwise_bandwidth,
                          optimizer_bandwidth=self.optimizer_bandwidth or None,
                          optimizer_tensor_s=self.optimizer_tensor_s,
                          unit_overhead_s=self.unit_overhead_s,
                          seconds_scale=self.seconds_scale)

    def interconnect(self) -> InterconnectProfile:
        bw = self.collective_bandwidth
        wall = ({"measured": dict(self.wall_collective_bandwidth),
                 "wall_latency_s": self.wall_latency_s}
                if self.clock == "cpu" and self.wall_collective_bandwidth else {})
        return InterconnectProfile("local-gloo", bandwidth=min(bw.values()) if bw else 1e9,
                                   latency_s=self.latency_s, measured=dict(bw),
                                   wall_measured=wall.get("measured", {}),
                                   wall_latency_s=wall.get("wall_latency_s", 0.0))

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size, "threads": self.threads, "flops": self.flops,
            "memory_bandwidth": self.memory_bandwidth,
            "attention_efficiency": self.attention_efficiency,
            "elementwise_bandwidth": self.elementwise_bandwidth,
            "collective_bandwidth": self.collective_bandwidth, "latency_s": self.latency_s,
            "memory_bytes": self.memory_bytes, "clock": self.clock,
            "optimizer_bandwidth": self.optimizer_bandwidth,
            "optimizer_tensor_s": self.optimizer_tensor_s, "cores": self.cores,
            "unit_overhead_s": self.unit_overhead_s,
            "wall_collective_bandwidth": self.wall_collective_bandwidth,
            "wall_latency_s": self.wall_latency_s,
        }


def calibrate_in_group(matmul: tuple[int, int, int] = (1024, 1024, 1024),
                       attention: tuple[int, int, int, int] = (4, 8, 128, 64), repeats: int = 5,
                       group: object | None = None, clock: str = "wall",
                       block: TransformerShape | None = None,
                       optimizer: tuple[int, int] = (2**22, 32),
                       collective_sizes: tuple[int, int] = (64 * 2**10, 16 * 2**20),
                       units: tuple[int, int] | None = None) -> Calibration:
    """Every rank of the current process group calls this at the same time.

    matmul: (tokens, d_in, d_out) of the model's typical linear layer.
    attention: (batch, heads, seq, head_dim) of its attention.
    clock: "wall" (default) or "cpu" (see CLOCKS: for comparisons on a shared machine).
    block: the model's shape: its blocks, timed whole as a stack on attention's (batch,
      seq), set the elementwise rate (`block_elementwise_bandwidth`) instead of GELU alone.
    optimizer: (elements, tensors) AdamW is timed on: best one rank's local parameters.
    collective_sizes: two whole-buffer sizes in bytes the collectives are timed at (best
      the model's smallest and largest unit: `measure_collectives`).
    units: (units, parameters per unit) of the model: measures the engine's own cost per
      unit (`measure_unit_overhead`; only over the whole world, `group` None).
    """
    world = C.world_size(group)
    C.barrier(group)
    kw = dict(repeats=repeats, clock=clock, min_s=MIN_SAMPLE_S)
    flops = measure_matmul_flops(*matmul, **kw)  # type: ignore[arg-type]
    att = measure_attention_efficiency(*attention, matmul_flops=flops, **kw)  # type: ignore[arg-type]
    if block is not None:
        batch, seq = attention[0], attention[2]
        block_s = measure_block_seconds(block, batch, seq, layers=block.n_layers,
                                        **kw)  # type: ignore[arg-type]
        ew = block_elementwise_bandwidth(block, batch, seq, block_s, flops, att)
    else:
        ew = measure_elementwise_bandwidth(matmul[0] * matmul[2], **kw)  # type: ignore[arg-type]
    mem_bw = measure_memory_bandwidth(**kw)  # type: ignore[arg-type]
    opt_bw, opt_tensor = measure_optimizer(*optimizer, **kw)  # type: ignore[arg-type]
    # The slowest rank sets the pace of a synchronous step.
    inv = _slowest([1 / flops, 1 / mem_bw, 1 / att, 1 / ew, 1 / opt_bw, opt_tensor], group)
    (coll, latency), (wall_coll, wall_latency) = (
        _measure_collectives(collective_sizes, repeats, group, clock, MIN_SAMPLE_S)
        if world > 1 else (({}, 0.0), ({}, 0.0)))
    overhead = 0.0
    if units is not None and group is None:
        overhead = _slowest([measure_unit_overhead(*units, repeats=OVERHEAD_REPEATS,
                                                   clock=clock, min_s=OVERHEAD_SAMPLE_S)],
                            group)[0]
        latency = 0.0  # a tiny unit's collectives are all fixed cost: counted in `overhead`
    return Calibration(world, torch.get_num_threads(), {"fp32": 1 / inv[0]}, 1 / inv[1],
                       1 / inv[2], 1 / inv[3], coll, latency, cpu_device().memory_bytes,
                       clock, 1 / inv[4], inv[5], _cores(), overhead, wall_coll, wall_latency)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def _worker(matmul: tuple[int, int, int], attention: tuple[int, int, int, int],
            repeats: int) -> dict:
    from ..engine.comm.process_group import init_distributed

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, _cores() // local))  # as `shardwise train` does
    init_distributed("gloo")
    try:
        result = calibrate_in_group(matmul, attention, repeats).to_dict()
    except BaseException:
        C.destroy_process_group()
        raise
    C.finish()
    return result


def calibrate(nproc: int = 2, matmul: tuple[int, int, int] = (1024, 1024, 1024),
              attention: tuple[int, int, int, int] = (4, 8, 128, 64),
              repeats: int = 5) -> Calibration:
    """Measure this machine with `nproc` local ranks (gloo), started by torch's launcher."""
    from ..launch import launch

    if not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"nproc={nproc!r} must be an int >= 2 (collectives need 2 ranks)")
    d = launch(_worker, nproc, matmul, attention, repeats)[0]
    return Calibration(**d)
