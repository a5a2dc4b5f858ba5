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
from .profiles import DeviceProfile, InterconnectProfile, cpu_device, cpu_seconds_scale
from .shape import TransformerShape

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


# "wall": elapsed time, what a dedicated machine's step takes. "cpu": this process's CPU time
# (all threads, user + system; loopback gloo's copies and TCP work included): what the step
# costs when it runs, immune to other tenants of a shared machine stealing the cores.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def clock_of(name: str) -> Callable[[], float]:
    if name not in CLOCKS:
        raise ValueError(f"clock={name!r} is not one of: {', '.join(CLOCKS)}")
    return CLOCKS[name]


# Each timed sample of a local measurement lasts at least this long (the call repeated): a
# millisecond kernel timed alone misses what a rank sharing its cores pays, since the
# scheduler hands out cores in slices of a few milliseconds. Over 30 ms each of 3 ranks on 2
# cores gets its 2/3 share, as in a real step.
MIN_SAMPLE_S = 0.03


def _median_seconds(fn: Callable[[], object], repeats: int, clock: str = "wall",
                    warmup: int = 1, min_s: float = 0.0) -> float:
    """Median seconds of one call of `fn` over `repeats` samples of at least `min_s` each."""
    now = clock_of(clock)
    t0 = now()
    for _ in range(max(warmup, 1)):
        fn()
    one = (now() - t0) / max(warmup, 1)
    calls = max(1, int(min_s / max(one, 1e-6) + 0.999)) if min_s > 0 else 1
    times = []
    for _ in range(repeats):
        t0 = now()
        for _ in range(calls):
            fn()
        times.append((now() - t0) / calls)
    return max(statistics.median(times), 1e-9)


def measure_matmul_flops(m: int = 1024, k: int = 1024, n: int = 1024,
                         dtype: torch.dtype = torch.float32, repeats: int = 5,
                         clock: str = "wall", min_s: float = 0.0) -> float:
    """FLOP/s of the three matmuls a linear layer runs per step, for an (m, k) input and a
    (k, n) weight: forward (m,k)@(k,n), input gradient (m,n)@(n,k) and weight gradient
    (k,m)@(m,n) (a transposed operand), medians of `repeats` each."""
    x, w, g = (torch.randn(*s).to(dtype) for s in ((m, k), (n, k), (m, n)))
    seconds = (_median_seconds(lambda: x @ w.t(), repeats, clock, min_s=min_s)
               + _median_seconds(lambda: g @ w, repeats, clock, min_s=min_s)
               + _median_seconds(lambda: g.t() @ x, repeats, clock, min_s=min_s))
    return 3 * 2 * m * k * n / seconds


def measure_memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5,
                             clock: str = "wall", min_s: float = 0.0) -> float:
    """Bytes/s of a large copy (read + write), beyond the caches."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), repeats, clock, min_s=min_s)


def measure_attention_efficiency(batch: int = 4, heads: int = 8, seq: int = 128,
                                 head_dim: int = 64, matmul_flops: float = 0.0,
                                 repeats: int = 5, clock: str = "wall",
                                 min_s: float = 0.0) -> float:
    """Causal `scaled_dot_product_attention` forward + backward, as a fraction of
    `matmul_flops`, counting the FLOPs the time model counts (6 * T * d per token)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, head_dim)

    def run() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    flops = 6 * seq * heads * head_dim * batch * seq
    return flops / _median_seconds(run, repeats, clock, min_s=min_s) / matmul_flops


def measure_elementwise_bandwidth(numel: int = 2**21, repeats: int = 5,
                                  clock: str = "wall", min_s: float = 0.0) -> float:
    """The time model's elementwise rate on this CPU: GELU (tanh) forward + backward over
    `numel` fp32 elements stands for the non-matmul work each saved activation element
    costs (the time model charges ELEMENTWISE_PASSES x its bytes at this rate)."""
    from .timing import ELEMENTWISE_PASSES

    x = torch.randn(numel, requires_grad=True)
    g = torch.randn(numel)

    def run() -> None:
        torch.nn.functional.gelu(x, approximate="tanh").backward(g)

    return ELEMENTWISE_PASSES * 4 * numel / _median_seconds(run, repeats, clock, min_s=min_s)


def measure_block_seconds(shape: TransformerShape, batch: int, seq: int, repeats: int = 5,
                          clock: str = "wall", min_s: float = 0.0) -> float:
    """Seconds of one pre-norm transformer block of `shape`, forward and backward, on
    (batch, seq) tokens, in fp32: norm -> q/k/v -> causal `scaled_dot_product_attention`
    -> out projection -> residual; norm -> MLP (GELU, or gated SiLU) -> residual, as the
    time model's blocks are (planner/shape.py). Built from plain tensors: nothing of the
    model is needed."""
    d, f, hd = shape.d_model, shape.ffn_dim, shape.head_dim
    h = shape.n_heads

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims) * 0.02).requires_grad_()

    n1, n2 = torch.ones(d, requires_grad=True), torch.ones(d, requires_grad=True)
    qkv, out = w(3 * h * hd, d), w(d, h * hd)
    mats = [w(f, d) for _ in range(shape.mlp_matrices - 1)] + [w(d, f)]
    x = torch.randn(batch, seq, d, requires_grad=True)
    F = torch.nn.functional

    def run() -> None:
        a = F.layer_norm(x, (d,), n1, None, 1e-5)
        q, k, v = F.linear(a, qkv).view(batch, seq, 3, h, hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        s = x + F.linear(y.transpose(1, 2).reshape(batch, seq, h * hd), out)
        m = F.layer_norm(s, (d,), n2, None, 1e-5)
        if shape.mlp == "gated":
            hid = F.silu(F.linear(m, mats[0])) * F.linear(m, mats[1])
        else:
            hid = F.gelu(F.linear(m, mats[0]), approximate="tanh")
        (s + F.linear(hid, mats[-1])).sum().backward()

    return _median_seconds(run, repeats, clock, min_s=min_s)


def block_elementwise_bandwidth(shape: TransformerShape, batch: int, seq: int,
                                block_s: float, flops: float, attention: float) -> float:
    """The elementwise rate that makes the time model's block take `block_s`: what the
    block's matmuls (at `flops`) and attention (at `attention` x `flops`) leave is its
    non-matmul work (norms, GELU, residual adds, reshapes, autograd's own), charged as
    ELEMENTWISE_PASSES over the saved activations (planner/timing.py's `unit_work`). At
    least a tenth of the block is left to it, whatever the matmul figures say."""
    from .timing import ELEMENTWISE_PASSES

    tokens = batch * seq
    matmul_s = shape.block_matmul_flops_per_token() * tokens / flops
    att_s = shape.attention_flops_per_token(seq) * tokens / (flops * attention)
    rest = max(block_s - matmul_s - att_s, 0.1 * block_s)
    return ELEMENTWISE_PASSES * shape.block_activation_bytes(4) * tokens / rest


def measure_optimizer(numel: int = 2**20, tensors: int = 64, repeats: int = 5,
                      clock: str = "wall", min_s: float = 0.0) -> tuple[float, float]:
    """torch's AdamW with its default arguments (what users write; on CPU the per-parameter
    path): (bytes/s per pass over one fp32 state array, seconds per parameter tensor).
    One `numel`-element parameter gives the rate, `tensors` one-row ones the fixed cost of
    each tensor (Python and dispatch), which a model of many small tensors pays."""
    from .timing import OPTIMIZER_PASSES

    def step_seconds(params: list[torch.Tensor]) -> float:
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _median_seconds(opt.step, repeats, clock, warmup=2, min_s=min_s)

    small = step_seconds([torch.zeros(8, requires_grad=True) for _ in range(tensors)])
    per_tensor = small / tensors
    big = step_seconds([torch.zeros(numel, requires_grad=True)])
    passes = OPTIMIZER_PASSES["adamw"] * 4 * numel
    return passes / max(big - per_tensor, 1e-9), per_tensor


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
                        group: object | None, min_s: float) -> float:
    """As `_median_seconds` for a collective: every rank makes the same number of calls
    (the most any rank needs for `min_s` per sample), or they would not pair up."""
    now = clock_of(clock)
    C.barrier(group)
    t0 = now()
    fn()
    one = now() - t0
    calls = torch.tensor([max(1, int(min_s / max(one, 1e-6) + 0.999)) if min_s > 0 else 1])
    C.all_reduce(calls, group, op="max")
    n = int(calls.item())
    times = []
    for _ in range(repeats):
        t0 = now()
        for _ in range(n):
            fn()
        times.append((now() - t0) / n)
    return max(statistics.median(times), 1e-9)


def measure_collectives(sizes: tuple[int, int] = (64 * 2**10, 16 * 2**20), repeats: int = 5,
                        group: object | None = None, clock: str = "wall",
                        min_s: float = 0.0) -> tuple[dict[str, float], float]:
    """({kind: bytes/s per rank}, latency per ring step), fitted over two buffer sizes
    (whole buffers in bytes: best the model's smallest and largest unit).

    Bandwidth counts what each rank sends, as the time model does: (g-1)/g of the buffer for
    all-gather and reduce-scatter, twice that for all-reduce. Every rank reports the slowest
    rank's median, so all ranks agree. Where the two sizes cannot be told apart (equal, or
    the larger no slower), the larger one's rate stands alone, without latency.
    """
    world = C.world_size(group)
    if world < 2:
        raise ValueError("measure_collectives needs a process group of at least 2 ranks")
    bw: dict[str, float] = {}
    latencies = []
    small, large = sorted(sizes)
    for kind in KINDS:
        factor = 2 if kind == "all_reduce" else 1
        t = _slowest([_collective_seconds(_one_collective(kind, size, world, group), repeats,
                                          clock, group, min_s) for size in (small, large)],
                     group)
        sent = [factor * (world - 1) * s / world for s in (small, large)]
        steps = factor * (world - 1)
        if sent[1] > 1.5 * sent[0] and t[1] > t[0]:
            bw[kind] = (sent[1] - sent[0]) / (t[1] - t[0])
            latencies.append(max(t[0] - sent[0] / bw[kind], 0.0) / steps)
        else:
            bw[kind] = sent[1] / t[1]
            latencies.append(0.0)
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
    # torch's AdamW: bytes/s per pass over a state array, and seconds per parameter tensor
    # (measure_optimizer; 0: not measured, the memory bandwidth stands in).
    optimizer_bandwidth: float = 0.0
    optimizer_tensor_s: float = 0.0
    cores: int = 0  # cores this rank may run on (0: unknown)

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
            first.cores)

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
                          seconds_scale=self.seconds_scale)

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
            "optimizer_bandwidth": self.optimizer_bandwidth,
            "optimizer_tensor_s": self.optimizer_tensor_s, "cores": self.cores,
        }


def calibrate_in_group(matmul: tuple[int, int, int] = (1024, 1024, 1024),
                       attention: tuple[int, int, int, int] = (4, 8, 128, 64), repeats: int = 5,
                       group: object | None = None, clock: str = "wall",
                       block: TransformerShape | None = None,
                       optimizer_numel: int = 2**20,
                       collective_sizes: tuple[int, int] = (64 * 2**10, 16 * 2**20)
                       ) -> Calibration:
    """Every rank of the current process group calls this at the same time.

    matmul: (tokens, d_in, d_out) of the model's typical linear layer.
    attention: (batch, heads, seq, head_dim) of its attention.
    clock: "wall" (default) or "cpu" (see CLOCKS: for comparisons on a shared machine).
    block: the model's shape: its block, timed whole on attention's (batch, seq), sets the
      elementwise rate (`block_elementwise_bandwidth`) instead of GELU alone.
    optimizer_numel: elements of the parameter AdamW is timed on (one rank's largest shard).
    collective_sizes: two whole-buffer sizes in bytes the collectives are timed at (best
      the model's smallest and largest unit: `measure_collectives`).
    """
    world = C.world_size(group)
    C.barrier(group)
    kw = dict(repeats=repeats, clock=clock, min_s=MIN_SAMPLE_S)
    flops = measure_matmul_flops(*matmul, **kw)  # type: ignore[arg-type]
    att = measure_attention_efficiency(*attention, matmul_flops=flops, **kw)  # type: ignore[arg-type]
    if block is not None:
        batch, seq = attention[0], attention[2]
        block_s = measure_block_seconds(block, batch, seq, **kw)  # type: ignore[arg-type]
        ew = block_elementwise_bandwidth(block, batch, seq, block_s, flops, att)
    else:
        ew = measure_elementwise_bandwidth(matmul[0] * matmul[2], **kw)  # type: ignore[arg-type]
    mem_bw = measure_memory_bandwidth(**kw)  # type: ignore[arg-type]
    opt_bw, opt_tensor = measure_optimizer(optimizer_numel, **kw)  # type: ignore[arg-type]
    # The slowest rank sets the pace of a synchronous step.
    inv = _slowest([1 / flops, 1 / mem_bw, 1 / att, 1 / ew, 1 / opt_bw, opt_tensor], group)
    coll, latency = (measure_collectives(collective_sizes, repeats, group, clock, MIN_SAMPLE_S)
                     if world > 1 else ({}, 0.0))
    return Calibration(world, torch.get_num_threads(), {"fp32": 1 / inv[0]}, 1 / inv[1],
                       1 / inv[2], 1 / inv[3], coll, latency, cpu_device().memory_bytes,
                       clock, 1 / inv[4], inv[5], _cores())


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def _worker(matmul: tuple[int, int, int], attention: tuple[int, int, int, int],
            repeats: int) -> dict:
    from ..engine.comm.distributed import init_distributed

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
