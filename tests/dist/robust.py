"""Workers for cases beyond the parity grid: real Hugging Face models, activation
checkpointing, a unit called twice per forward, eval between steps, dict outputs."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from tests.dist.parity import grads_of

PER_RANK = 2


def _compare(rank: int, world: int, model: nn.Module, ref: nn.Module, batch_fn, loss_of,
             steps: int = 3, tol: float = 1e-5, between=None) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    named = dict(ref.named_parameters())
    worst = 0.0
    for step in range(steps):
        batch = batch_fn(step, PER_RANK * world)
        mine = {k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in batch.items()}
        loss_of(model, mine).backward()
        loss_of(ref, batch).backward()
        for fqn, (g, _) in grads_of(model).items():
            if fqn in named and named[fqn].grad is not None:
                diff = (g - named[fqn].grad).abs().max().item()
                assert diff < tol, f"step {step}: grad {fqn} off by {diff}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if between is not None:
            between(model, ref, batch)
    full = sw.full_state_dict(model)
    for n, p in ref.named_parameters():
        worst = max(worst, (full[n] - p.detach()).abs().max().item())
    assert worst < tol, worst
    return worst


def hf_models(rank: int, world: int) -> dict[str, float]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def tokens(step: int, n: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"input_ids": torch.randint(0, 97, (n, 9), generator=g)}

    def lm_loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(input_ids=b["input_ids"], labels=b["input_ids"]).loss

    out = {}
    configs = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=97, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=True, attn_implementation="eager")),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
            vocab_size=97, n_embd=24, n_layer=2, n_head=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would differ by rank
            bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    }
    for name, make in configs.items():
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            torch.manual_seed(0)
            model = make()
            ref = copy.deepcopy(model)
            ref.tie_weights()
            model.train()
            ref.train()
            sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
            out[f"{name}/{strategy}"] = _compare(rank, world, model, ref, tokens, lm_loss,
                                                 tol=2e-5)
    return out


class CkptBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """Blocks under activation checkpointing, a block applied twice, a dict output."""

    def __init__(self, d: int = 10, use_ckpt: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList(CkptBlock(d) for _ in range(3))
        self.shared = CkptBlock(d)
        self.out = nn.Linear(d, 3)
        self.use_ckpt = use_ckpt

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.use_ckpt else b(h)
        h = self.shared(self.shared(h))  # one unit, called twice
        return {"logits": self.out(h), "hidden": h}


def checkpointing_and_reuse(rank: int, world: int) -> dict[str, float]:
    def batch(step: int, n: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(n, 7, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}

    def loss_of(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b["x"])["logits"], b["y"])

    def evaluate(model: nn.Module, ref: nn.Module, b: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            a, r = model(b["x"])["logits"], ref(b["x"])["logits"]
        assert (a - r).abs().max().item() < 1e-5
        from shardwise.engine.core.context import units_of
        from shardwise.engine.core.unit import ShardedState

        assert all(u.state is ShardedState.SHARDED for u in units_of(model))

    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        torch.manual_seed(1)
        model = Net()
        ref = copy.deepcopy(model)
        sw.shard_model(model, sharding_strategy=strategy,
                       auto_wrap_policy=lambda m: isinstance(m, CkptBlock))
        out[strategy] = _compare(rank, world, model, ref, batch, loss_of, steps=3,
                                 between=evaluate)
    return out
