"""The shape of a transformer, and what one step of it saves for backward and computes.

Activation bytes are written for the pre-norm GPT block of `shardwise.train.model` (and any
block built the same way: LayerNorm -> fused qkv -> `scaled_dot_product_attention` -> out
projection; LayerNorm -> up projection -> GELU -> down projection). Each term below is a
tensor autograd keeps alive from forward to backward; the unit test counts them with
`torch.autograd.graph.saved_tensors_hooks` on the real model, so the two cannot drift apart
silently. Compare Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), whose 34*s*b*h + 5*a*s^2*b counts dropout masks and the s x s
attention matrix that fused attention never stores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

INDEX_BYTES = 8  # int64 token ids
FP32 = 4


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's dimensions.

    n_layers: transformer blocks.
    d_model: width of the residual stream.
    n_heads: attention heads per block.
    vocab_size: rows of the token embedding (tied to the output head).
    ffn_dim: hidden width of the MLP (0: 4 * d_model).
    max_seq_len: rows of the learned position table (0: none).
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    ffn_dim: int = 0
    max_seq_len: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name in ("ffn_dim", "max_seq_len") else 1
            if not isinstance(v, int) or v < low:
                raise ValueError(f"TransformerShape.{f.name}={v!r} must be an int >= {low}")
        if self.d_model % self.n_heads:
            raise ValueError(f"TransformerShape: n_heads={self.n_heads} must divide "
                             f"d_model={self.d_model}")
        if not self.ffn_dim:
            object.__setattr__(self, "ffn_dim", 4 * self.d_model)

    # --- parameters ------------------------------------------------------------------------

    def block_params(self) -> int:
        d, f = self.d_model, self.ffn_dim
        return 2 * d + 4 * d * d + 2 * d * f  # two norm gains, qkv + out, MLP in + out

    def root_params(self) -> int:
        d = self.d_model
        return (self.vocab_size + self.max_seq_len) * d + d  # tied embedding, positions, norm

    def params(self) -> int:
        return self.n_layers * self.block_params() + self.root_params()

    # --- FLOPs (per token, forward + backward) --------------------------------------------

    def block_matmul_flops_per_token(self) -> float:
        """6 x matmul params: 2 forward, 4 backward (input and weight gradients)."""
        d, f = self.d_model, self.ffn_dim
        return 6 * (4 * d * d + 2 * d * f)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Causal attention (PaLM appendix B): QK^T and AV are 2*T*d FLOPs each per token
        forward; causal masking halves them, and backward doubles forward:
        3 * 2 * 2 * T * d / 2 = 6 * T * d."""
        return 6 * seq_len * self.d_model

    def block_flops_per_token(self, seq_len: int) -> float:
        return self.block_matmul_flops_per_token() + self.attention_flops_per_token(seq_len)

    def root_flops_per_token(self) -> float:
        return 6 * self.vocab_size * self.d_model  # the tied output head; lookups are free

    def flops_per_token(self, seq_len: int) -> float:
        return self.n_layers * self.block_flops_per_token(seq_len) + self.root_flops_per_token()

    # --- activations (bytes per token) ----------------------------------------------------

    def block_activation_bytes(self, act_bytes: int) -> int:
        """Saved for backward by one block, per token, in the compute dtype `act_bytes`."""
        d, f = self.d_model, self.ffn_dim
        elems = (
            d  # norm1 input (the residual stream)
            + d  # norm1 output = qkv projection input
            + 3 * d  # qkv output: q, k, v are views of it, saved by attention
            + d  # attention output, saved by attention and (as a view) by the out projection
            + d  # norm2 input (stream after the attention residual)
            + d  # norm2 output = MLP up-projection input
            + f  # up-projection output = GELU input
            + f  # GELU output = down-projection input
        )
        stats = 2 * 2 * act_bytes  # mean and rstd of both norms, one value per token each
        lse = self.n_heads * FP32  # attention's log-sum-exp per head, always fp32
        return elems * act_bytes + stats + lse

    def block_input_bytes(self, act_bytes: int) -> int:
        """Per token: what activation checkpointing keeps of a block (its input)."""
        return self.d_model * act_bytes

    def block_backward_transient_bytes(self, act_bytes: int) -> int:
        """Extra bytes per token while one block runs backward: the gradients in flight.

        The widest moment is the MLP: the incoming stream gradient (d), the gradient of the
        GELU output and of its input (f each), and the unit's full weight gradients (counted
        separately as unsharded gradients).
        """
        return (self.d_model + 2 * self.ffn_dim) * act_bytes

    def root_activation_bytes(self, act_bytes: int) -> int:
        """Saved outside the blocks, per token: embedding ids, final norm, head, loss."""
        d, v = self.d_model, self.vocab_size
        return (
            2 * INDEX_BYTES  # token ids (embedding backward) and targets (the loss)
            + d * act_bytes  # final norm input
            + 2 * act_bytes  # its mean and rstd
            + d * act_bytes  # head input (final norm output)
            + v * FP32  # log-softmax output: the model upcasts logits to fp32 for the loss
        )

    def root_transient_bytes(self, act_bytes: int) -> int:
        """Per token at the end of forward / start of backward, beyond the saved tensors:
        logits in the compute dtype plus their fp32 copy (forward), then their gradients."""
        return self.vocab_size * (act_bytes + FP32)

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_NAMES = {
    "n_layers": ("n_layer", "n_layers", "num_hidden_layers", "num_layers"),
    "d_model": ("d_model", "n_embd", "hidden_size", "dim"),
    "n_heads": ("n_head", "n_heads", "num_attention_heads"),
    "vocab_size": ("vocab_size",),
    "ffn_dim": ("ffn_dim", "d_ff", "intermediate_size"),
    "max_seq_len": ("block_size", "max_position_embeddings", "max_seq_len"),
}


def shape_from_config(cfg: object) -> TransformerShape | None:
    """Read a config object (GPTConfig, a Hugging Face config, a dict) if it has a shape."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    values: dict[str, int] = {}
    for field_name, names in _NAMES.items():
        for n in names:
            v = get(n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                values[field_name] = v
                break
    if not all(k in values for k in ("n_layers", "d_model", "n_heads", "vocab_size")):
        return None
    return TransformerShape(**values)


def shape_of_model(model: nn.Module) -> TransformerShape | None:
    """The shape of a model that carries its config (`.cfg` or `.config`), else None."""
    for attr in ("cfg", "config"):
        cfg = getattr(model, attr, None)
        if cfg is not None:
            shape = shape_from_config(cfg)
            if shape is not None:
                return shape
    return None


def coerce_shape(value: TransformerShape | dict | None) -> TransformerShape | None:
    if value is None or isinstance(value, TransformerShape):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(TransformerShape)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"shape has unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        return TransformerShape(**value)
    raise ValueError(f"shape={value!r} must be a TransformerShape, a dict or None")

