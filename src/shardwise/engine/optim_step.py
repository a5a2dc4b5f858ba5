"""The optimizer step on sharded parameters at the cost of plain tensors.

[Note: optimizer fast path] Sharded parameters are DTensors (dtensor.py). torch's optimizers
on CPU default to the per-parameter path (`foreach=False`), where every elementwise op of the
update dispatches through DTensor: measured, that doubled AdamW's step (benchmarks/
optim_step.py). For an optimizer whose update is elementwise per parameter, the update of a
`Shard(0)` DTensor *is* the update of its local rows, so DTensor adds nothing but dispatch.

A global optimizer-step pre-hook therefore presents the step with plain tensors: each of the
engine's DTensor parameters is replaced, in `param_groups` and as the key of `state`, by a
persistent plain alias of its local rows (same storage, so the update lands in the shard),
with its gradient's local rows as `.grad` and its state's local tensors as state. The
post-hook puts the DTensor parameters and their DTensor state back (state created by this
step is wrapped as DTensors with the parameter's spec), so between steps the optimizer holds
exactly what it would without the fast path: per-parameter DTensor state for `state_dict()`,
the checkpoint code and torch.distributed.checkpoint.

Only optimizers known to be elementwise per parameter take the path (exact classes: a
subclass may override `step`), and not with a closure (it would recompute gradients into the
DTensor parameters) or `differentiable=True`. Anything else (Muon, Shampoo, LAMB, a custom
optimizer reading norms) keeps DTensor semantics, which are correct for any update. Nor does
an optimizer with step hooks of its own, or any other global step hook: torch runs global
pre-hooks first, so those would see the plain aliases (a norm over `param_groups` would be
this rank's alone, a gradient assigned to the module's parameter would not be the one the
step uses).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from . import dtensor as DT

# Updates that are elementwise per parameter: the local rows' update is the shard's update.
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta,
)

_registered = False


class _Swap:
    """One step's replacement: (group index, position, DTensor param, face, saved state)."""

    def __init__(self) -> None:
        self.items: list[tuple[dict, int, torch.Tensor, torch.Tensor, dict | None]] = []


# Optimizer -> the swap in progress (a weak key: an optimizer dropped mid-step is not kept).
_active: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap] = weakref.WeakKeyDictionary()


def _face(p: torch.Tensor) -> torch.Tensor | None:
    """The plain alias the step sees for an engine DTensor parameter (None: not ours)."""
    sp = getattr(p, "_sw_param", None)
    if sp is None or sp.spec is None or sp.sharded is not p or not DT.is_dtensor(p):
        return None
    face = sp.__dict__.get("_opt_face")
    if face is None or face.data_ptr() != sp.local.data_ptr():
        face = sp.local.detach()
        sp._opt_face = face
    return face


def _others_hooked(opt: torch.optim.Optimizer) -> bool:
    """Step hooks besides shardwise's own (these, misuse.py's): they must see the DTensor
    parameters."""
    from torch.optim import optimizer as O

    def foreign(hooks: dict) -> bool:
        return any(not getattr(h, "__module__", "").startswith("shardwise.")
                   for h in hooks.values())

    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or foreign(O._global_optimizer_pre_hooks)
                or foreign(O._global_optimizer_post_hooks))


def _applies(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    if type(opt) not in ELEMENTWISE or opt.defaults.get("differentiable", False):
        return False
    if _others_hooked(opt):
        return False
    # args[0] is the optimizer itself; a closure recomputes gradients into the DTensors.
    return len(args) <= 1 and kwargs.get("closure") is None


def _pre(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if opt in _active:  # the previous step raised before its post-hook: undo it first
        _post(opt, args, kwargs)
    if not _applies(opt, args, kwargs):
        return
    swap = _Swap()
    state = opt.state
    for group in opt.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            face = _face(p)
            if face is None:
                continue
            g = p.grad
            face.grad = None if g is None else DT.local_of(g)
            saved = state.pop(p) if p in state else None
            if saved is not None:
                state[face] = {k: DT.local_of(v) if isinstance(v, torch.Tensor) else v
                               for k, v in saved.items()}
            params[i] = face
            swap.items.append((group, i, p, face, saved))
    if swap.items:
        _active[opt] = swap


def _post(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    swap = _active.pop(opt, None)
    if swap is None:
        return
    state = opt.state
    for group, i, p, face, saved in swap.items:
        group["params"][i] = p
        face.grad = None  # the DTensor gradient owns it; zero_grad must be able to free it
        new = state.pop(face, None)
        if new is None:
            continue
        spec = p._sw_param.spec  # type: ignore[attr-defined]
        back: dict[str, Any] = {}
        for k, v in new.items():
            old = saved.get(k) if saved is not None else None
            if old is not None and isinstance(v, torch.Tensor) and DT.local_of(old) is v:
                back[k] = old  # updated in place: the DTensor already holds the result
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == face.shape:
                back[k] = DT.wrap(v, spec)  # per-element state made by this step
            else:
                back[k] = v  # scalars (Adam's step count)
        state[p] = back


def ensure_registered() -> None:
    """Install the global hooks once per process (the first sharded DTensor parameter)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_pre)
        register_optimizer_step_post_hook(_post)
        _registered = True
