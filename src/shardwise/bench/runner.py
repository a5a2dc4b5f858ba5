"""The benchmark worker: every system, alternating repeats, in one process group.

Machines are noisy, so systems are measured in rounds: each round runs every system once
(in a rotated order) for a few timed steps, and the report takes each system's median step
time over all rounds. Peak RSS is reset before each system (Linux `clear_refs` 5) so each
system's high-water mark is its own... within one process that mark still includes what
earlier systems left in the allocator, so peak memory is measured separately: each system
in fresh processes (`memory_worker`), after the same imports and process-group start.

On `device="cuda"` (one rank per GPU, NCCL) the model and data live on the GPU, each timed
step is bracketed by `torch.cuda.synchronize()` (kernels run behind the host: without it a
step's time would be its launch time), and each system's peak GPU memory is the allocator's
own high-water mark, reset before the system is built.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..engine.comm import collectives as C
from .systems import SYSTEMS, model_state_bytes


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark.

    preset: a shardwise.train.model preset name, or "bench30m" (a ~30M-parameter GPT).
    batch_size: sequences per rank per step.
    seq_len: tokens per sequence.
    rounds: measurement rounds (each runs every system once).
    steps: timed steps per system per round (after one warm-up step).
    systems: which systems (names from SYSTEMS).
    threads: torch intra-op threads per rank.
    device: "cpu" (gloo) or "cuda" (NCCL, one rank per GPU, the model and data on it).
    """

    preset: str = "bench30m"
    batch_size: int = 2
    seq_len: int = 128
    rounds: int = 3
    steps: int = 4
    systems: tuple[str, ...] = tuple(SYSTEMS)
    threads: int = 1
    device: str = "cpu"


def make_config(preset: str, seq_len: int):
    from ..train.model import GPTConfig
    from ..train.model import preset as get_preset

    if preset == "bench30m":
        return GPTConfig(vocab_size=256, block_size=seq_len, n_layer=10, n_head=8, d_model=512)
    cfg = get_preset(preset)
    return get_preset(preset, block_size=max(cfg.block_size, seq_len))


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmHWM: peak RSS, VmRSS: current) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_peak() -> int:
    return _status_bytes("VmHWM")


def _rss_now() -> int:
    return _status_bytes("VmRSS")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _one_system(name: str, bc: BenchConfig, rank: int, seed: int) -> dict:
    from ..train.model import GPT

    cfg = make_config(bc.preset, bc.seq_len)
    device = bench_device(bc.device)
    gc.collect()
    C.barrier(label=f"bench: before building {name}")
    base = _rss_now()
    _reset_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model, opt = SYSTEMS[name](model)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randint(0, cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (bc.batch_size, bc.seq_len), generator=g).to(device)
    times = []
    for step in range(bc.steps + 1):
        C.barrier(label="bench: step start")  # every rank starts the clock together
        _settle(device)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False) if step == bc.steps else opt.zero_grad()
        _settle(device)
        if step:  # step 0 warms up (lazy init, allocator, recorded prefetch order)
            times.append(time.perf_counter() - t0)
    state = model_state_bytes(model, opt)
    peak = _rss_peak()
    copied = _copied_per_step(model, bc.steps + 1)
    from ..train.optim import implementation

    impl = implementation(opt)
    del model, opt, loss
    gc.collect()
    out = {"times": times, "peak_rss": peak, "rss_growth": peak - base,
           "model_state_bytes": state, "params": n_params, "copied": copied, "optimizer": impl}
    if device.type == "cuda":
        out["peak_gpu"] = torch.cuda.max_memory_allocated(device)
    return out


def bench_device(kind: str) -> torch.device:
    """Where this rank's model and data live: the CPU, or the GPU NCCL gave this rank."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bench_backend(kind: str) -> str:
    """gloo for the CPU bench even where CUDA exists (the default there is NCCL, which
    refuses CPU tensors); NCCL for the GPU bench."""
    return "nccl" if kind == "cuda" else "gloo"


def _settle(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a clock read measures it (CPU: nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copied_per_step(model: torch.nn.Module, steps: int) -> dict[str, float]:
    """Bytes the engine copied locally per step, by where (shardwise systems; {} others)."""
    from ..engine.core.context import units_of

    total: dict[str, float] = {}
    for u in units_of(model):
        for k, v in u.copied.items():
            total[k] = total.get(k, 0) + v / steps
    return total


def bench_worker(bc: BenchConfig) -> dict:
    """Runs on every rank (under torchrun or shardwise.launch); returns this rank's results."""
    import shardwise as sw

    torch.set_num_threads(bc.threads)
    rank, world, _ = sw.init_distributed(bench_backend(bc.device))
    results: dict[str, dict] = {n: {"times": [], "peak_rss": 0, "rss_growth": 0}
                                for n in bc.systems}
    names = list(bc.systems)
    for r in range(bc.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            res = _one_system(name, bc, rank, seed=r)
            out = results[name]
            out["times"] += res["times"]
            out["peak_rss"] = max(out["peak_rss"], res["peak_rss"])
            out["rss_growth"] = max(out["rss_growth"], res["rss_growth"])
            out["model_state_bytes"] = res["model_state_bytes"]
            out["params"] = res["params"]
            out["copied"] = res["copied"]
            out["optimizer"] = res["optimizer"]
            if "peak_gpu" in res:
                out["peak_gpu"] = max(out.get("peak_gpu", 0), res["peak_gpu"])
    for out in results.values():
        out["median_s"] = statistics.median(out["times"])
    return {"rank": rank, "world": world, "pid": os.getpid(), "results": results}


def memory_worker(bc: BenchConfig, name: str) -> dict:
    """One system in fresh processes: peak RSS and its growth over the started process."""
    import shardwise as sw

    torch.set_num_threads(bc.threads)
    rank, world, _ = sw.init_distributed(bench_backend(bc.device))
    res = _one_system(name, BenchConfig(bc.preset, bc.batch_size, bc.seq_len, 1, 2,
                                        (name,), bc.threads, bc.device), rank, seed=0)
    return {"rank": rank, "peak_rss": res["peak_rss"], "rss_growth": res["rss_growth"],
            "model_state_bytes": res["model_state_bytes"]}
