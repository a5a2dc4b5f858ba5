"""Deferred initialization: a model built on the meta device gets only its local shards."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..core import dtensor as DT
from ..core.context import ModelGroup, sharded_params, units_of
from ..core.policies import check_int, check_module
from ..core.sharded_param import ShardedParam

# --------------------------------------------------------------------------------------------------
# Run a model's initializers at full shape, one module at a time, keeping this rank's rows.
#
# [Note: full-shape init] An initializer that runs on a rank's rows is not the unsharded
# model's initializer: xavier's fan_out is dim 0, the sharded one; orthogonal_ makes only
# the rows orthogonal; a draw per shard rank matches no unsharded run. So `materialize`
# calls each module's initializer (`init_fn(m)` or `m.reset_parameters()`, in
# `model.modules()` order, every rank seeded alike) while that module holds full tensors
# of its own parameters, then copies this rank's rows into the shard and frees them. Every
# rank draws the same full values, so the shards are the unsharded model's initialization,
# bit for bit where the random stream is the same (the CPU; on an accelerator, init_fn's
# DTensor ops draw through DTensor's generator). At most one initializer's parameters are
# full at once.
#
# An initializer may also write parameters of its submodules (nn.MultiheadAttention's
# `_reset_parameters` zeroes `out_proj.bias`). Those hold shard views meanwhile; a write to
# one is seen by its version counter, and the initializer runs again from the same random
# state with those parameters full too. A write through `.data` bumps no counter: it lands
# in the views as it is. The views are the same shape on every rank (padded shards for
# `reset_parameters`; DTensors, whose shape is the full one, for `init_fn`), so every rank
# runs the same code and the random streams stay together whatever an initializer does.


class FullShapeInit:
    """Runs initializers at full shape on one sharded model ([Note: full-shape init]).

    A full tensor starts as the unfilled sentinel: one that no initializer wrote is not
    copied over the shard, which keeps its values (or its own sentinel).
    """

    def __init__(self, model: nn.Module, device: torch.device, as_dtensor: bool) -> None:
        self.sps = sharded_params(model)
        # Where each sharded parameter is held: (id(module), name) -> its ShardedParam.
        self.owner = {(id(ref.module), ref.name): sp for sp in self.sps for ref in sp.refs}
        self.device = device
        # init_fn sees DTensors (FSDP2's convention); reset_parameters plain tensors.
        self.as_dtensor = as_dtensor

    def views(self) -> contextlib.AbstractContextManager[None]:
        """What modules hold for the whole pass: padded shard views for reset_parameters,
        the sharded DTensors (as they are) for init_fn."""
        return contextlib.nullcontext() if self.as_dtensor else _padded_views(self.sps)

    def run(self, m: nn.Module, call: Callable[[], object]) -> None:
        """`call()` (an initializer of `m`) with `m`'s own parameters full."""
        _init_module(m, call, self.owner, self.device, self.as_dtensor)


def initializer(m: nn.Module, init_fn: Callable[[nn.Module], None] | None
                ) -> Callable[[], object] | None:
    """What materialize runs for `m`: init_fn(m), else m.reset_parameters(), else nothing."""
    if init_fn is not None:
        return functools.partial(init_fn, m)
    reset = getattr(m, "reset_parameters", None)
    return reset if callable(reset) else None


def _init_module(m: nn.Module, call: Callable[[], object],
                 owner: dict[tuple[int, str], ShardedParam], device: torch.device,
                 as_dtensor: bool) -> None:
    own = {sp for name in m._parameters
           if (sp := owner.get((id(m), name))) is not None}
    below = [(sub, name) for sub in m.modules() if sub is not m
             for name in sub._parameters if (id(sub), name) in owner]
    rng = _rng_state(device)
    while True:
        fulls = {sp: unfilled(sp.orig_shape, sp.orig_dtype, device) for sp in own}
        # Every slot of these parameters under `m` (tied ones too) holds the full tensor.
        slots = [(sub, name) for sub in m.modules() for name in sub._parameters
                 if owner.get((id(sub), name)) in fulls]
        held = {slot: slot[0]._parameters[slot[1]] for slot in slots}
        for (sub, name) in slots:
            sp = owner[(id(sub), name)]
            sub._parameters[name] = nn.Parameter(_face(fulls[sp], sp, as_dtensor),
                                                 requires_grad=sp.requires_grad)
        watched = {slot: (t, t._version) for slot in below if slot not in held
                   and (t := slot[0]._parameters[slot[1]]) is not None}
        try:
            call()
        finally:
            for (sub, name), t in held.items():
                sub._parameters[name] = t
        touched = {owner[(id(s[0]), s[1])] for s, (t, v) in watched.items()
                   if t._version != v}
        if not touched:
            break
        # Written through a view: again from the same random state, those full as well.
        own |= touched
        _set_rng_state(device, rng)
    with torch.no_grad():
        for sp, full in fulls.items():
            if not still_unfilled(full):
                sp.local.copy_(sp.local_slice(full).to(sp.local.device))


def _face(full: torch.Tensor, sp: ShardedParam, as_dtensor: bool) -> torch.Tensor:
    """What the module holds while its initializer runs: the full tensor, as a DTensor
    replicated on the parameter's mesh for init_fn (FSDP2's convention: `device_mesh`,
    `placements` and `distribute_tensor(full, ...)` work), else plain."""
    if not as_dtensor or sp.spec is None or full.dim() == 0:
        return full
    spec = sp.spec
    meta = TensorMeta(full.shape, DT.contiguous_stride(full.shape), full.dtype)
    rep = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=meta)
    return DT.wrap(full, rep)


@contextlib.contextmanager
def _padded_views(sps: list[ShardedParam]) -> Iterator[None]:
    """Modules hold plain views of their padded shards while `reset_parameters` runs:
    the same shape on every rank (an empty shard would skip an initializer's draw on one
    rank only); padding rows are zeroed after."""
    for sp in sps:
        view = nn.Parameter(sp.from_rows(sp.padded_shard), requires_grad=sp.requires_grad)
        for ref in sp.refs:
            ref.module._parameters[ref.name] = view
    try:
        yield
    finally:
        for sp in sps:
            for ref in sp.refs:
                ref.module._parameters[ref.name] = sp.sharded
            with torch.no_grad():
                sp.padded_shard[sp.local_rows:].zero_()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    acc = torch.get_device_module(device.type) if device.type != "cpu" else None
    return torch.get_rng_state(), (acc.get_rng_state(device) if acc is not None else None)


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]
                   ) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


# Full tensors at least this large are mapped anonymously on the host, so that freeing one
# gives its pages back at once: from the C heap, glibc keeps them (its mmap threshold grows
# after the first large free), and a model's initializers added up in the resident set one
# module after another (a 4 x 16 MB model grew by 55 MB on a 16.8 MB shard).
_MAP_BYTES = 1 << 20


def unfilled(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor holding the sentinel that initializers overwrite."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and nbytes >= _MAP_BYTES:
        pages = mmap.mmap(-1, nbytes)  # unmapped when the last tensor on it is freed
        t = torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)
        return fill_sentinel(t)
    return fill_sentinel(torch.empty(shape, dtype=dtype, device=device))


def fill_sentinel(t: torch.Tensor) -> torch.Tensor:
    """`t`, filled in place with the unfilled sentinel: NaN, or the lowest integer (a bool
    has no value to spare: False)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(False)
    return t.fill_(torch.iinfo(t.dtype).min)


def still_unfilled(t: torch.Tensor) -> bool:
    """Whether `t` holds only the sentinel (never for an empty or bool tensor: nothing to
    fill, or no value left to mark "unfilled")."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    flat = t.reshape(-1)
    step = 1 << 20  # in pieces: a full-size boolean mask would be one more large buffer
    for i in range(0, flat.numel(), step):
        piece = flat[i : i + step]
        if t.is_floating_point() or t.is_complex():
            if not bool(torch.isnan(piece).all()):
                return False
        elif not bool((piece == torch.iinfo(t.dtype).min).all()):
            return False
    return True


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
    and frees them before the next module ([Note: full-shape init] in materialize.py), so at
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
    ranks only ([Note: model ranks] in context.py): ranks outside a subgroup model may
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
