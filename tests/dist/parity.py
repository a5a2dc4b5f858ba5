"""Parity worker: a sharded model vs an unsharded single-process reference, step by step."""

from __future__ import annotations

import copy
import math

import torch
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 3  # samples per rank per step
STEPS = 3


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients of a sharded model, gathered (test-only, through all_gather)."""
    from shardwise.engine.comm import collectives as C
    from shardwise.engine.core.context import named_sharded_params

    out = {}
    for fqn, sp in named_sharded_params(model):
        g = sp.shard_grad
        rows = torch.zeros(sp.chunk_rows, *sp.rest)
        if g is not None:
            rows[: sp.local_rows] = g
        if sp.shard_size > 1:
            full = torch.empty(sp.shard_size * sp.chunk_rows, *sp.rest)
            C.all_gather(full.view(-1), rows.reshape(-1), sp.owner.mesh.shard_group, False)
        else:
            full = rows
        out[fqn] = (full[: sp.dim0].reshape(sp.orig_shape), g is None)
    return out


def param_diffs(model: torch.nn.Module, ref: torch.nn.Module, label: str) -> dict[str, float]:
    """The largest absolute difference of each full parameter from the reference's, keyed
    "<label> param <fqn>" ("frozen param" for one that must never move: its diff must be 0)."""
    full = sw.full_state_dict(model)
    return {f"{label} {'param' if p.requires_grad else 'frozen param'} {name}":
            (full[name] - p.detach()).abs().max().item() for name, p in ref.named_parameters()}


def grad_diffs(model: torch.nn.Module, ref: torch.nn.Module, label: str) -> dict[str, float]:
    """The same for each full gradient, keyed "<label> grad <fqn>"; a frozen parameter that
    got a gradient anyway is "<label> frozen grad <fqn>": inf."""
    ref_named = dict(ref.named_parameters())
    out = {}
    for fqn, (g, missing) in grads_of(model).items():
        rp = ref_named[fqn]
        if rp.requires_grad:
            out[f"{label} grad {fqn}"] = (g - rp.grad).abs().max().item()
        else:
            out[f"{label} frozen grad {fqn}"] = 0.0 if missing else math.inf
    return out


def train_against_reference(rank: int, world: int, kind: str, strategy: str, policy: object,
                            seed: int = 0, prefetch: bool = True
                            ) -> tuple[dict[str, float], torch.nn.Module]:
    """STEPS AdamW steps of a sharded model (each rank its slice of the batch) beside the
    unsharded reference (the whole batch): every parameter and gradient's difference at
    every step, and the sharded model."""
    model = make_model(kind, seed)
    ref = copy.deepcopy(model)
    if kind == "lm":
        ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy=policy)
    if not prefetch:
        model.set_prefetch(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    diffs: dict[str, float] = {}
    for step in range(STEPS):
        x, y = make_batch(kind, seed * 100 + step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_fn(kind, model(x[mine]), y[mine]).backward()
        loss_fn(kind, ref(x), y).backward()
        # The parameters the gradients came from, and the gradients, before the update.
        diffs |= param_diffs(model, ref, f"step {step}") | grad_diffs(model, ref, f"step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    diffs |= param_diffs(model, ref, "after the last step")
    return diffs, model


def run_case(rank: int, world: int, kind: str, strategy: str, policy: object,
             seed: int = 0) -> dict[str, float]:
    return train_against_reference(rank, world, kind, strategy, policy, seed)[0]


def prefetch_off_and_on(rank: int, world: int, strategy: str) -> dict[str, object]:
    """The same training with all-gather prefetching off (`set_prefetch(False)` on the root)
    and on, each against the reference; how many all-gathers each prefetched; and the
    largest difference between the two runs' final parameters."""
    from shardwise.engine.core.context import context_of

    out: dict[str, object] = {}
    finals = []
    for prefetch in (False, True):
        diffs, model = train_against_reference(rank, world, "lm", strategy, "transformer",
                                               seed=2, prefetch=prefetch)
        name = "on" if prefetch else "off"
        out[f"diffs {name}"] = diffs
        ctx = context_of(model)
        assert ctx is not None
        out[f"prefetches {name}"] = ctx.schedule.prefetches
        finals.append(sw.full_state_dict(model))
    out["off vs on"] = max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])
    return out


POLICIES = {
    "none": None,
    "transformer": "transformer",
    "size": "size-small",
    "callable": "callable",
}


def resolve_policy(name: str) -> object:
    if name == "size-small":
        return sw.size_policy(20)
    if name == "callable":
        return lambda m: isinstance(m, torch.nn.Linear)
    return name


def grid(rank: int, world: int, kinds: list[str], strategies: list[str],
         policies: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in kinds:
        for strategy in strategies:
            for pol in policies:
                if pol == "transformer" and kind == "mlp":
                    continue
                policy = resolve_policy(POLICIES[pol] if pol in POLICIES else pol)
                out[f"{kind}/{strategy}/{pol}"] = run_case(rank, world, kind, strategy, policy)
    return out


def changing_order(rank: int, world: int, strategy: str) -> dict[str, object]:
    """The forward order of the blocks changes every step; prefetch must follow it. Returns
    the differences from the reference, the order recorded at each step and how many
    all-gathers were prefetched."""
    import random

    from shardwise.engine.core.context import context_of

    model = make_model("lm", 4)
    ref = copy.deepcopy(model)
    ref.head.weight = ref.embed.weight

    def forward(m: torch.nn.Module, idx: torch.Tensor, order: list[int]) -> torch.Tensor:
        x = m.embed(idx) + m.pos[: idx.shape[1]]
        for i in order:
            x = m.blocks[i](x)
        return m.head(m.norm(x))

    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rng = random.Random(0)  # same permutations on every rank
    recorded = []
    diffs: dict[str, float] = {}
    for step in range(5):
        order = list(range(len(model.blocks)))
        rng.shuffle(order)
        x, y = make_batch("lm", 300 + step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        # The root's forward must run the blocks for its hooks: call it via a tiny wrapper.
        model.forward = lambda idx, o=order: forward(model, idx, o)  # type: ignore[method-assign]
        loss_fn("lm", model(x[mine]), y[mine]).backward()
        loss_fn("lm", forward(ref, x, order), y).backward()
        label = f"step {step} order {order}"
        diffs |= param_diffs(model, ref, label) | grad_diffs(model, ref, label)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        ctx = context_of(model)
        assert ctx is not None
        recorded.append([u.name for u in ctx.schedule.order])
    diffs |= param_diffs(model, ref, "after the last step")
    return {"diffs": diffs, "recorded": recorded, "prefetches": ctx.schedule.prefetches}


def holdings(rank: int, world: int) -> dict[str, int]:
    """What this rank holds after one AdamW step: params, grads and optimizer state."""
    model = make_model("lm", 0)
    total = sum(p.numel() for p in model.parameters())
    sw.shard_model(model, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch("lm", 0, PER_RANK)
    loss_fn("lm", model(x), y).backward()
    opt.step()
    # Sharded parameters, their gradients and optimizer state are DTensors: count the rows
    # this rank owns (a 0-d parameter's replicated value, and its state, on rank 0 only).
    def owned(t: torch.Tensor) -> int:
        return 0 if t.dim() == 0 and rank > 0 else local_of(t).numel()

    local = sum(owned(p) for p in model.parameters())
    grads = sum(owned(p.grad) for p in model.parameters() if p.grad is not None)
    trainable = sum(owned(p) for p in model.parameters() if p.requires_grad)
    state = sum(owned(v) for s in opt.state.values() for v in s.values()
                if v.dim() > 0 or isinstance(v, DTensor))  # not Adam's 0-d `step`
    return {"total": total, "local": local, "trainable": trainable, "grads": grads,
            "state": state}
