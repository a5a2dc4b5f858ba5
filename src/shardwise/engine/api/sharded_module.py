"""The class a sharded module becomes: its original class with FSDP2's module methods mixed
in (so `isinstance` holds), refusing what would swap the shards behind the engine's back
(`.to(dtype)`, deepcopy) and allocating meta shards on `to_empty`; and how to tell that
`fully_shard` was called on a module itself.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm.transport import CustomTransport
from ..core.context import unit_of, units_of
from ..core.policies import check_bool, check_int, check_module, check_number
from ..core.schedule import ShardedState
from ..core.unit import Unit
from .state import ShardwiseState, state_of

# --------------------------------------------------------------------------------------------------
# Loud failures for mistakes that would otherwise train silently wrong.

_registered = False


def watch_optimizers() -> None:
    """Install (once) a check that no optimizer steps parameters replaced by sharding.

    fully_shard swaps each original parameter for a sharded one and empties the original.
    An optimizer built before sharding still holds the originals, which never get a
    gradient again: its step would do nothing, every step, without a word.
    """
    global _registered
    if _registered or os.environ.get("SHARDWISE_CHECK_OPTIMIZERS", "1") == "0":
        return
    _registered = True
    # The one process-wide hook shardwise installs (docs/design.md, "Global effects"): torch
    # has no per-parameter step hook, and an optimizer built before sharding cannot be told
    # apart from the parameters alone. It costs one attribute read per step once checked.
    register_optimizer_step_pre_hook(_check_step)


def _check_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    n = sum(len(g["params"]) for g in opt.param_groups)
    if getattr(opt, "_sw_checked", None) == n:
        return  # checked these parameters already (a new group changes the count)
    for g in opt.param_groups:
        for p in g["params"]:
            sp = getattr(p, "_sw_orig_of", None)
            if sp is not None:
                raise RuntimeError(
                    f"{type(opt).__name__} was built before sharding: it holds the original "
                    f"parameter {sp.fqn!r}, which sharding replaced, so its step would train "
                    "nothing. Build the optimizer after shard_model/fully_shard (from "
                    "model.parameters()), and after sw.materialize for meta-device models")
    opt._sw_checked = n  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------
# FSDP2's communication methods on a sharded module: gradient division, hooks on the
# reduced gradients, custom collectives, and the knobs that have nothing to change here.
#
# Part of [Note: FSDPModule identity] (sharded_module.py): each overrides FSDPModule's method of
# the same name, whose body would reach into FSDP2's internal state.




def _check_comm(what: str, comm: Any) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise ValueError(f"{what}: comm={comm!r} must implement FSDP2's Comm protocol "
                         "(an allocate(size, *, dtype, device) method and __call__)")


# --------------------------------------------------------------------------------------------------
# FSDP2's per-module methods on a sharded module, so an FSDP2 user ports by an import.
#
# [Note: FSDPModule identity] A sharded module's class derives from torch's own
# `torch.distributed.fsdp.FSDPModule`, so the frameworks that detect FSDP2 with
# `isinstance(m, FSDPModule)` (torchtitan disabling gradient division, Lightning's
# `no_backward_sync`, chunked losses) take their FSDP2 path on it. FSDPModule's methods reach
# into FSDP2's internal state, so *every* one of them is overridden here (or in
# sharded_module.py) to act on shardwise's units; tests/dist/fsdp2_identity_workers.py checks
# that none is inherited. `_get_fsdp_state()` returns shardwise's state view (state.py), not
# FSDP2's FSDPState.
#
# Each method acts on the unit of the module it is called on (and, with `recurse=True`, on
# every unit below it), as FSDP2's do. Where shardwise decides something itself (prefetch
# order, when to wait for reductions), the method is accepted, checked and documented as
# having nothing to change (docs/porting.md lists these).


class UnshardHandle(TorchUnshardHandle):
    """What `unshard(async_op=True)` returns: `wait()` makes the full parameters usable."""

    def __init__(self, unit: Unit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        # Only a gather still in flight is waited for. Once a forward consumed it (and
        # maybe resharded), waiting must not gather again: FSDP2's handle is then a no-op,
        # and a re-gather would leave plain full parameters on the module after the step.
        if self._unit is not None and self._unit.state is ShardedState.GATHERING:
            self._unit.wait_unshard()
        self._unit = None




def check_reshard_after_forward(value: object, shard_size: int | None = None) -> object:
    """FSDP2's forms: None (root False, others True), a bool, or an int group size: 1 is
    False, the shard-group size True, and a proper divisor k stays k (hpZ: reshard to
    blocks of k ranks after forward, [Note: hpZ] in core/unit.py)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward={value!r} must be None, a bool or an int "
                         "group size")
    if shard_size is None:
        return value
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(f"reshard_after_forward={value} as an int must be a divisor of the "
                         f"shard group size {shard_size}")
    if value == 1:
        return False
    if value == shard_size:
        return True
    return value


def _check_sharded_modules(what: str, modules: Iterable[Any]) -> None:
    mods = list(modules)
    bad = [type(m).__name__ for m in mods if unit_of(m) is None]
    if bad:
        raise ValueError(f"{what}: every module must be sharded with fully_shard; got "
                         f"unsharded {bad}")


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no communication) inside the block.

    The backward after the block reduces everything accumulated, so k micro-batches (each
    loss divided by k) give the same update as one batch k times larger.
    """
    check_module("model", model)
    units = units_of(model)
    if not units:
        raise ValueError(f"no_sync needs a sharded model; {type(model).__name__} has no units")
    before = [u.requires_grad_sync for u in units]
    for u in units:
        u.requires_grad_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.requires_grad_sync = b


class ShardedModule(FSDPModule):
    """Mixed into a sharded module's class, so `isinstance(m, OriginalClass)` still holds."""

    _sw_unit: Unit

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A sharded module is only ever made by fully_shard changing __class__. A *new*
        # instance (nn.Sequential's slice builds one with type(self)(...)) has no unit
        # behind it: make it a plain module of the original class.
        plain = next(c for c in cls.__mro__
                     if issubclass(c, nn.Module) and not issubclass(c, ShardedModule))
        obj = plain.__new__(plain)
        obj.__init__(*args, **kwargs)
        return obj

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported: its "
            "parameters are shards bound to a process group. Deep-copy the model before "
            "sharding, or build a fresh one and load sw.full_state_dict(model) into it")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # model.to(dtype/device), .half(), .cuda() would swap the shards' storage behind
        # the engine's back (it keeps its own views), failing later inside forward.
        _to_empty(self._sw_unit, fn)
        for sp in self._sw_unit.params:
            probe = torch.empty(0, dtype=sp.orig_dtype, device=sp.host_device)
            moved = fn(probe)
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise ValueError(
                    f"changing a sharded model's dtype or device ({sp.orig_dtype}, "
                    f"{sp.host_device} -> {moved.dtype}, {moved.device}) is not supported "
                    "after sharding: convert it before fully_shard/shard_model, or use "
                    "mixed_precision= (compute dtype) and cpu_offload= (where shards live)")
        # The conversion is a no-op for the parameters, yet nn.Module._apply would still
        # swap each DTensor parameter's contents with a converted copy (swap_tensors), so
        # the optimizer's parameter would stop being the engine's shard. Hide them from it.
        held = [(ref.module, ref.name, ref.module._parameters[ref.name])
                for sp in self._sw_unit.params for ref in sp.refs]
        for m, name, _ in held:
            m._parameters[name] = None
        try:
            # Past FSDPModule._apply, which would read FSDP2's own state: the module's class.
            return super(FSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for m, name, t in held:
                m._parameters[name] = t

    # ---- FSDP2's FSDPModule methods ----

    def _sw_units(self, recurse: bool) -> Iterator[Unit]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        seen: set[int] = set()
        for m in mods:
            unit = unit_of(m)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                yield unit

    def _get_fsdp_state(self) -> ShardwiseState:  # type: ignore[override]
        """shardwise's state view of this module's unit (FSDP2 returns its FSDPState)."""
        state = state_of(self)  # type: ignore[arg-type]
        assert state is not None
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """Gather this unit's full parameters onto the module.

        async_op=True issues the all-gather and returns a handle; `handle.wait()` (or the
        module's next forward) finishes it. Synchronous by default, as in FSDP2.
        """
        check_bool("async_op", async_op)
        if async_op:
            unit = self._sw_unit
            issued = unit.state is ShardedState.SHARDED
            unit.unshard(async_op=True)
            if issued and unit.ctx is not None and unit.state is ShardedState.GATHERING:
                unit.ctx.schedule.note_gathering(unit)  # counts against the prefetch limit
            return UnshardHandle(unit)
        self._sw_unit.wait_unshard()
        return None

    def reshard(self) -> None:
        """Free this unit's full parameters; the module holds only its shards."""
        self._sw_unit.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: reshard every unit, drop the failed step's
        unreduced gradients and pending reductions, so the next step starts clean. Only on
        the root (FSDP2 refuses it elsewhere too)."""
        unit = self._sw_unit
        if unit.ctx is None or not unit.is_root:
            raise RuntimeError("reset_iter_state must be called on the root sharded module "
                               f"(the last one fully_shard was called on); "
                               f"{type(self).__name__} is not the root")
        unit.ctx.reset_iter_state()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True
                                  ) -> None:
        """True: free full parameters after forward (FULL_SHARD); False: keep them until
        backward (SHARD_GRAD_OP). As in FSDP2, an explicit True applies to the root too,
        only a bool is taken (an int group size is fully_shard's alone), and either value
        replaces an hpZ group size given to fully_shard ([Note: hpZ] in core/unit.py)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward).__name__} "
                             f"({reshard_after_forward!r}); an int group size (hpZ) is "
                             "taken by fully_shard only, as in FSDP2")
        for u in self._sw_units(recurse):
            u.reshard_after_forward = reshard_after_forward
            u.auto_reshard_after_forward = False
            u.hpz = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep full parameters after backward (saves the next forward's all-gather
        during gradient accumulation). Set it back to True before the optimizer step's
        backward: full parameters kept across a step would be stale."""
        check_bool("reshard_after_backward", reshard_after_backward)
        for u in self._sw_units(recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally, with no communication."""
        check_bool("requires_gradient_sync", requires_gradient_sync)
        for u in self._sw_units(recurse):
            u.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True
                                ) -> None:
        """False: under HYBRID_SHARD, each backward still reduce-scatters within the shard
        group but skips the all-reduce across replicas; the partial sums accumulate, and
        the next backward with True all-reduces them all at once (FSDP2's meaning;
        [Note: deferred all-reduce] in core/unit.py). Without replicas there is nothing
        to skip; NO_SHARD (replicas, no shard group) is refused."""
        check_bool("requires_all_reduce", requires_all_reduce)
        units = list(self._sw_units(recurse))
        if not requires_all_reduce:
            for u in units:
                if u.mesh.replicate_size > 1 and u.mesh.shard_size == 1:
                    raise NotImplementedError(
                        f"set_requires_all_reduce(False) on unit {u.label!r}: its "
                        f"{u.mesh.replicate_size} replicas have no shard group (NO_SHARD), "
                        "so the all-reduce is the only reduction; use "
                        "set_requires_gradient_sync(False) / sw.no_sync(model) to "
                        "accumulate without communication")
        for u in units:
            u.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: shardwise waits for every reduction at the end
        of each backward, so there is nothing to defer."""
        check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: Iterable[Any]) -> None:  # type: ignore[override]
        """Accepted for FSDP2 compatibility, checked: shardwise records the units' order on
        the first forward and prefetches the next unit itself (`set_prefetch` turns it off)."""
        _check_sharded_modules("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[Any]) -> None:  # type: ignore[override]
        """As `set_modules_to_forward_prefetch`: backward prefetch follows the recorded
        order reversed."""
        _check_sharded_modules("set_modules_to_backward_prefetch", modules)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward runs without gathering its parameters (for modules
        whose backward needs no parameter values, such as an embedding); its gradients are
        still reduced. Not recursive, as in FSDP2."""
        check_bool("unshard_in_backward", unshard_in_backward)
        self._sw_unit.unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted (FSDP2's private stream knob): shardwise already issues its prefetches
        asynchronously and waits where the parameters are needed."""
        check_bool("async_op", async_op)

    def set_prefetch(self, enabled: bool) -> None:
        """Turn all-gather prefetching on or off for the whole model (on by default)."""
        check_bool("enabled", enabled)
        assert self._sw_unit.ctx is not None
        self._sw_unit.ctx.schedule.prefetch = enabled

    # ---- FSDP2's communication methods ----

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by `factor` instead of the data-parallel
        size (the default, a mean over ranks); 1.0 gives the sum over ranks (torchtitan
        sets it on every module when its loss is divided by the global token count).
        Not recursive, as in FSDP2."""
        factor = check_number("factor", factor, positive=True)
        self._sw_unit.grad_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 (a DeprecationWarning there too): `set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use "
                      "set_gradient_divide_factor", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """shardwise always reduces with SUM and divides afterwards, so the collectives
        are unchanged. As in FSDP2, it decides what an all-reduce hook sees: True, the sum
        (the division follows the hook); False (default), the divided gradient."""
        check_bool("enable", enable)
        self._sw_unit.force_sum_reduction = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        """`hook(reduced)` runs on this unit's flat reduced gradient shard (one call per
        communication dtype), after the reduce-scatter (and the all-reduce across replicas
        under HYBRID_SHARD), before it is written to the parameters' `.grad`; in-place
        changes are kept. Not recursive, as in FSDP2."""
        if not callable(hook):
            raise ValueError(f"hook={hook!r} must be a callable (tensor) -> None")
        if stream is not None:
            if self._sw_unit.mesh.replicate_size > 1:
                raise ValueError("stream cannot be set when using HYBRID_SHARD (FSDP2 "
                                 "refuses it with native HSDP too)")
            if not isinstance(stream, torch.Stream):
                raise ValueError(f"stream={stream!r} must be a torch stream or None")
        self._sw_unit.all_reduce_hook = hook
        self._sw_unit.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this unit's parameters with `comm` (FSDP2's `AllGather`: `allocate(size,
        dtype=, device=)` gives the output buffer, `comm(output_tensor=, input_tensor=,
        group=, async_op=)` fills it rank-major)."""
        _check_comm("set_custom_all_gather", comm)
        u = self._sw_unit
        u.transport = CustomTransport(u.transport, all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this unit's gradients with `comm` (FSDP2's `ReduceScatter`: `allocate`
        gives the output buffer, `comm(output_tensor=, input_tensor=, group=, op=,
        async_op=)` reduces; shardwise passes `op=ReduceOp.SUM` and divides afterwards)."""
        _check_comm("set_custom_reduce_scatter", comm)
        u = self._sw_unit
        u.transport = CustomTransport(u.transport, reduce_scatter=comm)

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward makes the current stream wait for `event` (recorded
        after the optimizer step) before gathering, then drops it. shardwise gathers on the
        current stream, which already follows the optimizer step; the event is waited on
        so that work the user ordered behind it is respected too. None clears it, as in
        FSDP2: a CPU stream's `record_event()` returns None, so FSDP2's recipe runs there."""
        if event is not None and (not hasattr(event, "wait") or not hasattr(event, "record")):
            raise ValueError(f"event={event!r} must be a torch.Event (or torch.cuda.Event)")
        ctx = self._sw_unit.ctx
        assert ctx is not None
        ctx.post_optim_event = event

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Accepted: shardwise always reduces a unit's whole gradient buffer, a parameter
        without a gradient on this rank contributing zeros, so ranks that used different
        parameters still issue the same collectives."""
        check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Accepted, checked (a positive int): reductions in flight are bounded per model by
        `Limits.reduces` (sw.set_limits), not per module."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        check_int("max_input_buffers", max_input_buffers, minimum=1)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Accepted, checked: a communicator per collective kind is an NCCL overlap knob;
        shardwise's numbers and its gloo transport are the same either way."""
        check_bool("enable", enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted, checked: shardwise's buffers come from its own pool (an NCCL-only
        zero-copy knob in FSDP2)."""
        check_bool("enable", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Refused: symmetric-memory all-gathers need FSDP2's NCCL staging buffers."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm(backend={backend!r}) is not supported: shardwise does "
            "not allocate its all-gather buffers from NCCL symmetric memory")


def _to_empty(unit: Unit, fn: Any) -> None:
    """`model.to_empty(device=...)` on a model sharded on the meta device allocates the
    shards (FSDP2's meta-init route: shard on meta, to_empty, then initialize the DTensor
    parameters). Recognized by what `fn` makes of a meta tensor: a real one."""
    meta = [sp for sp in unit.params if sp.is_meta]
    if not meta:
        return
    try:
        moved = fn(torch.empty(0, dtype=meta[0].orig_dtype, device="meta"))
    except (NotImplementedError, RuntimeError):
        return  # .to(device) of a meta tensor: nothing to copy from, torch refuses it
    if not isinstance(moved, torch.Tensor) or moved.is_meta:
        return
    host = meta[0].host_device
    if moved.device.type != host.type or (moved.device.index is not None
                                          and host.index is not None
                                          and moved.device.index != host.index):
        raise ValueError(
            f"to_empty(device={moved.device}) on unit {unit.label!r}: its shards live on "
            f"{host} (the mesh's device, or the CPU under offload_policy); use that device")
    for sp in meta:
        sp.materialize()


_CLASS_CACHE: dict[type, type] = {}


def sharded_class(cls: type) -> type:
    if issubclass(cls, ShardedModule):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return _CLASS_CACHE[cls]


def own_unit(module: nn.Module) -> Unit | None:
    """The unit fully_shard made on `module` itself, read from its own `__dict__`.

    Not `getattr`: a wrapper that forwards unknown attributes to the module it wraps
    (torch's CheckpointWrapper, Accelerate's and torchtitan's activation checkpointing)
    would answer with the inner module's unit, and the wrapper would look sharded when only
    its inner layer is. FSDP2 keeps its state in `module.__dict__` for the same reason.
    """
    return unit_of(module)
