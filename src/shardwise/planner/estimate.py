"""How long one step takes, from the planner's units, collectives and profiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.core.policies import DEFAULT_COALESCE_BYTES, dtype_name
from . import timing as T
from .copies import copy_seconds, step_copies, transport_of, unit_copies
from .profiles import DeviceProfile, InterconnectProfile, interconnect_profile
from .simulate import StepActivations, terms
from .units import ModelUnits


@dataclass(frozen=True)
class TimeEstimate:
    """One step on one rank."""

    tokens_per_rank: int
    model_flops: float  # 6 x params x tokens + attention (per rank)
    hardware_flops: float  # plus activation recomputation
    compute_s: float  # matmuls at the device's achievable rate + elementwise traffic
    comm_s: float  # every collective back to back
    optimizer_s: float
    offload_s: float  # CPU offload: PCIe copies of shards and gradients (optimizer: host)
    step_s_overlap: float  # communication on its own stream, engine order
    step_s_serial: float  # nothing overlaps
    step_s: float  # the prediction: overlap where the device overlaps
    mfu: float  # model FLOPs / (step_s x peak FLOP/s)
    tokens_per_s: float  # the whole job
    bound: str  # "compute" | "interconnect"
    verdict: str
    copy_s: float = 0.0  # the engine's local copies ([Note: local copies])



def link_profiles(dev: DeviceProfile, interconnect: str | InterconnectProfile | None, world: int,
           per_node: int, notes: list[str]) -> T.Links | None:
    try:
        intra = interconnect_profile(dev.intra_node, dev)
    except ValueError:
        if interconnect is None:  # a CPU: its gloo bandwidth must be measured
            notes.append(f"no time estimate: {dev.name!r} needs a measured interconnect "
                         "(planner.calibrate, `shardwise plan --calibrate`)")
            return None
        intra = interconnect_profile(interconnect, dev)
    if interconnect is None:
        inter = interconnect_profile("ib-400g")
        if world > per_node:
            notes.append("no interconnect given: nodes assumed linked by ib-400g")
    else:
        inter = interconnect_profile(interconnect, dev)
    return T.Links(intra, inter, per_node)


def step_time(costs: list, colls: list[T.Collective], links: T.Links, dev: DeviceProfile,
          mu: ModelUnits, acts: StepActivations | None, act_dtype: torch.dtype, opt: str,
          batch: int, seq_len: int, checkpointing: bool, S: int, R: int, world: int,
          host_offload: bool, reshard: bool,
          coalesce_bytes: int = DEFAULT_COALESCE_BYTES) -> TimeEstimate:
    tokens = batch * seq_len
    # 16-bit compute has its own peak; anything else runs at the fp32 one.
    dname = dtype_name(act_dtype) if act_dtype in (torch.bfloat16, torch.float16) else "fp32"
    if dname not in dev.peak_flops:
        raise ValueError(f"device {dev.name!r} has no {dname} FLOP/s figure "
                         f"(it has {sorted(dev.peak_flops)})")
    a = acts or StepActivations()
    act_per_unit = [a.layer * c.layers + (a.head if c.head else 0) for c in costs]
    work, model_flops, hw_flops = T.unit_work(costs, mu.shape, tokens, seq_len, dev, dname,
                                              act_per_unit, checkpointing)
    state_bytes = sum(c.state_bytes for c in costs)
    tensors = sum(c.state_params for c in costs)
    optimizer_s = T.optimizer_seconds(opt, state_bytes, dev, on_host=host_offload,
                                      tensors=tensors)
    offload_s = T.offload_seconds(costs, gathers=2 if reshard else 1) if host_offload else 0.0
    transport = transport_of(S, dev.collective_scratch)
    per_call = [unit_copies(c, S, R, transport) for c in costs]
    copies = step_copies(costs, shard_size=S, replicate_size=R, transport=transport,
                         reshard_after_forward=reshard)
    copy_s = copy_seconds(sum(copies.values()), dev.memory_bandwidth)

    def one_copy(kind: str, unit: int) -> float:
        return copy_seconds(per_call[unit][kind], dev.memory_bandwidth)

    compute_s = sum(work.forward_s) + sum(work.backward_s)
    comm_s = sum(links.seconds(c) for c in colls)
    fixed = optimizer_s + offload_s  # neither overlaps with anything in the engine
    sync = S > 1 and R > 1
    # [Note: coalesced units]: which units share collectives, as the engine decides it.
    unit_terms = [terms(c, S, coalesce_bytes if R == 1 else 0) for c in costs]
    overlap = T.overlapped_step(work, colls, links, fixed, sync, copy_s=one_copy,
                                reshard_after_forward=reshard, terms=unit_terms)
    serial = T.serial_step(work, colls, links, fixed, copy_s)
    # A device that does not overlap (a CPU's cores also run gloo) replays the schedule with
    # the collectives on the training thread: the serial time, in the engine's order.
    step = overlap if dev.overlap else (
        T.step_replay(work, colls, links, sync, copy_s=one_copy, overlap=False,
                      wall_per_second=dev.seconds_scale, reshard_after_forward=reshard,
                      terms=unit_terms)
        .step_seconds() + fixed)
    # [Note: CPU time]: rates timed in CPU time give CPU-seconds; the step is wall seconds.
    k = dev.seconds_scale
    compute_s, comm_s, optimizer_s, offload_s, copy_s = (
        x * k for x in (compute_s, comm_s, optimizer_s, offload_s, copy_s))
    overlap, serial, step, fixed = overlap * k, serial * k, step * k, fixed * k
    mfu = model_flops / (step * dev.peak_flops[dname])
    exposed = step - compute_s - fixed
    slow = links.inter if any(c.inter_node for c in colls) else links.intra
    # The interconnect bounds the step when it would set the pace even with perfect overlap,
    # or when a fifth of the step is spent waiting on it.
    bound = "interconnect" if (comm_s >= compute_s or exposed > 0.2 * step) else "compute"
    if bound == "interconnect":
        need = sum(c.sent_bytes for c in colls) / compute_s / 2**30
        verdict = (f"interconnect-bound: {slow.name} moves {_gib(colls)} GiB per rank "
                   f"per step in {comm_s:.3g} s while compute takes {compute_s:.3g} s; "
                   f"{exposed:.3g} s of each {step:.3g} s step ({100 * exposed / step:.0f}%) "
                   f"waits on the network. Hiding it needs about {need:.3g} GiB/s per rank, "
                   "or more tokens per step.")
    else:
        verdict = (f"compute-bound: communication ({comm_s:.3g} s per step) "
                   + ("hides under" if dev.overlap else "adds to")
                   + f" compute ({compute_s:.3g} s).")
    return TimeEstimate(
        tokens_per_rank=tokens, model_flops=model_flops, hardware_flops=hw_flops,
        compute_s=compute_s, comm_s=comm_s, optimizer_s=optimizer_s, offload_s=offload_s,
        step_s_overlap=overlap,
        step_s_serial=serial, step_s=step, mfu=mfu, tokens_per_s=tokens * world / step,
        bound=bound, verdict=verdict, copy_s=copy_s)


def _gib(colls: list[T.Collective]) -> str:
    return f"{sum(c.sent_bytes for c in colls) / 2**30:.3g}"
