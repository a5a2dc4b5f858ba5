"""Parity worker: a sharded model vs an unsharded single-process reference, step by step."""

from __future__ import annotations

import copy

import torch

import shardwise as sw
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

    from shardwise.engine.fully_shard import named_sharded_params

    out = {}
    for fqn, sp in named_sharded_params(model):
        g = sp.sharded.grad
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
