"""Workers for tests/dist/test_review_numbers.py: the plan's bytes per rank held against
what a real run holds after one step."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.planner import plan
from shardwise.train.model import GPT, GPTConfig
from tests.dist.plan_workers import held_bytes


def _freeze(model: torch.nn.Module, what: str) -> None:
    """"attn": attention weights and the (tied) embedding; "norms-only": all but the norms;
    "": nothing."""
    for name, p in model.named_parameters():
        if what == "attn" and (".attn." in name or name == "wte"):
            p.requires_grad_(False)
        if what == "norms-only" and "norm" not in name:
            p.requires_grad_(False)


def frozen_states_case(rank: int, world: int, cfg_kw: dict,
                       cases: list[tuple[str, str | None, str]]) -> list[dict]:
    """Bytes held after one step with frozen parameters vs the plan of the same meta model."""
    cfg = GPTConfig(**cfg_kw)
    out = []
    for strategy, mp, frozen in cases:
        with torch.device("meta"):
            model = GPT(cfg)
        _freeze(model, frozen)
        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                       mixed_precision=mp)
        sw.materialize(model, seed=0)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, cfg.vocab_size, (1, 16), generator=g)
        model(idx, idx).backward()
        opt.step()
        held = held_bytes(model, opt)
        with torch.device("meta"):
            meta = GPT(cfg)
        _freeze(meta, frozen)
        r = plan(meta, world_size=world, sharding_strategy=strategy, mixed_precision=mp,
                 rank=rank).per_rank
        out.append({"case": f"{strategy}/{mp}/{frozen}", "rank": rank, "held": held,
                    "planned": {"params": r.params_bytes, "grads": r.grads_bytes,
                                "optimizer": r.optimizer_bytes}})
        del model, opt
    return out
