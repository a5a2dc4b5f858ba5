"""Small models for parity tests: odd shapes, tied and frozen parameters, a 0-d parameter."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 13, hidden: int = 7, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d + 1)
        self.down = nn.Linear(3 * d + 1, d)
        self.gate = nn.Parameter(torch.tensor(0.7))  # 0-d: sharded as shape (1,)

    def reset_parameters(self) -> None:
        # What sw.materialize calls for parameters no submodule initializes.
        nn.init.constant_(self.gate, 0.7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding tied to the output head, a frozen positional table, repeated blocks."""

    def __init__(self, vocab: int = 11, d: int = 6, n_layers: int = 3, seq: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1, requires_grad=False)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "lm":
        return TinyLM()
    raise ValueError(kind)


def make_batch(kind: str, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return torch.randn(n, 13, generator=g), torch.randn(n, 5, generator=g)
    idx = torch.randint(0, 11, (n, 5), generator=g)
    return idx, torch.randint(0, 11, (n, 5), generator=g)


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return ((out - y) ** 2).mean()
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
