"""How long one step takes: FLOPs, bytes on the wire, and how much of the wire hides.

Communication is priced as ring collectives (what NCCL and gloo run at these sizes): over a
group of g ranks an all-gather or reduce-scatter of a B-byte buffer sends and receives
(g-1)/g * B per rank in g-1 steps; an all-reduce twice that in 2(g-1) steps. Each step costs
the link's latency, each byte its bandwidth; a group that spans nodes runs at the slower
(inter-node) link.

The overlapped step is a two-stream replay of the engine's own schedule (timed_replay.py
drives engine/core/schedule.py's `Schedule`, as the memory replay does): the compute stream runs
units one after another; the communication stream runs gathers and reductions in issue order;
a unit computes once its all-gather is done; prefetches and pending reductions follow the
schedule's `Limits`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine.core.events import wire_bytes
from ..engine.core.schedule import DEFAULT_LIMITS, Coalesce, Limits
from .memory import UnitCost, _size
from .profiles import DeviceProfile, InterconnectProfile
from .shape import TransformerShape
from .timed_replay import Replay

# Full-array passes of torch's (non-fused) AdamW per step: mul_ (decay), lerp_ (m), mul_ and
# addcmul_ (v), sqrt, div, add_ (denominator), addcdiv_ (update): ~20 reads+writes of a
# parameter-sized fp32 array. SGD with momentum: ~4; plain SGD: ~3.
OPTIMIZER_PASSES = {"adamw": 20, "adam": 18, "sgd-momentum": 4, "sgd": 3, "none": 0}
# Non-matmul work (norms, GELU, residual adds, casts) streams each saved activation about
# three times: written in forward, read in backward, its gradient written and read once.
ELEMENTWISE_PASSES = 3


@dataclass(frozen=True)
class Collective:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    unit: int  # index in forward order
    phase: str  # "forward" | "backward"
    buffer_bytes: int  # the whole buffer (padded, all ranks' chunks for gather/scatter)
    group: int  # ranks in the group
    inter_node: bool  # the group spans nodes

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends (and receives) in a ring: the one definition the engine's
        events use too ([Note: communication bytes] in engine/core/events.py)."""
        return wire_bytes(self.kind, self.buffer_bytes, self.group)

    @property
    def steps(self) -> int:
        return (2 if self.kind == "all_reduce" else 1) * (self.group - 1)


def collectives(costs: list[UnitCost], *, shard_size: int, replicate_size: int,
                reshard_after_forward: bool, ranks_per_node: int) -> list[Collective]:
    """Every collective one rank takes part in during one step, in issue order per phase."""
    S, R = shard_size, replicate_size
    shard_inter = S > ranks_per_node
    # HYBRID's replicas sit on different nodes; NO_SHARD's replicas are the whole world.
    rep_inter = R > 1 and (S * R > ranks_per_node)
    out: list[Collective] = []
    if S > 1:
        for i, c in enumerate(costs):
            for dtype, chunk in c.gather:
                out.append(Collective("all_gather", i, "forward", S * chunk * _size(dtype), S,
                                      shard_inter))
    for i in range(len(costs) - 1, -1, -1):
        c = costs[i]
        if S > 1 and reshard_after_forward and i != 0:  # the root stays unsharded
            for dtype, chunk in c.gather:
                out.append(Collective("all_gather", i, "backward", S * chunk * _size(dtype),
                                      S, shard_inter))
        for rdtype, n, _ in c.reduce:
            if S > 1:
                out.append(Collective("reduce_scatter", i, "backward", S * n * _size(rdtype),
                                      S, shard_inter))
            if R > 1:
                out.append(Collective("all_reduce", i, "backward", n * _size(rdtype), R,
                                      rep_inter))
    return out


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends and receives per step (ring collectives: the two are equal)."""

    all_gather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    sent_bytes: int
    received_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    collectives: int


def comm_volume(colls: list[Collective]) -> CommVolume:
    def total(kind: str) -> int:
        return sum(c.sent_bytes for c in colls if c.kind == kind)

    sent = sum(c.sent_bytes for c in colls)
    inter = sum(c.sent_bytes for c in colls if c.inter_node)
    return CommVolume(total("all_gather"), total("reduce_scatter"), total("all_reduce"),
                      sent, sent, sent - inter, inter, len(colls))


@dataclass(frozen=True)
class Links:
    intra: InterconnectProfile
    inter: InterconnectProfile
    ranks_per_node: int

    def seconds(self, c: Collective) -> float:
        bw = self.intra.per_rank_bandwidth(1, c.kind)
        lat = self.intra.latency_s
        if c.inter_node:  # the ring's slowest hop sets its pace
            bw = min(bw, self.inter.per_rank_bandwidth(self.ranks_per_node, c.kind))
            lat = max(lat, self.inter.latency_s)
        return c.steps * lat + c.sent_bytes / bw

    def fixed_seconds(self, c: Collective) -> float:
        """The part of `seconds` that does not grow with the bytes (the latency of each
        ring step): what one collective for several units pays once."""
        lat = self.intra.latency_s
        if c.inter_node:
            lat = max(lat, self.inter.latency_s)
        return c.steps * lat

    def wall_seconds(self, c: Collective) -> float:
        """How long `c` takes to complete where `seconds` is the CPU it uses (a CPU
        calibrated in CPU time: InterconnectProfile.wall_measured); else `seconds`."""
        link = self.intra
        if c.inter_node or not link.wall_measured:
            return self.seconds(c)
        bw = link.wall_measured.get(c.kind) or link.per_rank_bandwidth(1, c.kind)
        return c.steps * link.wall_latency_s + c.sent_bytes / bw


@dataclass(frozen=True)
class UnitWork:
    """Seconds of compute per unit and phase."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]


def unit_work(costs: list[UnitCost], shape: TransformerShape | None, tokens: int,
              seq_len: int, device: DeviceProfile, dtype_name: str, act_bytes: list[int],
              checkpointing: bool) -> tuple[UnitWork, float, float]:
    """(per-unit seconds, model FLOPs, hardware FLOPs) for `tokens` tokens on one rank.

    Matmuls run at the device's achievable rate, attention at its own fraction of it,
    non-matmul layers at the elementwise bandwidth. Forward is a third of the FLOPs,
    backward two thirds; activation checkpointing runs each block's forward once more
    inside backward (hardware FLOPs only). Each unit also pays the engine's own work
    (`DeviceProfile.unit_overhead_s`), half in forward, half in backward.
    """
    rate = device.flops(dtype_name)
    att_rate = rate * device.attention_efficiency
    ew_bw = device.elementwise_bandwidth or device.memory_bandwidth
    fwd, bwd = [], []
    model_flops = hw_flops = 0.0
    for c, acts in zip(costs, act_bytes):
        if shape is not None:
            block_mm = c.layers * shape.block_matmul_flops_per_token() * tokens
            block_att = c.layers * shape.attention_flops_per_token(seq_len) * tokens
            other = shape.root_flops_per_token() * tokens if c.head else 0.0
            # Parameters the shape does not explain: assume they are matmul weights.
            explained = c.layers * shape.block_params() + (shape.root_params() if c.head else 0)
            other += 6 * max(0, c.numel - explained) * tokens
        else:
            block_mm = block_att = 0.0
            other = 6.0 * c.numel * tokens  # every parameter in a matmul
        block_s = block_mm / rate + block_att / att_rate
        seconds = block_s + other / rate
        blocks = block_mm + block_att
        model_flops += blocks + other
        hw_flops += blocks + other + (blocks / 3 if checkpointing else 0.0)
        elementwise = ELEMENTWISE_PASSES * acts / ew_bw
        # The engine's own work per unit (hooks, issuing its collectives), half each way.
        engine = device.unit_overhead_s / 2
        fwd.append(seconds / 3 + elementwise / 3 + engine)
        bwd.append(2 * seconds / 3 + (block_s / 3 if checkpointing else 0.0)
                   + 2 * elementwise / 3 + engine)
    return UnitWork(tuple(fwd), tuple(bwd)), model_flops, hw_flops


def overlapped_step(work: UnitWork, colls: list[Collective], links: Links,
                    optimizer_s: float, sync_all_reduce: bool,
                    limits: Limits = DEFAULT_LIMITS,
                    copy_s: Callable[[str, int], float] | None = None,
                    reshard_after_forward: bool | None = None,
                    terms: Sequence[Coalesce | None] | None = None) -> float:
    """Seconds per step with communication on its own stream, in the engine's order.

    The order is the engine's own: its `Schedule` drives clock-keeping units
    (timed_replay.py), so prefetching, `limits` and the reduce drain are the engine's
    decisions. `sync_all_reduce`: HYBRID's cross-replica all-reduce runs inside
    finish_reduce on the training thread, so compute waits for it. `copy_s(kind, unit)`:
    the seconds of the unit's local copies of each kind ([Note: local copies]).
    """
    replay = step_replay(work, colls, links, sync_all_reduce, limits, copy_s,
                         reshard_after_forward=reshard_after_forward, terms=terms)
    return replay.step_seconds() + optimizer_s


def step_replay(work: UnitWork, colls: list[Collective], links: Links,
                sync_all_reduce: bool, limits: Limits = DEFAULT_LIMITS,
                copy_s: Callable[[str, int], float] | None = None,
                overlap: bool = True, wall_per_second: float = 1.0,
                reshard_after_forward: bool | None = None,
                terms: Sequence[Coalesce | None] | None = None) -> Replay:
    """The time replay `overlapped_step` runs (not run yet): collectives priced by `links`.
    `overlap=False`: the collectives take the training thread's cores (a CPU's gloo) and
    complete after their wall-clock time (`Links.wall_seconds`, counted in the replay's
    seconds: divided by `wall_per_second`, the profile's seconds_scale).
    `reshard_after_forward`: None reads it off `colls` (backward gathers), which one rank,
    gathering nothing, cannot show. `terms`: each unit's coalescing terms ([Note: coalesced
    units] in engine/core/schedule.py; simulate.terms), None: every unit alone."""
    by: dict[tuple[str, int, str], float] = {}
    wall: dict[tuple[str, int, str], float] = {}
    fixed: dict[tuple[str, int, str], float] = {}
    for c in colls:
        key = (c.kind, c.unit, c.phase)
        by[key] = by.get(key, 0.0) + links.seconds(c)
        fixed[key] = fixed.get(key, 0.0) + links.fixed_seconds(c)
        wall[key] = wall.get(key, 0.0) + links.wall_seconds(c) / wall_per_second
    # Gathers are listed per phase; reductions are all "backward".
    reshard = (any(c.kind == "all_gather" and c.phase == "backward" for c in colls)
               if reshard_after_forward is None else reshard_after_forward)
    return Replay(work.forward_s, work.backward_s,
                  lambda kind, unit, phase: by.get((kind, unit, phase), 0.0),
                  reshard_after_forward=reshard, sync_all_reduce=sync_all_reduce,
                  limits=limits, copy_s=copy_s, overlap=overlap,
                  wire=lambda kind, unit, phase: wall.get((kind, unit, phase), 0.0),
                  terms=terms, fixed=lambda kind, unit, phase: fixed.get((kind, unit, phase),
                                                                         0.0))


def serial_step(work: UnitWork, colls: list[Collective], links: Links,
                optimizer_s: float, copies_s: float = 0.0) -> float:
    """Seconds per step when nothing overlaps: compute + every collective + local copies +
    optimizer."""
    return (sum(work.forward_s) + sum(work.backward_s)
            + sum(links.seconds(c) for c in colls) + copies_s + optimizer_s)


# CPU offload. The optimizer then steps in host memory: a server streams ~150-300 GB/s
# shared by its 8 ranks, and torch's per-parameter CPU Adam reaches a fraction of that.
HOST_OPTIMIZER_BANDWIDTH = 20e9  # bytes/s per rank
# Shards go host -> device for every all-gather, gradients device -> host after each
# reduction, over PCIe 4.0 x16 (~25 GB/s per direction in practice).
PCIE_BANDWIDTH = 25e9


def optimizer_seconds(optimizer: str, state_bytes: int, device: DeviceProfile,
                      on_host: bool = False, tensors: int = 0) -> float:
    """`OPTIMIZER_PASSES` over the local state at the device's optimizer rate, plus the
    fixed cost of each of the `tensors` parameters it steps."""
    if optimizer == "none":
        return 0.0
    if on_host and not device.is_cpu:
        bw = HOST_OPTIMIZER_BANDWIDTH
    else:
        bw = device.optimizer_bandwidth or device.memory_bandwidth
    return OPTIMIZER_PASSES[optimizer] * state_bytes / bw + tensors * device.optimizer_tensor_s


def offload_seconds(costs: list[UnitCost], gathers: int) -> float:
    """PCIe copies under CPU offload: each gather copies the shards up, each reduction
    copies the gradient shard down."""
    moved = sum(gathers * c.shard_bytes + c.grad_bytes for c in costs)
    return moved / PCIE_BANDWIDTH
