"""Workers for issue 25's "freezes are not compared across ranks" (engine/core/context.py).

A `requires_grad` change made on one rank only changed that rank's gradient reductions
alone: gloo aborted the process from its I/O thread (pair.cc "Received data size doesn't
match expected size", SIGABRT), other transports hang. Now every rank raises a RuntimeError
naming the difference before any reduction, and the ranks' collectives stay matched.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw
from shardwise.engine.comm import collectives as C
from tests.dist.parity import grad_diffs, param_diffs
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 3
# blocks.1.up.weight is (19, 6): 19 rows divide evenly by neither 2 nor 3 ranks.
FROZEN = "blocks.1.up.weight"


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
          seed: int) -> None:
    x, y = make_batch("lm", seed, PER_RANK * world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss_fn("lm", model(x[mine]), y[mine]).backward()
    opt.step()
    opt.zero_grad()


def _checksum(model: nn.Module) -> float:
    return float(sum(t.double().sum().item() for t in sw.full_state_dict(model).values()))


def freeze_on_one_rank(rank: int, world: int) -> dict[str, dict[str, object]]:
    """Rank 1 alone freezes a parameter between steps: the step raises on every rank.

    Then the job goes on (reset_iter_state, rank 1 unfreezes; a forward with grad enabled
    but no backward, an eval forward, two steps): the collectives are still matched and
    every rank ends with the same parameters.
    """
    out: dict[str, dict[str, object]] = {}
    sw.set_debug(True)  # the check is a collective per step: debug mode only
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        model = make_model("lm", 0)
        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt, rank, world, 0)
        if rank == 1:
            model.get_parameter(FROZEN).requires_grad_(False)
        message = None
        try:
            _step(model, opt, rank, world, 1)
        except RuntimeError as e:
            message = str(e)
        model.reset_iter_state()
        opt.zero_grad()
        if rank == 1:
            model.get_parameter(FROZEN).requires_grad_(True)
        x, _ = make_batch("lm", 2, PER_RANK)
        model(x)  # grad enabled, no backward: its check is drained at the next forward
        with torch.no_grad():
            model(x)
        _step(model, opt, rank, world, 3)
        _step(model, opt, rank, world, 4)
        sums = C.all_gather_floats([_checksum(model)])
        out[strategy] = {"message": message, "same": len({s[0] for s in sums}) == 1}
    sw.set_debug(False)
    return out


def _freeze_alike(step: int, model: nn.Module, ref: nn.Module) -> None:
    """Every rank alike: freeze a parameter of blocks.1 and all of blocks.0 (steps 1-2),
    unfreeze blocks.0 (step 3) and the parameter too (step 4)."""
    for m in (model, ref):
        if step == 1:
            m.get_parameter(FROZEN).requires_grad_(False)
            m.blocks[0].requires_grad_(False)
        elif step == 3:
            m.blocks[0].requires_grad_(True)
        elif step == 4:
            m.get_parameter(FROZEN).requires_grad_(True)


def freeze_alike_parity(rank: int, world: int) -> dict[str, float]:
    """Freezing on every rank alike trains as the unsharded reference does: every parameter
    and gradient at every step ("frozen grad": a frozen one got none)."""
    diffs: dict[str, float] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        model = make_model("lm", 1)
        ref = copy.deepcopy(model)
        ref.head.weight = ref.embed.weight
        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(6):
            _freeze_alike(step, model, ref)
            x, y = make_batch("lm", 50 + step, PER_RANK * world)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            loss_fn("lm", model(x[mine]), y[mine]).backward()
            loss_fn("lm", ref(x), y).backward()
            label = f"{strategy} step {step}"
            diffs |= param_diffs(model, ref, label) | grad_diffs(model, ref, label)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        diffs |= param_diffs(model, ref, f"{strategy} after the last step")
    return diffs


def checks_issued(rank: int, world: int, debug: bool) -> list[object]:
    """The freeze checks a training step and an eval forward issue: none on the default
    path, one per training step under debug mode (none alone: nothing could differ)."""
    from shardwise.engine.core import context as freeze_check

    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    issued: list[object] = []
    real = freeze_check.C.max_over

    def counting(*args: object, **kwargs: object) -> list[int]:
        issued.append(kwargs.get("label"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    sw.set_debug(debug)
    freeze_check.C.max_over = counting  # type: ignore[assignment]
    try:
        _step(model, opt, rank, world, 0)
        with torch.no_grad():
            model(make_batch("lm", 1, PER_RANK)[0])
        _step(model, opt, rank, world, 1)
    finally:
        freeze_check.C.max_over = real  # type: ignore[assignment]
        sw.set_debug(False)
    return issued
