"""`plan(...)`: will it fit, and how fast, before anything is allocated.

Memory comes from the engine's own unit assignment and padding ([Note: layout]) replayed
over two steps (planner/simulate.py); time from FLOPs, ring-collective bytes and a device
and interconnect profile (planner/timing.py). Every number is per rank, for the rank that
holds the most (rank 0).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from ..checkpoint.quantize import NF4, refusal, resolve, splits_evenly
from ..engine.core.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    WrapPolicyLike,
    check_bool,
    check_coalesce_bytes,
    check_int,
    dtype_name,
)
from . import timing as T
from . import tp as TP
from .activations import largest_batch, step_activations
from .balance import shard_balance
from .estimate import link_profiles, step_time
from .memory import model_states, parse_optimizer, unit_cost
from .profiles import (
    DeviceProfile,
    InterconnectProfile,
    device_profile,
    interconnect_profile,
)
from .result import PerRank, Plan
from .shape import TransformerShape, coerce_shape
from .simulate import PhasePeaks, StepActivations, simulate
from .units import ModelUnits, model_units, resolve_model


def _check_nf4(mu: ModelUnits, shard_size: int, spec: NF4) -> None:
    """The loader's refusal (checkpoint/quantize.py), before planning what cannot load."""
    bad = [f"{p.fqn} {list(p.shape)}" for u in mu.units for p in u.spec.params
           if p.fqn in mu.quantized and not splits_evenly(p.shape[0], p.shape[1], shard_size,
                                                          spec)]
    if bad:
        raise refusal(bad, shard_size, spec)


def _model_dtype(mu: ModelUnits) -> torch.dtype:
    """What a model computes in without mixed precision: the dtype most of its floating
    parameters are held in (fp32 for a count or a config)."""
    by: dict[torch.dtype, int] = {}
    for u in mu.units:
        for p in u.spec.params:
            if p.dtype.is_floating_point:
                by[p.dtype] = by.get(p.dtype, 0) + p.numel
    return max(by, key=lambda d: by[d]) if by else torch.float32


def _peak(peaks: PhasePeaks) -> int:
    return max(peaks.forward, peaks.backward, peaks.step)


def _layout(strategy: ShardingStrategy, world: int, per_node: int) -> tuple[int, int]:
    """(shard size, replicate size), as `mesh_for_strategy` (engine/core/policies.py)
    builds them."""
    if strategy is ShardingStrategy.NO_SHARD:
        return 1, world
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if world % per_node:
            raise ValueError(f"HYBRID_SHARD: ranks_per_node={per_node} does not divide "
                             f"world_size={world}")
        return per_node, world // per_node
    return world, 1


def plan(
    model_or_param_count: nn.Module | int | float | str | os.PathLike[str] | dict
    | TransformerShape,
    *,
    world_size: int,
    sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
    auto_wrap_policy: WrapPolicyLike = "transformer",
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    optimizer: str = "adamw",
    cpu_offload: bool | CPUOffloadPolicy = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    device: str | DeviceProfile | None = None,
    interconnect: str | InterconnectProfile | None = None,
    shape: TransformerShape | dict | None = None,
    ranks_per_node: int | None = None,
    rank: int = 0,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    tp_embeddings: str = "split",
    quantize: str | NF4 | None = None,
    coalesce_bytes: int | None = None,
) -> Plan:
    """Plan one training step of `model_or_param_count` on `world_size` ranks.

    model_or_param_count: a model (build it on the meta device: nothing is allocated), a
      Hugging Face config (a preset name such as "llama3-70b", a config.json path or folder,
      or the config as a dict; planner/hf_config.py), a TransformerShape, or a parameter
      count (planned as a GPT of `shape`, or of a guessed shape).
    batch_size: sequences per rank per step; with seq_len, enables activations and time.
    device / interconnect: profiles (names in planner.profiles, or calibrated ones); the
      device enables `fits`, the largest batch and time. `interconnect` links the nodes;
      ranks inside a node use the device's own link (NVLink).
    shape: the transformer's dimensions when the model does not carry them.
    ranks_per_node: defaults to the device's (8) or, without a device, the whole world.
    rank: the rank to plan (0 holds the most).
    tensor_parallel: TP degree t (Megatron plan on each block; FSDP over world_size / t
      ranks; planner/tp.py). TP groups are placed inside a node when t <= ranks_per_node.
    sequence_parallel: with TP, the residual stream (norms, block inputs) split by sequence
      across the TP group; all-gather + reduce-scatter replace each all-reduce.
    tp_embeddings: with TP, what the embedding and output head do: "split" across the TP
      group by vocabulary rows (the default: torchtitan's plan, loss parallel) or
      "replicate" (whole on every TP rank, as `shardwise train --parallel.tp` runs its GPT).
    quantize: None, "nf4" or `sw.NF4(...)`: the model's frozen linears held in NF4, as
      `sw.load_pretrained(model, path, quantize=...)` loads them (QLoRA: a peft model built
      on the meta device); their shards, gathers and dequantization are planned as torchao
      stores and computes them ([Note: NF4 dequantization] in planner/memory.py).
    coalesce_bytes: fully_shard's budget for small units sharing one all-gather and one
      reduce-scatter (None: the engine's default; 0: each unit alone), replayed as the
      engine runs it ([Note: coalesced units] in engine/core/schedule.py).

    A model with a context length (a GPT preset, a Hugging Face config) is planned for
    batch 1 at that length unless told otherwise (a note says so); without a sequence
    length the verdict is "model states fit; activations unknown", never a bare "fits".
    A plan that does not fit lists `alternatives`: changes that make it fit, cheapest
    first, each with its total and step time (planner/suggest.py). An option the plan
    does not use for this configuration says so in a note.
    """
    args = dict(world_size=world_size, sharding_strategy=sharding_strategy,
                auto_wrap_policy=auto_wrap_policy, mixed_precision=mixed_precision,
                optimizer=optimizer, cpu_offload=cpu_offload, batch_size=batch_size,
                seq_len=seq_len, activation_checkpointing=activation_checkpointing,
                device=device, interconnect=interconnect, shape=shape,
                ranks_per_node=ranks_per_node, rank=rank, tensor_parallel=tensor_parallel,
                sequence_parallel=sequence_parallel, tp_embeddings=tp_embeddings,
                quantize=quantize, coalesce_bytes=coalesce_bytes)
    what = model_or_param_count
    if not isinstance(what, (nn.Module, int, float)):  # read a config once, not per plan
        what = resolve_model(what, shape)
    p = plan_one(what, **args)
    if p.fits is False:
        from .suggest import MAX_WORLD, alternatives

        alts = alternatives(what, args, p, plan_one)
        notes = p.notes if alts else (*p.notes, (
            "nothing fits: no combination of up to three of bf16, activation checkpointing, "
            "a smaller micro-batch, tensor parallelism, another strategy, more ranks (up to "
            f"{MAX_WORLD:,}) and CPU offload brings the step under the device's memory"))
        p = dataclasses.replace(p, alternatives=alts, notes=notes)
    return p


def _unused(interconnect: object, dev: DeviceProfile | None, world: int, per_node: int,
            offload: bool, tp: int, sp: bool, tp_embeddings: str) -> list[str]:
    """One line for each option this configuration does not use (none is silently
    ignored)."""
    out = []
    if interconnect is not None and world <= per_node:
        name = getattr(interconnect, "name", interconnect)
        link = f" ({dev.intra_node})" if dev is not None else ""
        out.append(f"interconnect={name!r} is unused: all {world} ranks fit in one node "
                   f"({per_node} per node), linked by the device's own interconnect{link}")
    if offload and dev is not None and dev.is_cpu:
        out.append("cpu_offload is unused: the device is the host itself, nothing moves")
    elif offload and dev is None:
        out.append("cpu_offload without a device: model states counted as host memory, as "
                   "from a GPU; pass device= to check what the device holds")
    for name, on in (("sequence_parallel", sp),
                     ("tp_embeddings='replicate'", tp_embeddings == "replicate")):
        if on and tp == 1:
            out.append(f"{name} is unused: it needs tensor_parallel > 1")
    return out


def plan_one(
    model_or_param_count: nn.Module | int | float | str | os.PathLike[str] | dict
    | TransformerShape | ModelUnits,
    *,
    world_size: int,
    sharding_strategy: str | ShardingStrategy,
    auto_wrap_policy: WrapPolicyLike,
    mixed_precision: str | MixedPrecisionPolicy | None,
    optimizer: str,
    cpu_offload: bool | CPUOffloadPolicy,
    batch_size: int | None,
    seq_len: int | None,
    activation_checkpointing: bool,
    device: str | DeviceProfile | None,
    interconnect: str | InterconnectProfile | None,
    shape: TransformerShape | dict | None,
    ranks_per_node: int | None,
    rank: int,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    tp_embeddings: str = "split",
    quantize: str | NF4 | None = None,
    search_batch: bool = True,
    coalesce_bytes: int | None = None,
) -> Plan:
    """One plan, without alternatives (`search_batch`: bisect the largest batch)."""
    check_int("world_size", world_size, minimum=1)
    coalesce = check_coalesce_bytes(coalesce_bytes)
    TP.check_tp_embeddings(tp_embeddings)
    check_bool("sequence_parallel", sequence_parallel)
    tp = tensor_parallel
    TP.check_tp(tp, world_size, None)
    check_bool("activation_checkpointing", activation_checkpointing)
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, minimum=1)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)
    strategy = ShardingStrategy.parse(sharding_strategy)
    mp = MixedPrecisionPolicy.parse(mixed_precision)
    offload = CPUOffloadPolicy.parse(cpu_offload) is not None
    opt = parse_optimizer(optimizer)
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}={v!r} must be a positive int or None")
    dev = device_profile(device) if device is not None else None
    if interconnect is not None:
        interconnect_profile(interconnect, dev)  # an unknown name fails here, device or not
    shape = coerce_shape(shape)
    nf4 = resolve(quantize)
    if nf4 is not None and tp > 1:
        raise ValueError(f"quantize=nf4 with tensor_parallel={tp} is not supported: NF4 shards "
                         "a weight by rows over the FSDP ranks only")
    if nf4 is not None and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError("quantize=nf4 with NO_SHARD is not supported: NF4 weights gather "
                         "through FSDP2's all-gather hooks; use FULL_SHARD, SHARD_GRAD_OP or "
                         "HYBRID_SHARD")
    mu = model_units(model_or_param_count, auto_wrap_policy, shape, nf4)
    # TP: plan one rank of the dp group with 1/tp of each block ([planner/tp.py]).
    full_world, total_params = world_size, mu.numel
    if tp > 1:
        TP.check_tp(tp, world_size, mu.shape)
        mu = TP.split_units(mu, tp, sequence_parallel, tp_embeddings)
        world_size, rank = world_size // tp, rank // tp

    # A CPU "device" is this host: every rank on it, unless told otherwise.
    per_node = ranks_per_node or (min(dev.ranks_per_node, full_world)
                                  if dev and not dev.is_cpu else full_world)
    if not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive int")
    phys_per_node, per_node = per_node, max(1, per_node // tp)  # dp ranks per node
    S, R = _layout(strategy, world_size, per_node)
    if nf4 is not None:
        _check_nf4(mu, S, nf4)
    host_offload = offload and not (dev is not None and dev.is_cpu)
    reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    # [Note: DTensor parameters]: only NO_SHARD without TP keeps plain (maybe direct) ones.
    plain = strategy is ShardingStrategy.NO_SHARD and tp == 1
    balance = tp == 1  # the engine shards TP parameters on dim 0 ([Note: balanced shards])
    costs = [unit_cost(u, S, rank % S, mp, host_offload, plain, R, balance, nf4, mu.quantized)
             for u in mu.units]
    foreach = dev.optimizer_foreach if dev is not None else True
    states = model_states(costs, opt, foreach)
    spread = shard_balance(list(mu.units), S, lambda r: model_states(
        [unit_cost(u, S, r, mp, host_offload, plain, R, balance, nf4, mu.quantized)
         for u in mu.units],
        opt, foreach).model_states_bytes, balance)
    act_dtype = (mp.param_dtype if mp and mp.param_dtype else None) or _model_dtype(mu)
    act_bytes = torch.empty((), dtype=act_dtype, device="meta").element_size()
    notes = list(mu.notes)
    context = mu.shape.context_length if mu.shape is not None else 0
    if seq_len is None and context:
        seq_len = context
        if batch_size is None:
            batch_size = 1
            notes.append(f"activations and time for batch 1 x {context} tokens per rank, the "
                         "model's context length (pass batch_size and seq_len for another)")
        else:
            notes.append(f"seq_len: the model's context length, {context}")
    elif seq_len is not None and batch_size is None:
        # The documented default (--help: batch 1 unless --batch-size is given).
        batch_size = 1
        notes.append(f"activations and time for batch 1 x {seq_len} tokens per rank (pass "
                     "batch_size for another)")
    if host_offload:
        notes.append("CPU offload: parameters, gradients and optimizer state live in host "
                     "memory (host_bytes); the device holds gathered units and activations")
    notes += _unused(interconnect, dev, full_world, phys_per_node, offload, tp,
                     sequence_parallel, tp_embeddings)

    def peaks_for(batch: int | None) -> tuple[PhasePeaks, StepActivations | None]:
        tokens = batch * seq_len if (batch and seq_len) else None
        acts = step_activations(mu.shape, tokens, act_bytes, activation_checkpointing)
        on_device = 0 if host_offload else 1
        peaks = simulate(
            costs, shard_size=S, reshard_after_forward=reshard,
            acts=acts or StepActivations(),
            static_bytes=states.params_bytes * on_device + mu.buffers_bytes,
            optimizer_bytes=states.optimizer_bytes * on_device,
            optimizer_temp_bytes=states.optimizer_temp_bytes * on_device,
            scratch=dev is not None and dev.collective_scratch,
            coalesce_bytes=coalesce if R == 1 else 0)
        return peaks, acts

    peaks, acts = peaks_for(batch_size)
    if acts is None and batch_size and seq_len:
        notes.append("activations unknown: the model carries no transformer shape; pass shape=")
    elif acts is None and batch_size:
        notes.append(f"batch_size={batch_size} without seq_len (the model has no context "
                     "length): activations and time unknown; pass seq_len")
    elif acts is None:
        notes.append("no batch_size and seq_len, and no context length to assume: "
                     "activations and time unknown")
    else:
        notes.append("activations assume fused attention (scaled_dot_product_attention): no "
                     "seq_len x seq_len score matrix is kept")
    total = _peak(peaks)
    per_rank = PerRank(
        params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
        optimizer_bytes=states.optimizer_bytes, model_states_bytes=states.model_states_bytes,
        unsharded_bytes=peaks.unsharded, comm_buffers_bytes=peaks.comm_buffers,
        frozen_bytes=sum(c.frozen_bytes for c in costs), dequant_bytes=peaks.dequant,
        activations_bytes=peaks.activations if acts is not None else None,
        buffers_bytes=mu.buffers_bytes, optimizer_temp_bytes=states.optimizer_temp_bytes,
        peak_forward_bytes=peaks.forward, peak_backward_bytes=peaks.backward,
        peak_step_bytes=peaks.step, total_bytes=total,
        host_bytes=states.model_states_bytes if host_offload else 0,
    )

    usable = fits = max_batch = verdict = None
    if dev is not None:
        # The ranks of a CPU "device" share the host's memory.
        usable = dev.usable_bytes // (per_node if dev.is_cpu else 1)
        if acts is not None:
            fits = total <= usable
            verdict = "fits" if fits else "does not fit"
        elif total <= usable:  # unknown: activations could still break it
            verdict = "model states fit; activations unknown"
        else:
            fits, verdict = False, "does not fit, even without activations"
        if seq_len and mu.shape is not None and search_batch:
            max_batch = largest_batch(lambda b: _peak(peaks_for(b)[0]) <= usable)

    colls = T.collectives(costs, shard_size=S, replicate_size=R, reshard_after_forward=reshard,
                          ranks_per_node=per_node)
    link_names = None
    time = None
    links = (link_profiles(dev, interconnect, world_size, per_node, notes)
             if dev is not None else None)
    if links is not None and batch_size and seq_len:
        link_names = f"{links.intra.name}" + (
            f" + {links.inter.name}" if world_size > per_node else "")
        time = step_time(costs, colls, links, dev, mu, acts, act_dtype, opt, batch_size,
                     seq_len, activation_checkpointing, S, R, world_size,
                     host_offload, reshard, coalesce)
    elif interconnect is not None:
        link_names = interconnect if isinstance(interconnect, str) else interconnect.name

    if time is not None and per_rank.frozen_bytes:
        notes.append("time as for training every weight: a fine-tune computes no gradient "
                     "for its frozen weights (about a third of the matmul FLOPs less) and "
                     "dequantizes an NF4 base in every linear (not timed)")
    comm = T.comm_volume(colls)
    tpc = None
    if tp > 1 and mu.shape is not None:
        tpc = TP.tp_comm(mu.shape, tp, world_size, batch_size, seq_len, act_bytes,
                         activation_checkpointing, sequence_parallel, phys_per_node,
                         links.intra if links else None, links.inter if links else None)
        comm = TP.with_tp_comm(comm, tpc)
        if time is not None:
            time = TP.with_tp_time(time, tpc, dev, act_dtype)  # type: ignore[arg-type]
        notes.append(TP.describe(tpc))
    return Plan(
        params=total_params, world_size=full_world, sharding_strategy=strategy.value,
        shard_size=S, replicate_size=R, ranks_per_node=phys_per_node,
        mixed_precision=dtype_name(mp.param_dtype) if mp and mp.param_dtype else "fp32",
        optimizer=opt, cpu_offload=offload, batch_size=batch_size, seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        device=dev.name if dev else None, interconnect=link_names, units=len(mu.units),
        shape=mu.shape.to_dict() if mu.shape else None, per_rank=per_rank,
        comm=comm, time=time, usable_bytes=usable, fits=fits,
        max_batch_size=max_batch, notes=tuple(notes), verdict=verdict,
        tensor_parallel=tp, tp_comm=tpc, sequence_parallel=sequence_parallel and tp > 1,
        tp_embeddings=tp_embeddings if tp > 1 else None,
        shard_imbalance=spread.ratio, least_even=spread.describe(),
    )

