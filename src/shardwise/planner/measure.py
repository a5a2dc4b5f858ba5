"""What one rank times on its own: the kernels a step is made of, in the model's shapes.

planner/calibrate.py runs these on every rank at once (the ranks share the cores, so a lone
measurement would flatter them) and adds the collectives and the engine's own cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .shape import TransformerShape

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
                          clock: str = "wall", min_s: float = 0.0, layers: int = 1) -> float:
    """Seconds of one pre-norm transformer block of `shape`, forward and backward, on
    (batch, seq) tokens, in fp32: norm -> q/k/v -> causal `scaled_dot_product_attention`
    -> out projection -> residual; norm -> MLP (GELU, or gated SiLU) -> residual, as the
    time model's blocks are (planner/shape.py). Built from plain tensors: nothing of the
    model is needed. `layers` blocks of their own weights run as a stack, forward through
    all then backward, and the time is per block: as in a model, each block finds the
    caches full of the others' weights and activations, which one block looping alone
    does not."""
    d, f, hd = shape.d_model, shape.ffn_dim, shape.head_dim
    h = shape.n_heads
    F = torch.nn.functional

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims) * 0.02).requires_grad_()

    def block() -> Callable[[torch.Tensor], torch.Tensor]:
        n1, n2 = torch.ones(d, requires_grad=True), torch.ones(d, requires_grad=True)
        qkv, out = w(3 * h * hd, d), w(d, h * hd)
        mats = [w(f, d) for _ in range(shape.mlp_matrices - 1)] + [w(d, f)]

        def forward(x: torch.Tensor) -> torch.Tensor:
            a = F.layer_norm(x, (d,), n1, None, 1e-5)
            q, k, v = F.linear(a, qkv).view(batch, seq, 3, h, hd).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            s = x + F.linear(y.transpose(1, 2).reshape(batch, seq, h * hd), out)
            m = F.layer_norm(s, (d,), n2, None, 1e-5)
            if shape.mlp == "gated":
                hid = F.silu(F.linear(m, mats[0])) * F.linear(m, mats[1])
            else:
                hid = F.gelu(F.linear(m, mats[0]), approximate="tanh")
            return s + F.linear(hid, mats[-1])

        return forward

    stack = [block() for _ in range(max(layers, 1))]
    x = torch.randn(batch, seq, d, requires_grad=True)

    def run() -> None:
        y = x
        for b in stack:
            y = b(y)
        y.sum().backward()

    return _median_seconds(run, repeats, clock, min_s=min_s) / len(stack)


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


def measure_optimizer(numel: int = 2**22, tensors: int = 32, repeats: int = 5,
                      clock: str = "wall", min_s: float = 0.0) -> tuple[float, float]:
    """torch's AdamW with its default arguments (what users write; on CPU the per-parameter
    path): (bytes/s per pass over one fp32 state array, seconds per parameter tensor).

    `tensors` one-row parameters give the fixed cost of each tensor (Python and dispatch);
    `numel` elements split over `tensors` parameters (best: one rank's local parameters)
    give the rate, the fixed cost taken out: the optimizer streams its whole state, which
    runs at the speed of the memory level that state fits in, not of a cache-sized test."""
    from .timing import OPTIMIZER_PASSES

    def step_seconds(sizes: list[int]) -> float:
        params = [torch.zeros(n, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _median_seconds(opt.step, repeats, clock, warmup=2, min_s=min_s)

    tensors = max(1, tensors)
    per_tensor = step_seconds([8] * tensors) / tensors
    each = max(1, numel // tensors)
    big = step_seconds([each] * tensors)
    passes = OPTIMIZER_PASSES["adamw"] * 4 * each * tensors
    return passes / max(big - tensors * per_tensor, 1e-9), per_tensor




def measure_dequant_bytes(dtype: torch.dtype = torch.float32, rows: int = 2048,
                          cols: int = 4096) -> float:
    """Peak bytes per weight value of a linear layer over a (rows, cols) torchao NF4 weight
    held in `dtype` (its forward: torchao dequantizes the whole weight, then multiplies):
    the figure behind [Note: NF4 dequantization] (planner/memory.py). Read off this
    process's resident high-water mark (Linux), so it is exact only where freed memory
    leaves the resident set at once (glibc told to mmap large blocks, as
    tests/dist/plan_workers.py's `follow_live_bytes` does) and nothing else runs."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    weight = to_nf4(torch.randn(rows, cols, dtype=dtype), 64, 256)
    x = torch.randn(1, cols, dtype=dtype)
    torch.nn.functional.linear(x, weight)  # first-use allocations out of the way
    before = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    torch.nn.functional.linear(x, weight)
    return (kib("VmHWM") - before) * 1024 / (rows * cols)
