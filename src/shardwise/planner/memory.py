"""What one rank holds: model states term by term, per unit, from the engine's layout.

[Note: layout] (engine/core/sharded_param.py) decides every byte here: a parameter of D0 rows is
padded to S * C rows, C = ceil(D0 / S); each rank *allocates* a (C, ...) buffer and owns the
valid rows [r*C, min((r+1)*C, D0)) of it. Rank 0 always owns a full C rows, so it holds the
most: plans are for rank 0 (`rank=` plans another). The optimizer sees only the valid rows,
so its state is sized by them. Rows are slices along the parameter's shard dim, chosen by the
engine's own rule ([Note: balanced shards], engine/core/layout.py); `balance.py` reports how
far rank 0 still sits above the mean.

ZeRO's accounting (Rajbhandari et al. 2020) for mixed-precision Adam is 16 bytes per
parameter: 2 (fp16 params) + 2 (fp16 grads) + 12 (fp32 master, momentum, variance). Here the
sharded parameter *is* the fp32 master (4) and gradients are reduced into fp32 (4), with two
fp32 Adam moments (8): the same 16, divided by the shard-group size. The 16-bit copy exists
only while a unit is unsharded, which is why it appears under `unsharded`, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checkpoint.quantize import NF4, nf4_bytes
from ..engine.core.layout import balanced_shard_dim
from ..engine.core.policies import MixedPrecisionPolicy
from .units import PlanUnit

# Optimizer -> fp32 state tensors per parameter, and whether it keeps a step counter.
OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "adamw": (2, True),  # exp_avg and exp_avg_sq, plus a 0-d fp32 `step` per parameter
    "adam": (2, True),
    "sgd-momentum": (1, False),  # momentum_buffer
    "sgd": (0, False),
    "none": (0, False),
}
STEP_COUNTER_BYTES = 4  # torch keeps Adam's `step` as a 0-d float32 tensor per parameter


# [Note: NF4 dequantization] torchao's NF4Tensor computes a linear layer by dequantizing its
# whole weight (`get_original_weight`, inside the layer's forward and again in its backward),
# and every intermediate of that function is alive at its end: two int64 index arrays of
# numel / 2 (8 bytes a value), the two looked-up halves, the two scaled halves and their
# stacked result, each numel / 2 or numel in the model's dtype (3 x its size a value).
# Measured (torchao 0.18, `planner.measure.measure_dequant_bytes`): 20.0 bytes a value in
# fp32, 14.0 in bf16, 8 + 3 x the dtype's size; tests/unit/test_plan_finetune.py holds the
# two together. The peak is transient: once the matmul has the weight, all of it is freed.
DEQUANT_INDEX_BYTES = 8  # the int64 codes, two arrays of numel / 2
DEQUANT_COPIES = 3  # values in the model's dtype alive at the peak, per weight value


def dequant_bytes(numel: int, dtype: torch.dtype, compute: torch.dtype | None = None) -> int:
    """Peak bytes of dequantizing an NF4 weight of `numel` values held in `dtype`, plus its
    cast to the `compute` dtype (mixed precision: torchao dequantizes in the weight's own
    dtype, then casts)."""
    cast = _size(compute) if compute is not None and compute != dtype else 0
    return numel * (DEQUANT_INDEX_BYTES + DEQUANT_COPIES * _size(dtype) + cast)


def parse_optimizer(value: str) -> str:
    key = str(value).strip().lower().replace("_", "-")
    if key not in OPTIMIZERS:
        raise ValueError(f"optimizer={value!r} is not one of: {', '.join(OPTIMIZERS)}")
    return key


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class UnitCost:
    """One unit on one rank, in bytes unless named numel.

    shard_bytes: this rank's padded shard buffers, original dtype.
    grad_bytes: this rank's sharded gradients after the reduction (views into the
      reduce-scatter output when its dtype is the parameters' own).
    state_bytes: valid local bytes of grad-requiring parameters (one optimizer slot: torch
      creates state like the parameter, so in the master dtype).
    state_params: grad-requiring parameters (one optimizer step counter each).
    largest_state_bytes: the largest such local parameter (per-parameter temporaries).
    gather: (compute dtype, one rank's all-gather chunk numel) per communication group.
    reduce: (reduce dtype, one rank's gradient chunk numel with its flags, device bytes left
        as gradients)
      per group (0 under CPU offload: the gradients move to the host).
    unsharded_bytes: full padded parameters in the compute dtype while unsharded (0: direct).
    full_grad_bytes: unsharded gradients autograd produces, compute dtype, exact shapes.
    direct: one shard rank without casts (NO_SHARD's plain parameters, or whole DTensor
      ones): the shard is the parameter's storage, no copy is ever made.
    cast_grad_bytes: reduced gradients copied into the master dtype or to the host (the rest
      are views of the reduction's output).
    frozen_bytes: the part of shard_bytes that trains nothing (a fine-tune's frozen base).
    dequant_bytes: the peak of dequantizing the unit's largest NF4 weight ([Note: NF4
      dequantization]), alive for a moment in its forward and again in its backward.
    """

    name: str
    numel: int
    layers: int
    head: bool
    shard_bytes: int
    grad_bytes: int
    state_bytes: int
    state_params: int
    largest_state_bytes: int
    gather: tuple[tuple[torch.dtype, int], ...]
    reduce: tuple[tuple[torch.dtype, int, int], ...]
    unsharded_bytes: int
    full_grad_bytes: int
    direct: bool
    cast_grad_bytes: int = 0
    frozen_bytes: int = 0
    dequant_bytes: int = 0


def unit_cost(unit: PlanUnit, shard_size: int, shard_rank: int,
              mp: MixedPrecisionPolicy | None, host_offload: bool,
              plain: bool = True, replicate_size: int = 1, balance: bool = True,
              nf4: NF4 | None = None, quantized: frozenset[str] = frozenset()) -> UnitCost:
    """Byte counts of `unit` on shard-group rank `shard_rank` of `shard_size`.

    plain: the sharded parameters are plain tensors (NO_SHARD without TP); False where they
    are DTensors (every other strategy, on a one-rank mesh too), which on one shard rank
    without TP are whole and cost as direct ones do.
    replicate_size: replicas of the shard group (NO_SHARD: the world); with more than one,
    even direct gradients go through the packed all-reduce, flags included.
    balance: each parameter sharded on the engine's default dim ([Note: balanced shards] in
    engine/core/layout.py); False: dim 0, as the engine does under tensor parallelism.
    nf4 / quantized: a QLoRA base: the parameters named in `quantized` are held as torchao
    NF4 shards of spec `nf4` (checkpoint/quantize.py), which gather through their own hooks
    as bytes ([Note: all-gather extensions] in engine/core/extension.py).
    """
    S, r = shard_size, shard_rank
    shard = state = state_params = largest = unsharded = full_grads = frozen = dequant = 0
    gather: dict[torch.dtype, int] = {}
    grad_chunk: dict[torch.dtype, int] = {}
    flag_count: dict[torch.dtype, int] = {}
    converted: dict[torch.dtype, int] = {}  # grads cast back to the master dtype (bytes)
    viewed: dict[torch.dtype, bool] = {}  # some grads are views of the reduction output
    direct_all = True
    indirect: set[torch.dtype] = set()  # compute dtypes with a grad param that is not direct
    for p in unit.spec.params:
        dims = p.shape if p.shape else (1,)  # a 0-d parameter is one row
        d = balanced_shard_dim(dims, S) if balance else 0
        dim0, row = dims[d], math.prod(n for i, n in enumerate(dims) if i != d)
        C = -(-dim0 // S)
        # Rows this rank holds (a 0-d parameter: its one row on every rank, as ShardedParam).
        local = row if not p.shape else (min((r + 1) * C, dim0) - min(r * C, dim0)) * row
        if p.fqn in quantized and nf4 is not None:
            # dim 0 and even ([Note: NF4 by rows]): C rows of this rank's, no padding. The
            # shard is the NF4 tensor's inner tensors; its all-gather moves codes, scalers
            # and factors packed as bytes, which stay as the unsharded NF4 weight.
            held = nf4_bytes(C * row, nf4, p.dtype)
            moved = (held["quantized_data"] + held["quantized_scalers"]
                     + held["quantization_factor"])
            shard += sum(held.values())
            frozen += sum(held.values())
            gather[torch.uint8] = gather.get(torch.uint8, 0) + moved
            unsharded += S * moved
            compute = mp.param_dtype if mp and mp.param_dtype else p.dtype
            dequant = max(dequant, dequant_bytes(p.numel, p.dtype, compute))
            direct_all = False
            continue
        orig = _size(p.dtype)
        cdtype = mp.param_dtype if (mp and mp.param_dtype and p.dtype.is_floating_point) \
            else p.dtype
        csize = _size(cdtype)
        # As ShardedParam: a 0-d parameter is never direct (forward must see shape ()); a
        # DTensor one on a one-rank shard group is whole, which costs the same (its unsharded
        # parameter is the shard's storage, [Note: one rank's parameters]); a TP one is
        # neither (forward computes with the TP DTensor).
        direct = (S == 1 and cdtype == p.dtype and not host_offload and len(p.shape) > 0
                  and (plain or balance))
        direct_all &= direct
        shard += C * row * orig  # the padded (C, ...) buffer exists on every rank
        if not p.requires_grad:
            frozen += C * row * orig
        gather[cdtype] = gather.get(cdtype, 0) + C * row
        if not direct:
            unsharded += S * C * row * csize  # (S*C, ...) storage while the unit is unsharded
        if p.requires_grad:
            state += local * orig
            state_params += 1
            largest = max(largest, local * orig)
            full_grads += p.numel * csize
            # Plus one "has a gradient" flag per parameter in each rank's row of the reduce
            # buffer (engine/core/unit.py, [Note: unused gradients]).
            grad_chunk[cdtype] = grad_chunk.get(cdtype, 0) + C * row + 1
            flag_count[cdtype] = flag_count.get(cdtype, 0) + 1
            if not direct:
                indirect.add(cdtype)
            rdtype = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or cdtype
            if rdtype == p.dtype and not host_offload:
                viewed[cdtype] = True
            else:
                converted[cdtype] = converted.get(cdtype, 0) + local * orig
    reduce = []
    grads = 0
    for cdtype, n in grad_chunk.items():
        rdtype = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or cdtype
        # Only direct gradients with one rank in the world reduce nothing (engine/core/unit.py
        # returns early): they are autograd's own, without flags. Any other group's
        # gradients are views of the packed buffer, one flag per parameter included.
        skipped = S * replicate_size == 1 and cdtype not in indirect
        flags = flag_count.get(cdtype, 0) if skipped else 0
        kept = ((n - flags) * _size(rdtype) if viewed.get(cdtype) else 0) \
            + converted.get(cdtype, 0)
        reduce.append((rdtype, n, 0 if host_offload else kept))
        grads += kept
    return UnitCost(
        name=unit.name, numel=unit.numel, layers=unit.layers, head=unit.head,
        shard_bytes=shard, grad_bytes=grads, state_bytes=state, state_params=state_params,
        largest_state_bytes=largest, gather=tuple(gather.items()), reduce=tuple(reduce),
        unsharded_bytes=unsharded, full_grad_bytes=full_grads,
        direct=direct_all and bool(unit.spec.params),
        cast_grad_bytes=sum(converted.values()), frozen_bytes=frozen, dequant_bytes=dequant,
    )


@dataclass(frozen=True)
class ModelStates:
    """Per-rank model states, term by term (bytes)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    optimizer_temp_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_states(costs: list[UnitCost], optimizer: str, foreach: bool) -> ModelStates:
    slots, counter = OPTIMIZERS[optimizer]
    # Sharded parameters: fp32 masters, padded to C rows (rank 0's C rows are all valid).
    params = sum(c.shard_bytes for c in costs)
    # Sharded gradients after the step's reduction, kept until zero_grad().
    grads = sum(c.grad_bytes for c in costs)
    # Optimizer state: `slots` tensors shaped like each valid local shard (fp32 masters),
    # plus Adam's per-parameter step counter.
    state = sum(c.state_bytes for c in costs)
    optim = slots * state + (STEP_COUNTER_BYTES * sum(c.state_params for c in costs)
                             if counter else 0)
    # Temporaries inside optimizer.step(): torch's Adam computes sqrt(v)/bias + eps out of
    # place: the foreach path for all local parameters at once (one list of temporaries),
    # the per-parameter path for one parameter at a time (measured on CPU, torch 2.13: up to
    # three parameter-sized temporaries alive at once).
    if slots == 2:
        temp = state if foreach else 3 * max((c.largest_state_bytes for c in costs), default=0)
    else:
        temp = 0
    return ModelStates(params, grads, optim, temp)
