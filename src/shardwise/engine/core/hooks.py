"""Module and autograd hooks that drive the units through a step.

Per unit: forward pre-hook (unshard, prefetch the next unit), forward post-hook (reshard
under FULL_SHARD, hook the outputs for backward), pre-backward (a gradient hook on the
outputs: unshard again, prefetch the previous unit), post-backward (an identity autograd
Function on the unit's forward inputs: its backward runs once the gradients for those inputs
exist, which is when the unit's backward is over; then reduce and reshard), and a final
callback queued on the autograd engine by the root (post-backward for units whose inputs
needed no gradient, wait for every pending reduction, reshard everything).

[Note: post-backward] A unit may reshard only when autograd no longer needs its unsharded
parameters. Counting the gradients of its trainable parameters is not enough: a frozen
weight (LoRA's base weight, a frozen attention) is still needed to compute the gradient of
the unit's input after the last trainable gradient has arrived. The gradient of the inputs
is the last thing the unit's backward computes. The autograd engine runs a ready
AccumulateGrad before any other ready node, and the Function's node was created before every
op of the unit's forward, so it runs after them. A unit whose inputs need no gradient (the
first unit, or any unit behind frozen ones) is finished by the root's final callback.

When each unit gathers, reshards and reduces is the schedule's decision (schedule.py,
[Note: prefetch]); the hooks tell it where the step is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .context import ModelContext
from .events import now
from .unit import Unit

# --------------------------------------------------------------------------------------------------
# Find and replace the tensors inside a module's inputs and outputs.
#
# Activations between units come in any shape a model likes: tuples, dicts, namedtuples,
# dataclasses (nested ones too), Hugging Face `ModelOutput`s. The hooks need every tensor in
# them: to hook outputs for backward, to cast inputs and outputs under mixed precision, and to
# mark inputs for the post-backward signal. torch's pytree treats a dataclass it was not told
# about as a leaf, which hid its tensors from backward (the storage was freed under them), so
# the walk here is written out, dataclasses included.


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside `obj`, depth first."""
    out: list[torch.Tensor] = []
    _walk(obj, out.append, 0)
    return out


def _walk(obj: Any, visit: Callable[[torch.Tensor], None], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        visit(obj)
    elif depth > _MAX_DEPTH:
        return
    elif type(obj) in _PLAIN:  # the common case first, no dataclass check (_PLAIN)
        for v in (obj.values() if type(obj) is dict else obj):
            _walk(v, visit, depth + 1)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name, None), visit, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, visit, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, visit, depth + 1)


# Self-referencing containers are not activations; stop rather than recurse forever.
_MAX_DEPTH = 32
# Exactly these types are never dataclasses (a subclass may be: Hugging Face's ModelOutput
# is a dict and a dataclass), so the walks take them before asking `dataclasses.is_dataclass`,
# which every hook call otherwise paid for the (args, kwargs) pair and each element.
_PLAIN = (tuple, list, dict)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, depth: int = 0) -> Any:
    """`obj` with each tensor t replaced by fn(t); containers are rebuilt only if changed."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth > _MAX_DEPTH:
        return obj
    kind = type(obj)
    if kind is tuple or kind is list:  # the common case first, no dataclass check (_PLAIN)
        items = [map_tensors(fn, v, depth + 1) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else kind(items)
    if kind is not dict and _is_dataclass_instance(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name, None)
            nv = map_tensors(fn, v, depth + 1)
            if nv is not v:
                changes[f.name] = nv
        if not changes:
            return obj
        new = copy.copy(obj)
        for k, v in changes.items():
            try:
                setattr(new, k, v)  # ModelOutput keeps its dict view in step this way
            except dataclasses.FrozenInstanceError:
                object.__setattr__(new, k, v)
        return new
    if isinstance(obj, dict):
        items = {k: map_tensors(fn, v, depth + 1) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        new = copy.copy(obj)
        new.update(items)
        return new
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v, depth + 1) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)

# --- hook functions -----------------------------------------------------------------------


def _cast(obj: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return obj
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, obj)


def _not_traced(fn: Any) -> Any:
    """Run `fn` eagerly even inside torch.compile.

    [Note: compile] The hooks drive collectives, Python state machines and the buffer pool:
    Dynamo tracing them specialized graphs on engine state (recompiling as it changed) and
    replayed stale buffer-pool decisions at step 2. Excluded from tracing, they run between
    the compiled pieces of a module, exactly as in eager mode.

    [Note: inference mode] They also run outside `torch.inference_mode()` (grad mode as it
    was): what they allocate (gathered parameters, pooled buffers) outlives the call, and
    made as inference tensors it broke the next training step's in-place copies.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    disabled = torch._dynamo.disable(run)

    # Eager, the hook calls `fn` itself: the disable wrapper swaps Dynamo's frame callback
    # out and back on every call (a few microseconds, four calls per unit per step). While
    # Dynamo traces a module, `is_compiling()` is True and the call goes through it, which
    # Dynamo does not trace into; a frame Dynamo compiles on its own (a graph break's
    # resumption calling the hook) takes the same branch while it is traced.
    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or torch.is_inference_mode_enabled():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


_is_compiling = torch.compiler.is_compiling


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, tick: int, *tensors: torch.Tensor) -> Any:
        ctx.unit = unit
        ctx.tick = tick
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        unit: Unit = ctx.unit
        if unit.ctx is not None:
            unit.ctx.ensure_backward()
            unit.ctx.schedule.post_backward(unit, ctx.tick)
        return (None, None, *grads)


def _mark_inputs(unit: Unit, args: Any, tick: int) -> Any:
    """Route the inputs that need a gradient through _PostBackward ([Note: post-backward]);
    `tick`: the forward's first ([Note: stand-ins] in schedule.py)."""
    pos, kw = args
    if not kw and type(pos) is tuple and all(isinstance(t, torch.Tensor) for t in pos):
        # The common call, tensors by position: no walk, no rebuilt containers.
        if not any(t.requires_grad for t in pos):
            return args
        if all(t.requires_grad for t in pos):
            return _PostBackward.apply(unit, tick, *pos), kw
    needs = [t for t in tensors_in(args) if t.requires_grad]
    if not needs:
        return args
    outs = iter(_PostBackward.apply(unit, tick, *needs))
    ids = {id(t) for t in needs}
    return map_tensors(lambda t: next(outs) if id(t) in ids else t, args)


@_not_traced
def forward_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    assert unit.ctx is not None, "fully_shard gives every unit a context"
    ctx = unit.ctx.ensure_ready(unit, (args, kwargs))
    mp = unit.mp
    cast_to = mp.param_dtype if mp is not None and mp.cast_forward_inputs else None
    if ctx.containers is not None and not unit.is_root:
        # Before its gather: the members its call skips over gather first, in container
        # order ([Note: data-dependent units] in context.py).
        ctx.containers.called(module)
    if ctx.in_backward:
        # Activation checkpointing re-runs forward inside backward: the unit is needed
        # unsharded (with the same input casts as the first time), and nothing about the
        # step's order or resharding may change.
        ctx.schedule.recompute(unit)
        return _cast((args, kwargs), cast_to)
    if unit.is_root:
        ctx.begin_forward()
    if ctx.sinks:
        unit.t_compute = now()
    tick = ctx.schedule.pre_forward(unit)
    args, kwargs = _cast((args, kwargs), cast_to)
    if torch.is_grad_enabled():
        args, kwargs = _mark_inputs(unit, (args, kwargs), tick)
    return args, kwargs


@_not_traced
def forward_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit: Unit = module._sw_unit  # type: ignore[assignment]
    ctx: ModelContext = unit.ctx  # type: ignore[assignment]
    out_dtype = unit.mp.output_dtype if unit.mp is not None else None
    if ctx.in_backward:
        # A recomputation (activation checkpointing): see forward_pre_hook.
        return _cast(output, out_dtype)
    if ctx.sinks:
        unit.emit("forward", "", 0, unit.t_compute)
    grad = torch.is_grad_enabled()
    if not grad:
        needs = []
    elif isinstance(output, torch.Tensor):  # the common output: no walk
        needs = [output] if output.requires_grad else []
    else:
        needs = [t for t in tensors_in(output) if t.requires_grad]
    tick = ctx.schedule.post_forward(unit)
    if needs:
        hook = _make_pre_backward(ctx, unit, tick)  # one closure per call, not per output
        for t in needs:
            t.register_hook(hook)
    # Each unit's own policy: a block may hand fp32 to the next one while computing in bf16.
    output = _cast(output, out_dtype)
    if unit.is_root:
        ctx.schedule.end_forward(backward_follows=grad)
    return output


def _make_pre_backward(ctx: ModelContext, unit: Unit, tick: int):
    def hook(grad: torch.Tensor) -> None:
        ctx.ensure_backward()
        if ctx.sinks:
            unit.t_compute = now()
        ctx.schedule.pre_backward(unit, tick)

    return hook

