"""Mixed precision around the engine: the precision plan and a sharded fp16 gradient scaler.

The engine itself casts in `Unit` (all-gather in param_dtype, reduce in reduce_dtype, write
fp32 master gradients); this module explains that to a user and guards fp16 training.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..comm import collectives as C
from ..core import dtensor as DT
from ..core.context import ModelGroup, sharded_params, unit_of, units_of
from ..core.policies import check_bool, check_int, check_module, check_number, dtype_name
from ..core.schedule import ShardedState, TrainingState


def _names(dts: Iterable[torch.dtype]) -> str:
    return "/".join(sorted({dtype_name(d) for d in dts})) or "-"


def precision_plan(model: nn.Module) -> str:
    """One line: storage, compute, communication, reduction and master dtypes of `model`."""
    check_module("model", model)
    units = units_of(model)
    if not units:
        raise ValueError(f"{type(model).__name__} is not sharded")
    sps = sharded_params(model)
    compute = _names(p.compute_dtype for p in sps)
    reduce = _names(rd for u in units for rd in u.reduce_dtype_for.values())
    master = _names(p.orig_dtype for p in sps)
    out = {dtype_name(u.mp.output_dtype) for u in units if u.is_root and u.mp and u.mp.output_dtype}
    # NO_SHARD (shard groups of one rank) gathers nothing: parameters are whole on every
    # rank and gradients are all-reduced. Listing an all-gather dtype there would be false.
    gathers = any(u.mesh.shard_size > 1 for u in units)
    gather = (f"all-gather {compute}" if gathers
              else "no all-gather (whole parameters on every rank)")
    return (f"precision plan: storage {master} shards | compute {compute} | {gather} | "
            f"reduce {reduce} | optimizer master weights {master}"
            + (f" | outputs {'/'.join(sorted(out))}" if out else ""))


def recast_master(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store the master shards of `module`'s own unit in `dtype` (floating ones not already
    in it); return their FQNs. Between steps, before an optimizer is built: each changed
    parameter gets a new Parameter object (an optimizer holding the old one fails loudly).

    FSDP1 under Accelerate's mixed precision: a model loaded in bf16 gets fp32 master
    weights (Accelerate upcasts each FSDP1 flat parameter after wrapping; fsdp1.py's
    `_FlatParamView`). The compute dtype (param_dtype) is unchanged, so the unit's flat
    layout is too; the gather casts from the new master dtype.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


    unit = unit_of(module)
    if unit is None:
        raise ValueError(f"recast_master: {type(module).__name__} is not a sharded unit")
    if unit.state is not ShardedState.SHARDED or unit.training_state is not TrainingState.IDLE:
        raise RuntimeError(f"recast_master({unit.name or 'root'}): only between steps, "
                           f"while sharded (state {unit.state.name}, "
                           f"{unit.training_state.name})")
    changed = []
    for sp in unit.params:
        if sp.orig_dtype == dtype or not sp.orig_dtype.is_floating_point:
            continue
        if sp.subclass or sp.tp is not None:
            raise ValueError(f"recast_master: {sp.fqn} is a tensor-subclass or "
                             "tensor-parallel shard; its dtype cannot change after sharding")
        padded = sp.padded_shard.to(dtype)
        sp.orig_dtype = dtype
        if sp.spec is not None:
            meta = TensorMeta(sp.spec.shape, sp.spec.stride, dtype)
            sp.spec = DTensorSpec(sp.spec.mesh, sp.spec.placements, tensor_meta=meta)
        # What materialize does for a meta shard: new Parameter objects around new storage.
        # (ShardedParam has no public recast; sharded_param.py is the place for one.)
        sp._build(padded, meta=sp.is_meta)
        changed.append(sp.fqn)
    if changed:
        unit.set_params(unit.params)
    return changed


class ShardedGradScaler:
    """Loss scaling for fp16 with sharded gradients.

    Each rank sees only its shards, so an inf/nan may show up on one rank only; the found-inf
    flag is all-reduced (max) so every rank skips the same steps and the scale stays in step.
    The all-reduce runs over the ranks of the model whose parameters the optimizer holds
    ([Note: model ranks] in context.py): the world for a model on every rank (or an
    optimizer of plain parameters), the model's subgroup otherwise, so ranks that run another
    model (a pipeline's other stage) never join it.
    Methods follow torch.amp.GradScaler: scale(loss), unscale_(opt), step(opt), update().
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        check_number("init_scale", init_scale, positive=True)
        check_number("growth_factor", growth_factor, above=1.0)
        check_number("backoff_factor", backoff_factor, positive=True, below=1.0)
        check_int("growth_interval", growth_interval, minimum=1)
        check_bool("enabled", enabled)
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        self._growth_tracker = 0
        # Per optimizer (by id): found-inf agreed across ranks, set by unscale_.
        self._found_inf: dict[int, bool] = {}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.enabled or id(optimizer) in self._found_inf:
            return
        # One fused unscale-and-check per (device, dtype) group, as torch's GradScaler: the
        # found-inf flag stays on the device, so the only host read is the one below, after
        # the flag was reduced over the model's ranks (not one sync per parameter).
        by_group: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = DT.local_of(p.grad)  # the shard's rows; the flag is reduced below
                    by_group.setdefault((g.device, g.dtype), []).append(g)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if C.is_initialized() and C.backend() == "nccl" else torch.device("cpu"))
        flag = torch.zeros(1, device=device)
        with torch.no_grad():
            for (dev, _), grads in by_group.items():
                found = torch.zeros(1, device=dev)
                inv = torch.full((1,), 1.0 / self.scale_value, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                # Blocking when it leaves the GPU for the host (gloo): a non-blocking copy into
                # pageable memory would be read before it landed.
                flag = torch.maximum(flag, found.to(device))
        group = _model_group_of(optimizer)
        if C.is_initialized() and group.size > 1:
            for g in group.groups:  # [None] (one world all-reduce) unless on a subgroup
                C.all_reduce(flag, g, op="max", label="ShardedGradScaler (found inf)")
        self._found_inf[id(optimizer)] = bool(flag.item() > 0)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if needed and step unless any rank found inf/nan. True if it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        if not self.enabled:
            return
        if any(self._found_inf.values()):
            self.scale_value *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf.clear()

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale_value, "growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale_value = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])


def _model_group_of(optimizer: torch.optim.Optimizer) -> ModelGroup:
    """The ranks of the model(s) whose sharded parameters `optimizer` steps."""
    units: dict[int, object] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp = getattr(p, "_sw_param", None)
            owner = sp.owner if sp is not None else None
            if owner is not None:
                units.setdefault(id(owner), owner)
    return ModelGroup.of_units(units.values())
