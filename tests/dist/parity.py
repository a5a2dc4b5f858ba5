"""Parity worker: a sharded model vs an unsharded single-process reference, step by step."""

from __future__ import annotations

import copy

import torch

import shardwise as sw
from shardwise.engine.dtensor import local_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 3  # samples per rank per step
STEPS = 3


def params_and_grads_match(
    model: torch.nn.Module, ref: torch.nn.Module, tol: float, what: str
) -> float:
    full = sw.full_state_dict(model)
    worst = 0.0
    for name, p in ref.named_parameters():
        diff = (full[name] - p.detach()).abs().max().item()
        worst = max(worst, diff)
        assert diff < tol, f"{what}: param {name} differs by {diff}"
    return worst


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients of a sharded model, gathered (test-only, through all_gather)."""
    from shardwise.engine import collectives as C
    from shardwise.engine.inspect import named_sharded_params

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


def run_case(rank: int, world: int, kind: str, strategy: str, policy: object,
             seed: int = 0, tol: float = 1e-5, prefetch_shuffle: bool = False) -> float:
    model = make_model(kind, seed)
    ref = copy.deepcopy(model)
    if kind == "lm":
        ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    worst = 0.0
    for step in range(STEPS):
        x, y = make_batch(kind, seed * 100 + step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = loss_fn(kind, model(x[mine]), y[mine])
        loss.backward()
        ref_loss = loss_fn(kind, ref(x), y)
        ref_loss.backward()
        grads = grads_of(model)
        ref_named = dict(ref.named_parameters())
        for fqn, (g, missing) in grads.items():
            rp = ref_named[fqn]
            if not rp.requires_grad:
                assert missing, f"frozen {fqn} got a gradient"
                continue
            diff = (g - rp.grad).abs().max().item()
            assert diff < tol, f"{strategy}/{policy}: step {step} grad {fqn} differs by {diff}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, params_and_grads_match(model, ref, tol, f"{strategy}/{policy}"))
    # Frozen parameters never moved.
    full = sw.full_state_dict(model)
    for name, p in ref.named_parameters():
        if not p.requires_grad:
            assert torch.equal(full[name], p.detach()), f"frozen {name} changed"
    return worst


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
         policies: list[str]) -> dict[str, float]:
    out = {}
    for kind in kinds:
        for strategy in strategies:
            for pol in policies:
                if pol == "transformer" and kind == "mlp":
                    continue
                policy = resolve_policy(POLICIES[pol] if pol in POLICIES else pol)
                out[f"{kind}/{strategy}/{pol}"] = run_case(rank, world, kind, strategy, policy)
    return out


def changing_order(rank: int, world: int, strategy: str) -> float:
    """The forward order of the blocks changes every step; prefetch must follow it."""
    import random

    from shardwise.engine.inspect import context_of

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
    worst = 0.0
    for step in range(5):
        order = list(range(len(model.blocks)))
        rng.shuffle(order)
        x, y = make_batch("lm", 300 + step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        # The root's forward must run the blocks for its hooks: call it via a tiny wrapper.
        model.forward = lambda idx, o=order: forward(model, idx, o)  # type: ignore[method-assign]
        loss_fn("lm", model(x[mine]), y[mine]).backward()
        loss_fn("lm", forward(ref, x, order), y).backward()
        for fqn, (g, _missing) in grads_of(model).items():
            rp = dict(ref.named_parameters())[fqn]
            if rp.requires_grad:
                diff = (g - rp.grad).abs().max().item()
                assert diff < 1e-5, f"step {step} order {order}: {fqn} grad off by {diff}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        ctx = context_of(model)
        assert ctx is not None
        recorded.append([u.name for u in ctx.schedule.order])
        worst = max(worst, params_and_grads_match(model, ref, 1e-5, f"order/{strategy}"))
    # The recorded order followed the blocks' order of each step.
    assert len({tuple(r) for r in recorded}) > 1, recorded
    if strategy == "FULL_SHARD" and world > 1:
        assert ctx.schedule.prefetches > 0, "no all-gather was ever prefetched"
    return worst


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
    # this rank holds.
    local = sum(local_of(p).numel() for p in model.parameters())
    grads = sum(local_of(p.grad).numel() for p in model.parameters() if p.grad is not None)
    trainable = sum(local_of(p).numel() for p in model.parameters() if p.requires_grad)
    state = sum(local_of(v).numel() for s in opt.state.values() for v in s.values()
                if v.dim() > 0)
    return {"total": total, "local": local, "trainable": trainable, "grads": grads,
            "state": state}
