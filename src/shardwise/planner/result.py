"""What `plan(...)` returns: the per-rank bytes, the verdict and what would fit instead."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import timing as T
from . import tp as TP
from .estimate import TimeEstimate


@dataclass(frozen=True)
class PerRank:
    """Bytes on one device. Each term is its own peak during the step; `total_bytes` is the
    peak of their sum (they do not all peak together: activations are gone before the
    optimizer's temporaries appear)."""

    params_bytes: int  # sharded parameters (the masters, frozen ones included), padded
    grads_bytes: int  # sharded gradients after the reduction
    optimizer_bytes: int  # optimizer state of the sharded parameters
    model_states_bytes: int  # the three above
    unsharded_bytes: int  # gathered units in the compute dtype, prefetch included
    comm_buffers_bytes: int  # pooled all-gather / reduce-scatter buffers, backend copies
    activations_bytes: int | None  # saved for backward (None: shape or batch unknown)
    buffers_bytes: int  # module buffers (replicated)
    optimizer_temp_bytes: int  # optimizer.step() temporaries
    peak_forward_bytes: int
    peak_backward_bytes: int
    peak_step_bytes: int
    total_bytes: int  # the step's peak: what must fit
    host_bytes: int  # model states moved to host memory by CPU offload
    # Of params_bytes, the parameters that train nothing (a LoRA run's frozen base; NF4
    # shards under QLoRA: codes, scalers and factors as torchao stores them).
    frozen_bytes: int = 0
    # The largest NF4 weight dequantized inside its linear, for a moment, in forward and
    # backward ([Note: NF4 dequantization] in planner/memory.py); 0 without NF4.
    dequant_bytes: int = 0


@dataclass(frozen=True)
class Alternative:
    """A change that makes a plan that does not fit, fit (planner/suggest.py)."""

    change: str  # e.g. "bf16 mixed precision + activation checkpointing", "world_size=16"
    total_bytes: int
    fits: bool | None
    step_s: float | None = None  # the optimizer step's time with the change (None: unknown)


@dataclass(frozen=True)
class Plan:
    params: int
    world_size: int
    sharding_strategy: str
    shard_size: int
    replicate_size: int
    ranks_per_node: int
    mixed_precision: str
    optimizer: str
    cpu_offload: bool
    batch_size: int | None
    seq_len: int | None
    activation_checkpointing: bool
    device: str | None
    interconnect: str | None
    units: int
    shape: dict[str, int | str | bool] | None
    per_rank: PerRank
    comm: T.CommVolume
    time: TimeEstimate | None
    usable_bytes: int | None
    fits: bool | None
    max_batch_size: int | None
    notes: tuple[str, ...]
    # "fits", "does not fit", "model states fit; activations unknown", "does not fit, even
    # without activations", or None without a device to fit on. Never a bare "fits" with
    # activations left out.
    verdict: str | None = None
    alternatives: tuple[Alternative, ...] = ()  # when it does not fit: what would
    # Tensor-parallel degree (FSDP shards over world_size / tensor_parallel ranks) and the
    # TP group's activation all-reduces (planner/tp.py); None without TP.
    tensor_parallel: int = 1
    tp_comm: TP.TPComm | None = None
    sequence_parallel: bool = False
    # With TP: "split" (the embedding and output head split by vocabulary rows, torchtitan's
    # plan) or "replicate" (whole on every TP rank); None without TP.
    tp_embeddings: str | None = None
    # Model states of rank 0 (the most) over the shard group's mean ([Note: balanced
    # shards]); 1.0 is perfectly even. `least_even`: the same in words, with the parameter
    # whose shards are least even (planner/balance.py).
    shard_imbalance: float = 1.0
    least_even: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: plain ints, floats, strings, lists and dicts."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        d["alternatives"] = [dataclasses.asdict(a) for a in self.alternatives]
        return d

    def __str__(self) -> str:
        from .report import describe

        return describe(self)
