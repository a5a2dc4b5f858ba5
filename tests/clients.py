"""Models shaped like the code users bring: a nanoGPT-style GPT, LoRA adapters, dataclass
activations. Written here (nothing downloaded); small enough for 2-3 CPU ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTShape:
    vocab: int = 37
    seq: int = 8
    d: int = 20  # not divisible by 3: uneven shards at 3 ranks
    heads: int = 4
    layers: int = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTShape) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.d, 3 * c.d)
        self.c_proj = nn.Linear(c.d, c.d)
        self.heads = c.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTShape) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.d, 4 * c.d)
        self.c_proj = nn.Linear(4 * c.d, c.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.d)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.d)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's shape: wte/wpe, blocks in transformer.h, ln_f, lm_head tied to wte."""

    def __init__(self, c: GPTShape | None = None) -> None:
        super().__init__()
        c = c or GPTShape()
        self.c = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab, c.d),
            wpe=nn.Embedding(c.seq, c.d),
            h=nn.ModuleList(Block(c) for _ in range(c.layers)),
            ln_f=nn.LayerNorm(c.d),
        ))
        self.lm_head = nn.Linear(c.d, c.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (B @ A), as LoRA does."""

    def __init__(self, base: nn.Linear, rank: int = 3, alpha: float = 6.0) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(rank))
        # Not zero (LoRA starts B at zero): a non-zero update exercises every gradient.
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank) * 0.05)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def add_lora(model: NanoGPT) -> NanoGPT:
    """LoRA on every attention and MLP Linear; everything else frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"),
                             (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            setattr(parent, name, LoRALinear(getattr(parent, name)))
    return model


def gpt_batch(c: GPTShape, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, c.vocab, (n, c.seq), generator=g),
            torch.randint(0, c.vocab, (n, c.seq), generator=g))


# --- dataclass activations between units ----------------------------------------------------


@dataclass
class Aux:
    gate: torch.Tensor


@dataclass
class Hidden:
    x: torch.Tensor
    aux: Aux  # nested dataclass


class DCBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Linear(d, d)

    def forward(self, h: Hidden) -> Hidden:
        y = torch.tanh(self.lin(h.x)) * torch.sigmoid(h.aux.gate)
        return Hidden(x=h.x + y, aux=Aux(gate=self.g(y)))


class DCNet(nn.Module):
    def __init__(self, d: int = 11, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(DCBlock(d) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.inp(x)
        h = Hidden(z, Aux(z * 0.5))
        for b in self.blocks:
            h = b(h)
        return self.out(h.x + h.aux.gate)
