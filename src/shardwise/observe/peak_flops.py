"""A device's peak FLOP/s, the denominator of MFU: a table for GPUs, a matmul elsewhere.

The table holds vendors' dense figures (no 2:4 sparsity) for the two compute dtypes a run
uses: 16-bit (bf16, or fp16 on parts without bf16) on tensor cores, and fp32 without TF32
(PyTorch's default for fp32 matmuls). A GPU that is not in it, and every CPU, is measured: the
best rate of a square matmul in the run's dtype over about a quarter of a second, on this rank's
threads, while the other ranks do the same. A measured peak is what matmuls reach here, not a
datasheet number, so a CPU run's MFU says how close training comes to plain matmul speed.
`--log.peak_tflops` overrides both.
"""

from __future__ import annotations

import time

import torch

# Substring of torch.cuda.get_device_name() -> (16-bit dense, fp32) peak TFLOP/s. Checked in
# order: the first match wins, so a name that contains another ("H100 NVL" contains "H100",
# "L40S" contains "L4") comes before it.
GPU_PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("H200", 989.4, 66.9),
    ("H100 NVL", 835.0, 60.0),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM
    ("H800", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("A6000", 154.8, 38.7),
    ("RTX 4090", 165.2, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),  # fp16 (no bf16)
    ("MI300X", 1307.4, 163.4),
    ("MI250X", 383.0, 47.9),
)

HALF = (torch.bfloat16, torch.float16)


def table_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of a GPU named `device_name` for `dtype`, or None when not listed."""
    for key, half, fp32 in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return (half if dtype in HALF else fp32) * 1e12
    return None


def measure_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.25,
                 n: int | None = None) -> float:
    """FLOP/s of the best of several n x n matmuls in `dtype` on `device` (one warm-up)."""
    if n is None:
        n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2.0 * n**3
    best = float("inf")
    torch.mm(a, b)  # warm-up: first-call dispatch and allocation are not peak speed
    spent = 0.0
    runs = 0
    while runs < 3 or spent < seconds:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return flops / best


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0
               ) -> tuple[float, str]:
    """(peak FLOP/s of one device for `dtype`, where the figure came from)."""
    if override_tflops > 0:
        return override_tflops * 1e12, "given (log.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = table_peak(name, dtype)
        if listed is not None:
            return listed, f"{name}, datasheet"
        return measure_peak(device, dtype), f"{name}, measured matmul"
    return measure_peak(device, dtype), (f"measured matmul, {torch.get_num_threads()} "
                                         "threads")
