"""Deferred initialization: a model built on the meta device gets only its local shards."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..core.checks import check_int, check_module
from ..core.inspect import sharded_params, units_of
from .model_group import ModelGroup


def materialize(
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    seed: int | None = None,
) -> nn.Module:
    """Allocate the local shards of a sharded meta-device model, then initialize them.

    Without `init_fn`, each module's `reset_parameters()` runs while the module holds plain
    views of its local shards, so no rank ever holds the whole model (dim-0 sharding leaves
    fan-in, dim 1, intact: standard initializers keep their scale).

    `init_fn(module)` is called on every module while it holds its sharded parameters as
    DTensors, as after FSDP2's `to_empty`: `param.shape` is the full shape, so an init that
    reasons about full shapes (a fused-QKV weight sliced by the model's dims, a std from
    the full fan-out) sees the same numbers as on the unsharded model; in-place writes land
    in this rank's shard; a full tensor it builds goes in with
    `param.copy_(distribute_tensor(full, param.device_mesh, param.placements))`.
    Parameters that are not sharded (ignored ones, one-element ones) are plain tensors.

    Each shard rank draws from its own random stream (seed + shard rank); replicas share
    it. (DTensor random ops on an accelerator mesh draw through DTensor's own generator,
    which gives every shard its part of one draw.)
    Without `seed`, the model's first rank (rank 0 when the model runs on every rank) draws
    one and every rank of the model uses it (ranks seeded differently, as
    `torch.manual_seed(base + rank)` does, must still start replicas identical); buffers and
    ignored parameters take the first rank's values. Both go over the model's ranks only
    ([Note: model ranks] in model_group.py): ranks outside a subgroup model may do anything
    meanwhile.
    peft LoRA layers re-run their own adapter init after the pass ([Note: LoRA init]): B
    starts at zero whatever `init_fn` did to it, so an adapted model starts as its base.
    Buffers on the meta device must be filled by `reset_parameters()` or `init_fn`; one left
    unfilled (a non-persistent buffer such as rotary `inv_freq`, which a meta-device
    constructor could not compute) is refused by name rather than left as garbage.
    """
    check_module("model", model)
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn={init_fn!r} is not allowed: must be a callable "
                         "(module) -> None, or None")
    if seed is not None:
        check_int("seed", seed)
    units = units_of(model)
    if not units:
        raise ValueError(f"materialize needs a sharded model; {type(model).__name__} has none")
    device = units[0].mesh.device
    tp_split = [sp.fqn for sp in sharded_params(model) if sp.tp is not None and sp.tp.tp_sharded]
    if tp_split:
        # Streams are per shard rank: the TP ranks' different pieces would start identical.
        raise ValueError(
            f"materialize does not support tensor-parallel parameters ({tp_split[0]}, ...): "
            "build the model on a real device before parallelize_module, or load its "
            "weights with sw.load_full_state_dict / sw.load_checkpoint")
    for sp in sharded_params(model):
        sp.materialize()
    fresh: dict[str, tuple[nn.Module, str]] = {}
    replicated: list[tuple[dict, str]] = []  # (module._buffers or ._parameters, name)
    for mname, m in model.named_modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = _unfilled(b, device)
                replicated.append((m._buffers, name))
                fresh[f"{mname}.{name}" if mname else name] = (m, name)
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:  # ignored parameters: replicated, not sharded
                m._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                replicated.append((m._parameters, name))
    group = ModelGroup.of_units(units)
    if seed is None:
        drawn = torch.tensor([int(torch.randint(0, 2**31 - 1, ()).item())], dtype=torch.int64)
        seed = int(group.broadcast(drawn.to(device), label="materialize seed").item())
    base = seed
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        # Seeded by shard rank: shards are independent draws, while replicas of the same
        # shard (NO_SHARD, HYBRID_SHARD) draw the same values and start as one model.
        torch.manual_seed(base + units[0].mesh.shard_rank)
        with warnings.catch_warnings():
            # A rank whose shard of a small parameter is empty initializes zero elements.
            warnings.filterwarnings("ignore", message=".*zero-element tensors.*")
            # Not an error: DTensor's random ops on a CPU mesh draw from the (seeded) local
            # generator, which is exactly the per-shard-rank stream.
            warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
            plain = _plain_shards(model) if init_fn is None else contextlib.nullcontext()
            with torch.no_grad(), plain:
                for m in model.modules():
                    if init_fn is not None:
                        init_fn(m)
                    elif hasattr(m, "reset_parameters") and callable(m.reset_parameters):
                        m.reset_parameters()
                _reset_adapters(model)
    # Buffers and ignored parameters are replicated, not sharded, but their initializers
    # drew from each shard rank's own stream: the first rank's values are everyone's.
    if group.size > 1:
        for coll, name in replicated:
            if coll.get(name) is not None:
                group.broadcast(coll[name].data, label=f"materialize {name}")
    unfilled = [k for k, (m, name) in fresh.items()
                if m._buffers.get(name) is not None and _still_unfilled(m._buffers[name])]
    if unfilled:
        raise ValueError(
            f"buffers {unfilled} were on the meta device and no initializer filled them "
            "(materialize cannot know their values). Fill them in the module's "
            "reset_parameters() or in init_fn (e.g. recompute rotary inv_freq there), or "
            "create them outside the meta device")
    return model


def _reset_adapters(model: nn.Module) -> None:
    """[Note: LoRA init] peft's LoRA layers initialize their own children (A random, B zero,
    so the adapted model starts as the base model). The pass above reached those children as
    plain `nn.Linear`s (a model's `_init_weights` or `reset_parameters` draws B non-zero), so
    each LoRA layer re-runs its own adapter init last. Recognized by peft's method (duck
    typed: shardwise does not import peft); the init kind comes from the model's peft_config.
    """
    configs = getattr(model, "peft_config", None) or {}
    for m in model.modules():
        reset = getattr(m, "reset_lora_parameters", None)
        adapters = getattr(m, "lora_A", None)
        if not callable(reset) or not isinstance(adapters, nn.ModuleDict):
            continue
        for name in adapters.keys():
            init = getattr(configs.get(name), "init_lora_weights", True)
            if init is not True and init is not False and init != "gaussian":
                raise ValueError(
                    f"materialize cannot recreate init_lora_weights={init!r} (adapter "
                    f"{name!r}): it needs the base weights. Materialize or load the base "
                    "model first, then add the adapter (or use init_lora_weights=True)")
            reset(name, init)


@contextlib.contextmanager
def _plain_shards(model: nn.Module) -> Iterator[None]:
    """Modules hold plain views of their local rows while initializers run.

    On the DTensor parameters, an initializer would draw through DTensor's own random
    stream (offsets over the global tensor) instead of each shard rank's seeded stream
    above; the plain views share storage, so what the initializers write is the shard.
    """
    sps = sharded_params(model)
    for sp in sps:
        view = nn.Parameter(sp.local, requires_grad=sp.requires_grad)
        for ref in sp.refs:
            ref.module._parameters[ref.name] = view
    try:
        yield
    finally:
        for sp in sps:
            for ref in sp.refs:
                ref.module._parameters[ref.name] = sp.sharded


def _unfilled(b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real buffer holding a sentinel that initializers overwrite."""
    t = torch.empty(b.shape, dtype=b.dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def _still_unfilled(b: torch.Tensor) -> bool:
    if b.numel() == 0 or b.dtype == torch.bool:
        return False  # nothing to fill, or no value left to mark "unfilled"
    if b.is_floating_point() or b.is_complex():
        return bool(torch.isnan(b).all())
    return bool((b == torch.iinfo(b.dtype).min).all())
