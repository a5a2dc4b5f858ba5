"""Measure this machine, so a plan can predict a local run: FLOP/s, memory bandwidth and
collective bandwidth, with every rank busy at once (the ranks share the cores, so a lone
measurement would flatter them).

`calibrate(nproc)` starts `nproc` local ranks with PyTorch's elastic launcher
(shardwise.launch) and returns a `Calibration`; inside an existing process group, every rank
calls `calibrate_in_group()` instead. `Calibration.device()` / `.interconnect()` are profiles
`plan(device=..., interconnect=...)` accepts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine.comm import collectives as C
from .profiles import DeviceProfile, InterconnectProfile, cpu_device

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


# "wall": elapsed time, what a dedicated machine's step takes. "cpu": this process's CPU time
# (all threads, user + system; loopback gloo's copies and TCP work included): what the step
# costs when it runs, immune to other tenants of a shared machine stealing the cores.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def clock_of(name: str) -> Callable[[], float]:
    if name not in CLOCKS:
        raise ValueError(f"clock={name!r} is not one of: {', '.join(CLOCKS)}")
    return CLOCKS[name]


def _median_seconds(fn: Callable[[], object], repeats: int, clock: str = "wall",
                    warmup: int = 1) -> float:
    now = clock_of(clock)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return max(statistics.median(times), 1e-9)


def measure_matmul_flops(m: int = 1024, k: int = 1024, n: int = 1024,
                         dtype: torch.dtype = torch.float32, repeats: int = 5,
                         clock: str = "wall") -> float:
    """FLOP/s of the three matmuls a linear layer runs per step, for an (m, k) input and a
    (k, n) weight: forward (m,k)@(k,n), input gradient (m,n)@(n,k) and weight gradient
    (k,m)@(m,n) (a transposed operand), medians of `repeats` each."""
    x, w, g = (torch.randn(*s).to(dtype) for s in ((m, k), (n, k), (m, n)))
    seconds = (_median_seconds(lambda: x @ w.t(), repeats, clock)
               + _median_seconds(lambda: g @ w, repeats, clock)
               + _median_seconds(lambda: g.t() @ x, repeats, clock))
    return 3 * 2 * m * k * n / seconds


def measure_memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5,
                             clock: str = "wall") -> float:
    """Bytes/s of a large copy (read + write), beyond the caches."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), repeats, clock)


def measure_attention_efficiency(batch: int = 4, heads: int = 8, seq: int = 128,
                                 head_dim: int = 64, matmul_flops: float = 0.0,
                                 repeats: int = 5, clock: str = "wall") -> float:
    """Causal `scaled_dot_product_attention` forward + backward, as a fraction of
    `matmul_flops`, counting the FLOPs the time model counts (6 * T * d per token)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, head_dim)

    def run() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    flops = 6 * seq * heads * head_dim * batch * seq
    return flops / _median_seconds(run, repeats, clock) / matmul_flops


def measure_elementwise_bandwidth(numel: int = 2**21, repeats: int = 5,
                                  clock: str = "wall") -> float:
    """The time model's elementwise rate on this CPU: GELU (tanh) forward + backward over
    `numel` fp32 elements stands for the non-matmul work each saved activation element
    costs (the time model charges ELEMENTWISE_PASSES x its bytes at this rate)."""
    from .timing import ELEMENTWISE_PASSES

    x = torch.randn(numel, requires_grad=True)
    g = torch.randn(numel)

    def run() -> None:
        torch.nn.functional.gelu(x, approximate="tanh").backward(g)

    return ELEMENTWISE_PASSES * 4 * numel / _median_seconds(run, repeats, clock)


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


def measure_collectives(sizes: tuple[int, int] = (64 * 2**10, 16 * 2**20), repeats: int = 5,
                        group: object | None = None,
                        clock: str = "wall") -> tuple[dict[str, float], float]:
    """({kind: bytes/s per rank}, latency per ring step), fitted over two buffer sizes.

    Bandwidth counts what each rank sends, as the time model does: (g-1)/g of the buffer for
    all-gather and reduce-scatter, twice that for all-reduce. Every rank reports the slowest
    rank's median, so all ranks agree.
    """
    world = C.world_size(group)
    if world < 2:
        raise ValueError("measure_collectives needs a process group of at least 2 ranks")
    bw: dict[str, float] = {}
    latencies = []
    for kind in KINDS:
        factor = 2 if kind == "all_reduce" else 1
        t = []
        for size in sizes:
            C.barrier(group)
            t.append(_median_seconds(_one_collective(kind, size, world, group), repeats,
                                     clock))
        t = _slowest(t, group)
        sent = [factor * (world - 1) * s / world for s in sizes]
        bw[kind] = (sent[1] - sent[0]) / max(t[1] - t[0], 1e-9)
        latencies.append(max(t[0] - sent[0] / bw[kind], 0.0) / (factor * (world - 1)))
    return bw, statistics.median(latencies)


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
            med(lambda c: c.latency_s), first.memory_bytes, first.clock)

    def device(self) -> DeviceProfile:
        """This CPU as a device: the measured rates count as its achievable peak."""
        return cpu_device(self.memory_bytes, self.flops["fp32"], self.memory_bandwidth,
                          ranks_per_node=self.world_size, name="local-cpu",
                          attention_efficiency=self.attention_efficiency,
                          elementwise_bandwidth=self.elementwise_bandwidth)

    def interconnect(self) -> InterconnectProfile:
        bw = self.collective_bandwidth
        return InterconnectProfile("local-gloo", bandwidth=min(bw.values()) if bw else 1e9,
                                   latency_s=self.latency_s, measured=dict(bw))

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size, "threads": self.threads, "flops": self.flops,
            "memory_bandwidth": self.memory_bandwidth,
            "attention_efficiency": self.attention_efficiency,
            "elementwise_bandwidth": self.elementwise_bandwidth,
            "collective_bandwidth": self.collective_bandwidth, "latency_s": self.latency_s,
            "memory_bytes": self.memory_bytes, "clock": self.clock,
        }


def calibrate_in_group(matmul: tuple[int, int, int] = (1024, 1024, 1024),
                       attention: tuple[int, int, int, int] = (4, 8, 128, 64), repeats: int = 5,
                       group: object | None = None, clock: str = "wall") -> Calibration:
    """Every rank of the current process group calls this at the same time.

    matmul: (tokens, d_in, d_out) of the model's typical linear layer.
    attention: (batch, heads, seq, head_dim) of its attention.
    clock: "wall" (default) or "cpu" (see CLOCKS: for comparisons on a shared machine).
    """
    world = C.world_size(group)
    C.barrier(group)
    flops = measure_matmul_flops(*matmul, repeats=repeats, clock=clock)
    att = measure_attention_efficiency(*attention, matmul_flops=flops, repeats=repeats,
                                       clock=clock)
    ew = measure_elementwise_bandwidth(matmul[0] * matmul[2], repeats=repeats, clock=clock)
    mem_bw = measure_memory_bandwidth(repeats=repeats, clock=clock)
    # The slowest rank sets the pace of a synchronous step.
    inv = _slowest([1 / flops, 1 / mem_bw, 1 / att, 1 / ew], group)
    coll, latency = (measure_collectives(repeats=repeats, group=group, clock=clock)
                     if world > 1 else ({}, 0.0))
    return Calibration(world, torch.get_num_threads(), {"fp32": 1 / inv[0]}, 1 / inv[1],
                       1 / inv[2], 1 / inv[3], coll, latency, cpu_device().memory_bytes,
                       clock)


def _worker(matmul: tuple[int, int, int], attention: tuple[int, int, int, int],
            repeats: int) -> dict:
    from ..engine.comm.distributed import init_distributed

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, cores // local))  # as `shardwise train` does
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
