"""Hardware the planner can price a step on: devices and interconnects.

Figures are vendor datasheet numbers (dense, no sparsity) times a documented achievable
fraction, because a plan that assumes datasheet peaks is a plan that will miss. Memory is
what CUDA reports as the device total (nvidia-smi), not the marketing number.

Interconnect bandwidth is per direction, as ring collectives use it: a ring all-gather of
B bytes moves (S-1)/S * B out of and into every rank, each direction at the same time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or this machine's CPU, after calibration).

    name: the key users type (`--device h100-80gb`).
    memory_bytes: device memory as CUDA reports it.
    peak_flops: dense matmul FLOP/s by compute dtype name ("bf16", "fp16", "fp32").
    matmul_efficiency: fraction of peak that large GEMMs reach (cuBLAS benchmarks).
    memory_bandwidth: bytes/s the memory-bound work (optimizer, elementwise) streams at.
    reserved_bytes: memory taken before the model (CUDA context, cuBLAS workspace, NCCL).
    fragmentation: fraction of the rest lost to the caching allocator's block rounding.
    intra_node: interconnect between ranks of one node.
    ranks_per_node: accelerators per node (8 in an HGX/DGX box).
    overlap: communication runs beside compute (GPUs: NCCL kernels on their own stream);
      False where both share the same cores (CPU + gloo).
    collective_scratch: the backend copies whole collective buffers (gloo does: an
      all-gather holds an output-sized and a reduce-scatter an input-sized copy while in
      flight; NCCL works in fixed internal buffers, counted in reserved_bytes).
    optimizer_foreach: torch's optimizers take the multi-tensor (foreach) path, which holds
      one temporary the size of all local parameters; False: per-parameter temporaries.
    is_cpu: the host itself (CPU offload then moves nothing anywhere).
    attention_efficiency: the rate of fused causal attention (forward + backward, causal
      FLOPs) as a fraction of the achievable matmul rate: FlashAttention-2 reaches roughly
      half to two thirds of what GEMMs do on A100/H100.
    elementwise_bandwidth: bytes/s of non-matmul layers (norms, GELU, residual adds);
      None: memory_bandwidth (GPUs: they are memory-bound). CPUs compute GELU slower than
      they stream memory, so calibration measures it.
    optimizer_bandwidth: bytes/s per pass of the optimizer's elementwise work (timing.py's
      OPTIMIZER_PASSES); None: memory_bandwidth. optimizer_tensor_s: the fixed seconds
      each parameter tensor costs the step (Python and dispatch of torch's per-parameter
      path); both measured by calibration.
    unit_overhead_s: the engine's own seconds per unit per step on the training thread
      (hooks, the schedule, issuing and finishing collectives, their fixed cost): measured
      by calibration on a tiny sharded model; 0: not counted.
    seconds_scale: wall seconds per second of the rates above ([Note: CPU time]).
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    matmul_efficiency: float
    memory_bandwidth: float
    reserved_bytes: int
    fragmentation: float
    intra_node: str
    ranks_per_node: int
    overlap: bool = True
    collective_scratch: bool = False
    optimizer_foreach: bool = True
    is_cpu: bool = False
    attention_efficiency: float = 0.6
    elementwise_bandwidth: float | None = None
    optimizer_bandwidth: float | None = None
    optimizer_tensor_s: float = 0.0
    unit_overhead_s: float = 0.0
    seconds_scale: float = 1.0

    def flops(self, dtype_name: str) -> float:
        """Achievable matmul FLOP/s in `dtype_name`."""
        return self.peak_flops[dtype_name] * self.matmul_efficiency

    @property
    def usable_bytes(self) -> int:
        """Memory left for the training step itself."""
        return int((self.memory_bytes - self.reserved_bytes) * (1.0 - self.fragmentation))


@dataclass(frozen=True)
class InterconnectProfile:
    """A link between ranks.

    bandwidth: achievable bytes/s per direction (datasheet x efficiency).
    latency_s: per ring step; a collective over S ranks pays (S-1) of them.
    shared_per_node: one link per node, shared by its ranks (a single Ethernet NIC);
      False: one link per rank (rail-optimized InfiniBand, one HCA per GPU; NVLink).
    measured: bandwidth by collective ("all_gather", "reduce_scatter", "all_reduce") where
      a calibration measured them separately (they differ on gloo); else `bandwidth`.
    wall_measured, wall_latency_s: where `measured` is in CPU time ([Note: CPU time]), the
      same collectives' wall-clock bandwidth and latency: how long one takes to complete,
      as opposed to the CPU it uses; empty: the two are the same.
    """

    name: str
    bandwidth: float
    latency_s: float
    shared_per_node: bool = False
    measured: dict[str, float] = field(default_factory=dict)
    wall_measured: dict[str, float] = field(default_factory=dict)
    wall_latency_s: float = 0.0

    def per_rank_bandwidth(self, ranks_per_node: int, collective: str = "") -> float:
        bw = self.measured.get(collective, self.bandwidth)
        return bw / ranks_per_node if self.shared_per_node else bw


def _gpu(name: str, mem_mib: int, bf16: float, fp32: float, hbm: float, eff: float,
         link: str) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        memory_bytes=mem_mib * MiB,
        # fp16 runs at bf16's rate; fp32 matmuls without TF32 (PyTorch's default since 1.12).
        peak_flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        matmul_efficiency=eff,
        memory_bandwidth=hbm * 0.85,  # large streaming kernels reach ~85% of HBM peak
        reserved_bytes=1 * GiB,  # CUDA context ~0.5 GiB + cuBLAS workspace + NCCL buffers
        fragmentation=0.05,
        intra_node=link,
        ranks_per_node=8,
    )


DEVICES: dict[str, DeviceProfile] = {
    # A100 SXM4: 312 TFLOP/s bf16, 19.5 fp32; HBM2e 1.56 / 2.04 TB/s; NVLink 3.
    "a100-40gb": _gpu("a100-40gb", 40960, 312e12, 19.5e12, 1.555e12, 0.80, "nvlink3"),
    "a100-80gb": _gpu("a100-80gb", 81920, 312e12, 19.5e12, 2.039e12, 0.80, "nvlink3"),
    # H100 SXM5: 989 TFLOP/s bf16, 67 fp32; HBM3 3.35 TB/s; NVLink 4. GEMMs reach ~70%.
    "h100-80gb": _gpu("h100-80gb", 81559, 989e12, 67e12, 3.35e12, 0.70, "nvlink4"),
    # H200 SXM: H100's compute with 141 GB HBM3e at 4.8 TB/s.
    "h200-141gb": _gpu("h200-141gb", 143771, 989e12, 67e12, 4.8e12, 0.70, "nvlink4"),
}

INTERCONNECTS: dict[str, InterconnectProfile] = {
    # NVLink 3 (A100): 600 GB/s both directions = 300 per direction; NCCL reaches ~80%.
    "nvlink3": InterconnectProfile("nvlink3", 300e9 * 0.8, 2e-6),
    # NVLink 4 (H100/H200): 900 GB/s both directions = 450 per direction.
    "nvlink4": InterconnectProfile("nvlink4", 450e9 * 0.8, 2e-6),
    # InfiniBand HDR / NDR: 200 / 400 Gb/s per HCA, one HCA per GPU; ~90% reachable.
    "ib-200g": InterconnectProfile("ib-200g", 200e9 / 8 * 0.9, 5e-6),
    "ib-400g": InterconnectProfile("ib-400g", 400e9 / 8 * 0.9, 5e-6),
    # Ethernet (TCP, no RDMA): one NIC per node shared by its GPUs; ~80% reachable.
    "eth-25g": InterconnectProfile("eth-25g", 25e9 / 8 * 0.8, 25e-6, shared_per_node=True),
    "eth-100g": InterconnectProfile("eth-100g", 100e9 / 8 * 0.8, 20e-6, shared_per_node=True),
}
# The generic name picks the NVLink generation of the device it is used with.
ALIASES = {"nvlink": "nvlink4"}


def cpu_seconds_scale(ranks: int, threads: int, cores: int) -> float:
    """[Note: CPU time] Rates timed in CPU time (planner.calibrate's "cpu" clock: what the
    work costs, whatever else runs on the machine) predict a step in CPU-seconds of one rank:
    every thread of it, torch's intra-op threads spinning between kernels included. On a
    machine of its own, a rank of `threads` threads runs `threads` CPU-seconds per second
    while the ranks' threads fit the `cores`; beyond, the cores are shared evenly (3 ranks
    of one thread on 2 cores: each gets two thirds of a core). Wall seconds per CPU-second:
    max(ranks x threads, cores) / (cores x threads). 0 cores: unknown, taken as enough."""
    if cores <= 0:
        return 1.0 / max(threads, 1)
    return max(ranks * threads, cores) / (cores * threads)


def cpu_device(memory_bytes: int = 0, flops: float = 5e10, memory_bandwidth: float = 1e10,
               ranks_per_node: int = 1, name: str = "cpu", attention_efficiency: float = 0.5,
               elementwise_bandwidth: float | None = None,
               optimizer_bandwidth: float | None = None, optimizer_tensor_s: float = 0.0,
               unit_overhead_s: float = 0.0, seconds_scale: float = 1.0) -> DeviceProfile:
    """This machine's CPU running gloo. The default rates are placeholders: measure them
    with planner.calibrate (`shardwise plan --calibrate`)."""
    if not memory_bytes:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not POSIX
            memory_bytes = 0
    return DeviceProfile(
        name=name, memory_bytes=memory_bytes, peak_flops={"fp32": flops, "bf16": flops},
        matmul_efficiency=1.0, memory_bandwidth=memory_bandwidth, reserved_bytes=0,
        fragmentation=0.0, intra_node="local-gloo", ranks_per_node=ranks_per_node,
        # The ranks' own cores run gloo's copies, so communication does not hide; gloo
        # copies whole buffers; torch's optimizers take the per-parameter path on CPU.
        overlap=False, collective_scratch=True, optimizer_foreach=False, is_cpu=True,
        attention_efficiency=attention_efficiency, elementwise_bandwidth=elementwise_bandwidth,
        optimizer_bandwidth=optimizer_bandwidth, optimizer_tensor_s=optimizer_tensor_s,
        unit_overhead_s=unit_overhead_s, seconds_scale=seconds_scale)


def _key(value: str) -> str:
    return value.strip().lower().replace("_", "-")


def device_profile(value: str | DeviceProfile) -> DeviceProfile:
    """A device by name (`h100-80gb`, also `h100`) or a profile passed through."""
    if isinstance(value, DeviceProfile):
        return value
    if isinstance(value, str):
        key = _key(value)
        if key in DEVICES:
            return DEVICES[key]
        if key == "cpu":
            return cpu_device()
        matches = [k for k in DEVICES if k.split("-")[0] == key]
        if len(matches) == 1:
            return DEVICES[matches[0]]
    raise ValueError(f"device={value!r} is not one of: {', '.join(DEVICES)}, cpu "
                     "(or a DeviceProfile, e.g. from planner.calibrate)")


def interconnect_profile(value: str | InterconnectProfile,
                         device: DeviceProfile | None = None) -> InterconnectProfile:
    """An interconnect by name; `nvlink` means the given device's NVLink generation."""
    if isinstance(value, InterconnectProfile):
        return value
    if isinstance(value, str):
        key = _key(value)
        if key == "nvlink" and device is not None and device.intra_node in INTERCONNECTS:
            return INTERCONNECTS[device.intra_node]
        key = ALIASES.get(key, key)
        if key in INTERCONNECTS:
            return INTERCONNECTS[key]
    allowed = ", ".join(["nvlink", *INTERCONNECTS])
    raise ValueError(f"interconnect={value!r} is not one of: {allowed} "
                     "(or an InterconnectProfile, e.g. from planner.calibrate)")
