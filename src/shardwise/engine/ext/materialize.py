"""Deferred initialization: a model built on the meta device gets only its local shards."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..core.checks import check_int, check_module
from ..core.inspect import sharded_params, units_of
from ..core.sharded_param import ShardedParam
from .full_init import FullShapeInit, fill_sentinel, initializer, still_unfilled, unfilled
from .model_group import ModelGroup


def materialize(
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    seed: int | None = None,
) -> nn.Module:
    """Allocate the local shards of a sharded meta-device model, then initialize them.

    Each module's initializer runs in `model.modules()` order: `init_fn(module)` when
    given, else the module's own `reset_parameters()`. It runs while the module holds
    *full* tensors of its own parameters, the same on every rank; each rank keeps its rows
    and frees them before the next module ([Note: full-shape init] in full_init.py), so at
    most one initializer's parameters are ever full. So every initializer sees the full
    shape and keeps its meaning (xavier's fan_out, orthogonal_ over the whole matrix, a
    std from the full fan-out), and the model is the unsharded model initialized the same
    way after `torch.manual_seed(seed)`: bit for bit on the CPU, whatever the world size or
    sharding strategy. An initializer that writes its submodules' parameters (nn.
    MultiheadAttention's) is run again with those full too; one that writes them through
    `.data` writes this rank's views.

    `reset_parameters()` sees plain tensors. `init_fn` sees DTensors replicated on the
    parameter's mesh, as after FSDP2's `to_empty`: `param.shape` is the full shape, nn.init
    works on them, and a full tensor it builds goes in with
    `param.copy_(distribute_tensor(full, param.device_mesh, param.placements))`.
    Parameters that are not sharded (ignored ones) are plain tensors.

    Every rank draws from `seed`. Without it, the model's first rank (rank 0 when the
    model runs on every rank) draws one and every rank of the model uses it (ranks seeded
    differently, as `torch.manual_seed(base + rank)` does, still start identical);
    buffers and ignored parameters take the first rank's values. Both go over the model's
    ranks only ([Note: model ranks] in model_group.py): ranks outside a subgroup model may
    do anything meanwhile.
    peft LoRA layers re-run their own adapter init after the pass ([Note: LoRA init]): B
    starts at zero whatever `init_fn` did to it, so an adapted model starts as its base.
    Parameters and buffers on the meta device must be written by an initializer: one left
    unwritten (nn.MultiheadAttention's `in_proj_weight`, which it initializes in
    `_reset_parameters`; a non-persistent buffer such as rotary `inv_freq`, which a
    meta-device constructor could not compute) is refused by name, on every rank, rather
    than left at zero or garbage.
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
        # Full tensors are cut by dim 0 only; a TP piece is cut by another dim too.
        raise ValueError(
            f"materialize does not support tensor-parallel parameters ({tp_split[0]}, ...): "
            "build the model on a real device before parallelize_module, or load its "
            "weights with sw.load_full_state_dict / sw.load_checkpoint")
    fresh_sps = [sp for sp in sharded_params(model) if sp.is_meta]
    for sp in fresh_sps:
        sp.materialize()
        fill_sentinel(sp.local)  # padding rows stay zero
    fresh: dict[str, tuple[dict, str]] = {}  # name -> (module._buffers/_parameters, key)
    replicated: list[tuple[dict, str]] = []
    for mname, m in model.named_modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = unfilled(b.shape, b.dtype, device)
                replicated.append((m._buffers, name))
                fresh[f"{mname}.{name}" if mname else name] = (m._buffers, name)
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:  # ignored parameters: replicated, not sharded
                m._parameters[name] = nn.Parameter(unfilled(p.shape, p.dtype, device),
                                                   p.requires_grad)
                replicated.append((m._parameters, name))
                fresh[f"{mname}.{name}" if mname else name] = (m._parameters, name)
    group = ModelGroup.of_units(units)
    if seed is None:
        drawn = torch.tensor([int(torch.randint(0, 2**31 - 1, ()).item())], dtype=torch.int64)
        seed = int(group.broadcast(drawn.to(device), label="materialize seed").item())
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        # One stream for every rank: each full tensor is the same draw everywhere.
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            # A parameter with no rows initializes zero elements.
            warnings.filterwarnings("ignore", message=".*zero-element tensors.*")
            # Not an error: DTensor's random ops on a CPU mesh draw from the (seeded) local
            # generator, which on replicated DTensors is the one stream above.
            warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
            init = FullShapeInit(model, device, as_dtensor=init_fn is not None)
            with torch.no_grad(), init.views():
                for m in model.modules():
                    call = initializer(m, init_fn)
                    if call is not None:
                        init.run(m, call)
                _reset_adapters(model, init.run)
    # Buffers and ignored parameters are replicated, not sharded: the first rank's values
    # are everyone's, whatever an initializer did per rank.
    if group.size > 1:
        for coll, name in replicated:
            if coll.get(name) is not None:
                group.broadcast(coll[name].data, label=f"materialize {name}")
    _refuse_unwritten(fresh, fresh_sps, group, device)
    return model


def _refuse_unwritten(fresh: dict[str, tuple[dict, str]], fresh_sps: list[ShardedParam],
                      group: ModelGroup, device: torch.device) -> None:
    """Refuse, by name and on every rank, what was on meta and still holds the sentinel."""
    # A shard's rows are one rank's view: a parameter is unwritten where no rank with rows
    # saw a value (one MAX over the model's ranks; ranks with no rows see nothing).
    flags = torch.tensor([int(still_unfilled(sp.local)) for sp in fresh_sps] or [0],
                         dtype=torch.int32, device=device)
    if fresh_sps and group.size > 1:
        group.max_(flags, label="materialize unwritten")
    names = [sp.fqn for sp, f in zip(fresh_sps, flags.tolist()) if f]
    names += [k for k, (coll, key) in fresh.items()
              if coll.get(key) is not None and still_unfilled(coll[key])]
    if names:
        raise ValueError(
            f"{names} were on the meta device and no initializer wrote them (materialize "
            "cannot know their values; they would have started as NaN or zero). Write them "
            "in the module's reset_parameters() or in init_fn (nn.MultiheadAttention "
            "initializes in _reset_parameters: call it from init_fn; recompute rotary "
            "inv_freq there), load them (sw.load_full_state_dict, sw.load_pretrained), or "
            "create them outside the meta device")


def lora_adapters(model: nn.Module) -> Iterator[tuple[nn.Module, str, object]]:
    """(peft LoRA layer, adapter name, its `init_lora_weights`) for every adapter of
    `model`, in module order. Recognized by peft's methods (duck typed: shardwise does not
    import peft)."""
    configs = getattr(model, "peft_config", None) or {}
    for m in model.modules():
        reset = getattr(m, "reset_lora_parameters", None)
        adapters = getattr(m, "lora_A", None)
        if not callable(reset) or not isinstance(adapters, nn.ModuleDict):
            continue
        for name in adapters.keys():
            yield m, name, getattr(configs.get(name), "init_lora_weights", True)


def _reset_adapters(model: nn.Module,
                    run: Callable[[nn.Module, Callable[[], object]], None]) -> None:
    """[Note: LoRA init] peft's LoRA layers initialize their own children (A random, B zero,
    so the adapted model starts as the base model). The pass above reached those children as
    plain `nn.Linear`s (a model's `_init_weights` or `reset_parameters` draws B non-zero), so
    each LoRA layer re-runs its own adapter init last. Recognized by peft's method (duck
    typed: shardwise does not import peft); the init kind comes from the model's peft_config.
    """
    for m, name, init in lora_adapters(model):
        if init is not True and init is not False and init != "gaussian":
            raise ValueError(
                f"materialize cannot recreate init_lora_weights={init!r} (adapter "
                f"{name!r}): it needs the base weights. Materialize or load the base "
                "model first, then add the adapter (or use init_lora_weights=True)")
        # At full shape, like every initializer: the adapters are the layer's children.
        run(m, functools.partial(m.reset_lora_parameters, name, init))
