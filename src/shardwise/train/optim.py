"""AdamW in torch's fastest correct implementation for the parameters at hand.

[Note: optimizer implementation] torch.optim.AdamW runs one of three implementations of the
same update: a per-parameter loop (torch's default on CPU), `foreach` (multi-tensor ops) and
`fused` (one kernel over all parameters; on CPU since torch 2.4). They differ only in
rounding. Measured for 16M fp32 parameters in one thread: fused 19.6 ms a step against
102.6 ms for the loop (5.2x; benchmarks/optim_step.py prints the three side by side). On a
sharded model each rank steps its shards, and with CPU offload the GPU machine steps on the
CPU too, so the choice matters wherever shardwise runs.

Fused takes sharded parameters as they are: the step runs on the DTensor shards through
DTensor's own dispatch, with no hook of shardwise's (the earlier optimizer fast path, which
handed the step plain aliases of each shard through a global hook, went with issue 35).
tests/dist/test_fused_optim.py checks fused and foreach against the loop.

Library users get the same by asking for it: `torch.optim.AdamW(model.parameters(),
fused=True)` after sharding (or `adamw(...)` here, which falls back where fused is refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
_KWARGS: dict[str, dict[str, bool]] = {"fused": {"fused": True}, "foreach": {"foreach": True},
                                       "for-loop": {"foreach": False}}


def adamw(params: Iterable[Any], *, impl: str = "auto",
          **kwargs: Any) -> tuple[torch.optim.AdamW, str]:
    """`torch.optim.AdamW(params, **kwargs)` in `impl` ("auto": the first of fused, foreach,
    for-loop that torch accepts for these parameters); returns it and the implementation's
    name. `params`: tensors or param-group dicts, as torch takes them."""
    if impl != "auto" and impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of: auto, {', '.join(IMPLEMENTATIONS)}")
    items = list(params)
    tried = IMPLEMENTATIONS if impl == "auto" else (impl,)
    for i, name in enumerate(tried):
        # Fresh group dicts each try: the constructor writes its defaults into them.
        fresh = [dict(g) if isinstance(g, dict) else g for g in items]
        try:
            return torch.optim.AdamW(fresh, **kwargs, **_KWARGS[name]), name
        except (RuntimeError, ValueError):
            if i == len(tried) - 1:
                raise
    raise AssertionError("unreachable")


def implementation(opt: torch.optim.Optimizer) -> str:
    """Which implementation an optimizer's step runs: fused, foreach or for-loop."""
    d = opt.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach"):
        return "foreach"
    if d.get("foreach") is None:  # torch decides at the step: foreach on CUDA tensors only
        p = next((p for g in opt.param_groups for p in g["params"]), None)
        return "foreach" if p is not None and p.is_cuda else "for-loop"
    return "for-loop"


# [Note: optimizer in backward] `train.optim_in_backward`: each parameter's optimizer steps
# from its post-accumulate-grad hook, which the engine runs right after that parameter's
# reduced sharded gradient is written ([Note: post-accumulate-grad hooks] in
# engine/core/unit.py), and the gradient is dropped at once, so a rank never holds the
# gradients of the whole model (PyTorch's optimizer-in-backward recipe, as FSDP2 runs it).
# - One optimizer per parameter, with the whole-model optimizer's hyperparameters copied in
#   before each step and its `state` shared: the whole-model optimizer stays what the trainer
#   sets the learning rate on and what checkpoints save and load (its state dict is the
#   default run's), and its `step()` is never called.
# - Gradient accumulation: only the last micro-batch's backward reduces (the others run
#   under no_sync), and the hooks step only while `armed` (set for that backward alone).
# - Clipping by the global norm is refused (config.py): the norm needs every gradient,
#   which exists only after the last parameter has stepped; clipping would take a second
#   backward. The norm is still reported, from each parameter's local norm recorded in its
#   hook (`grad_norm_of_parts`), and the non-finite guard can stop the run (after the step:
#   it cannot be skipped, so on_nonfinite=skip is refused, and so is fp16's loss scaling).


class InBackward:
    """Steps `opt`'s parameters one by one as their reduced gradients land (see [Note:
    optimizer in backward]). `finish()` after the step's last backward returns the global
    gradient norm and checks that every parameter with a gradient stepped."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.opt = opt
        self.model = model
        # Hooks step only during the backward that reduces (the last micro-batch's).
        self.armed = False
        # id(param) -> the local norm of its gradient this step (grad_norm_of_parts).
        self.norms: dict[int, torch.Tensor] = {}
        self._subs: dict[int, tuple[torch.optim.Optimizer, int]] = {}
        self._handles = []
        kwargs = {k: opt.defaults[k] for k in ("fused", "foreach") if k in opt.defaults}
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                sub = type(opt)([dict(group, params=[p])], **kwargs)  # type: ignore[call-arg]
                sub.state = opt.state  # type: ignore[assignment]
                self._subs[id(p)] = (sub, gi)
                self._handles.append(p.register_post_accumulate_grad_hook(self._step))

    def _step(self, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None:
            return
        from ..engine.core.dtensor import local_of

        g = local_of(p.grad).detach()
        self.norms[id(p)] = (g.float().norm(2) if g.numel()
                             else torch.zeros((), dtype=torch.float32, device=g.device))
        sub, gi = self._subs[id(p)]
        mine, whole = sub.param_groups[0], self.opt.param_groups[gi]
        for k, v in whole.items():  # the learning rate the trainer just set, and the rest
            if k != "params":
                mine[k] = v
        sub.state = self.opt.state  # load_state_dict (a resume) replaces the dict
        sub.step()
        p.grad = None

    def finish(self) -> float:
        """The step's global gradient norm (the same on every rank); resets for the next."""
        from ..engine.ext.grad_norm import grad_norm_of_parts

        self.armed = False
        norm = grad_norm_of_parts(self.model, self.norms).item()
        self.norms = {}
        return norm

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
