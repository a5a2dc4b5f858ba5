"""Small models shaped like the ones PyTorch's FSDP2 tests use (common_fsdp, common_dtensor).

Written here rather than imported: torch.testing._internal.common_fsdp needs `expecttest`,
which the project does not install. Sizes are chosen so that most dim-0 sizes do not divide
evenly by 2, 3 or 4 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """in_proj -> relu -> out_proj, plus an optional buffer added to the output."""

    def __init__(self, dim: int, dim_multiplier: int = 4, with_buffer: bool = False,
                 bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * dim_multiplier, bias=bias)
        self.out_proj = nn.Linear(dim * dim_multiplier, dim, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,)))
        else:
            self.buffer = None

    def reset_parameters(self) -> None:
        # The Linear children initialize themselves; only the buffer is this module's.
        if self.buffer is not None:
            nn.init.normal_(self.buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(F.relu(self.in_proj(x)))
        if self.buffer is not None:
            z = z + self.buffer
        return z


class DoubleLinear(nn.Module):
    """Two linears on the same input; with `use_second_linear=False` lin2 is never used."""

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor):
        if self.use_second_linear:
            return self.relu(self.lin1(x)), self.relu(self.lin2(x))
        return self.relu(self.lin1(x))


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 11
    max_seq_len: int = 13
    dim: int = 10
    n_heads: int = 2
    dropout_p: float = 0.0
    weight_tying: bool = True
    checkpoint_activations: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)),
                                           heads(self.wv(x)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token + position embeddings, blocks, final norm, output head (optionally tied)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            if self.model_args.checkpoint_activations:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


class ChunkedHeadModel(nn.Module):
    """embed -> body -> norm [-> head]; `skip_head=True` returns the hidden states, so the
    head can be run chunk by chunk outside the model's forward (a chunked loss)."""

    def __init__(self, dim: int, vocab_size: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, TransformerBlock)]
