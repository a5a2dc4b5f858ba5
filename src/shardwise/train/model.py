"""A small decoder-only transformer (GPT) and its named size presets.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), learned position embeddings, and a token embedding that is also the output head.

[Note: sharded init] Every module owns its parameters directly and initializes exactly those
in `reset_parameters()`. `sw.materialize` calls `reset_parameters()` on every module of a
meta-device model while each holds only its dim-0 shard, parents before children, so a
parent must never re-initialize a child's parameters (they would be overwritten, or worse,
initialized twice with different rules). Dim-0 sharding keeps fan-in intact, so the
per-element normal draws below have the right scale on a shard. There are no buffers: the
causal mask comes from `scaled_dot_product_attention(is_causal=True)`, so nothing is left on
the meta device after materialization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from .tensor_parallel import local, tp_enter, tp_exit

INIT_STD = 0.02  # GPT-2's initializer range


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT.

    vocab_size: token ids are in [0, vocab_size); 256 for byte-level text.
    block_size: the longest context (sequence length) the position table covers.
    n_layer: number of transformer blocks.
    n_head: attention heads per block; must divide d_model.
    d_model: width of the residual stream.
    d_ff: hidden width of the MLP (0: 4 * d_model).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive int")
        if not isinstance(self.d_ff, int) or self.d_ff < 0:
            raise ValueError(f"GPTConfig.d_ff={self.d_ff!r} must be an int >= 0 (0: 4*d_model)")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: n_head={self.n_head} must divide d_model={self.d_model}")

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def block_params(self) -> int:
        """Parameters of one Block: two norms, attention (qkv + out), MLP (in + out)."""
        d, f = self.d_model, self.ffn_dim
        return 2 * d + 4 * d * d + 2 * d * f

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)` (the head is tied: counted once)."""
        d = self.d_model
        return (self.vocab_size + self.block_size) * d + self.n_layer * self.block_params() + d

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * matmul params + causal attention (PaLM appendix B)."""
        matmul = self.n_layer * (4 * self.d_model**2 + 2 * self.d_model * self.ffn_dim)
        matmul += self.vocab_size * self.d_model  # the tied head
        attn = 6 * self.n_layer * self.block_size * self.d_model  # 12*L*T*d / 2 (causal)
        return 6 * matmul + attn


# Named shapes. The small ones train on a CPU; the large ones are for `plan` and GPUs.
# "124m" and "350m" are GPT-2's shapes; "1b" to "13b" follow the Llama family's widths
# (a 4x GELU MLP has as many parameters as Llama's 3-matrix SwiGLU at 8/3 x).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128),
    "medium": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, d_model=384),
    "124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, d_model=768),
    "350m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, d_model=1024),
    "1b": GPTConfig(vocab_size=32000, block_size=2048, n_layer=18, n_head=32, d_model=2048),
    "3b": GPTConfig(vocab_size=32000, block_size=4096, n_layer=26, n_head=32, d_model=3200),
    "7b": GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, d_model=4096),
    "13b": GPTConfig(vocab_size=32000, block_size=4096, n_layer=40, n_head=40, d_model=5120),
}


def preset(name: str, **overrides: int) -> GPTConfig:
    """A preset by name, with optional field overrides (e.g. block_size=256)."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not one of: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


def _normal(p: nn.Parameter, std: float) -> None:
    with torch.no_grad():
        p.normal_(0.0, std)


class LayerNorm(nn.Module):
    """LayerNorm with a gain and no bias (the bias adds parameters and nothing measurable)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused qkv projection, one output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        d = cfg.d_model
        self.w_qkv = nn.Parameter(torch.empty(3 * d, d))
        self.w_out = nn.Parameter(torch.empty(d, d))
        # Residual-branch outputs are scaled down by sqrt(2 * n_layer) (GPT-2): each block
        # adds two branches to the stream, and the stream's variance should not grow with depth.
        self.out_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
        # The TP mesh when tensor_parallel.parallelize_gpt split the weights (else None).
        self.tp_mesh: DeviceMesh | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _normal(self.w_qkv, INIT_STD)
        _normal(self.w_out, self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Under tensor parallelism (tensor_parallel.py) this rank holds n_head / tp heads.
        x = tp_enter(x, self.tp_mesh)
        qkv = F.linear(x, local(self.w_qkv))  # (B, T, 3C / tp)
        # Head-major rows (n_head, 3, hs): a dim-0 slice of w_qkv is whole heads.
        q, k, v = qkv.view(B, T, -1, 3, C // self.n_head).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return tp_exit(F.linear(y, local(self.w_out)), self.tp_mesh)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(cfg.ffn_dim, cfg.d_model))
        self.w_out = nn.Parameter(torch.empty(cfg.d_model, cfg.ffn_dim))
        self.out_std = INIT_STD / math.sqrt(2 * cfg.n_layer)  # as in Attention
        self.tp_mesh: DeviceMesh | None = None  # as in Attention
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _normal(self.w_in, INIT_STD)
        _normal(self.w_out, self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_enter(x, self.tp_mesh)
        h = F.gelu(F.linear(x, local(self.w_in)), approximate="tanh")  # (B, T, ffn / tp)
        return tp_exit(F.linear(h, local(self.w_out)), self.tp_mesh)


class Block(nn.Module):
    """One pre-norm transformer block: the unit of sharding (`_no_split_modules`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only language model: `model(idx)` -> logits, `model(idx, targets)` -> loss."""

    # The Hugging Face convention, read by auto_wrap_policy="transformer".
    _no_split_modules = ["Block"]

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The token embedding is also the output head (weight tying): one parameter, used
        # at both ends of the root unit, so it is gathered once per pass.
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.wpe = nn.Parameter(torch.empty(cfg.block_size, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = LayerNorm(cfg.d_model)
        # Activation checkpointing: keep only each block's input; recompute the rest in
        # backward (the block's sharding hooks run again: engine/core/hooks.py).
        self.checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Only the parameters this module owns directly; see [Note: sharded init].
        _normal(self.wte, INIT_STD)
        _normal(self.wpe, INIT_STD)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        x = F.embedding(idx, self.wte) + self.wpe[:T]  # (B, T, C)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = F.linear(self.norm(x), self.wte)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `idx` (B, T).

        On a sharded model every rank must call this with the same input and an equally
        seeded generator: each forward is collective, and identical inputs keep the ranks
        in lockstep.
        """
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size :]
            logits = self(ctx)[:, -1, :].float() / max(temperature, 1e-5)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        return idx
