"""The shape of a transformer, and what one step of it saves for backward and computes.

The shape covers the decoder families people train: grouped-query attention (n_kv_heads),
a gated MLP (SwiGLU / GeGLU: three matrices), tied or untied embeddings, the biases some
architectures carry, and a mixture of experts (memory counts every expert, FLOPs the top_k
a token runs through). planner/hf_config.py reads it from a Hugging Face config.json.

Activation bytes are written for the pre-norm GPT block of `shardwise.train.model` (and any
block built the same way: norm -> q/k/v -> `scaled_dot_product_attention` -> out
projection; norm -> MLP). Each term below is a tensor autograd keeps alive from forward to
backward; the unit test counts them with `torch.autograd.graph.saved_tensors_hooks` on the
real GPT, so the two cannot drift apart silently (for the gated and MoE terms, which no
built-in model runs, the formula is the count of the tensors such a block saves).
Compare Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), whose 34*s*b*h + 5*a*s^2*b counts dropout masks and the s x s
attention matrix that fused attention never stores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

INDEX_BYTES = 8  # int64 token ids
FP32 = 4


MLPS = ("gelu", "gated")  # two matrices (up, down) or three (gate, up, down: SwiGLU, GeGLU)
_FLAGS = ("tied", "qkv_bias", "out_bias", "mlp_bias", "norm_bias")
_OPTIONAL = ("ffn_dim", "max_seq_len", "n_kv_heads", "head_dim", "n_experts", "top_k",
             "context")


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's dimensions.

    n_layers: transformer blocks.
    d_model: width of the residual stream.
    n_heads: attention (query) heads per block.
    vocab_size: rows of the token embedding (and of the output head).
    ffn_dim: hidden width of the MLP, of each expert under MoE (0: 4 * d_model).
    max_seq_len: rows of a learned position table (0: none, e.g. rotary positions).
    n_kv_heads: key/value heads, grouped-query attention (0: n_heads).
    head_dim: width of one head (0: d_model / n_heads; Gemma's is wider).
    mlp: "gelu" (up, activation, down: two matrices) or "gated" (SwiGLU / GeGLU: gate, up
      and down, three matrices).
    tied: the output head is the embedding (one table) or its own matrix.
    qkv_bias, out_bias, mlp_bias: biases on q/k/v, on the attention output, on the MLP's
      matrices (Qwen2 has the first; GPT-2 all three).
    norm_bias: LayerNorm with a bias (GPT-2) rather than a gain alone (RMSNorm, our GPT).
    n_experts, top_k: a mixture of experts in every block (0: dense): n_experts MLPs and a
      router (a d_model x n_experts matrix); each token runs through top_k of them.
    context: the context length when it is not a position table (0: max_seq_len).
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    ffn_dim: int = 0
    max_seq_len: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    mlp: str = "gelu"
    tied: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    n_experts: int = 0
    top_k: int = 0
    context: int = 0

    def __post_init__(self) -> None:
        for f in fields(TransformerShape):  # a subclass checks its own fields
            v = getattr(self, f.name)
            if f.name == "mlp":
                if v not in MLPS:
                    raise ValueError(f"TransformerShape.mlp={v!r} is not one of: "
                                     f"{', '.join(MLPS)}")
            elif f.name in _FLAGS:
                if not isinstance(v, bool):
                    raise ValueError(f"TransformerShape.{f.name}={v!r} must be a bool")
            else:
                low = 0 if f.name in _OPTIONAL else 1
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    raise ValueError(f"TransformerShape.{f.name}={v!r} must be an int >= {low}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"TransformerShape: n_heads={self.n_heads} must divide "
                             f"d_model={self.d_model} (or give head_dim)")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"TransformerShape: n_kv_heads={kv} must divide "
                             f"n_heads={self.n_heads} (each kv head serves a group of heads)")
        if bool(self.n_experts) != bool(self.top_k) or self.top_k > self.n_experts:
            raise ValueError(f"TransformerShape: top_k={self.top_k} must be in "
                             f"[1, n_experts={self.n_experts}] with experts, 0 without")
        defaults = {"ffn_dim": 4 * self.d_model, "n_kv_heads": self.n_heads,
                    "head_dim": self.d_model // self.n_heads}
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

    # --- dimensions --------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "gated" else 2

    @property
    def active_experts(self) -> int:
        """MLPs each token runs through: top_k under MoE, else the one."""
        return self.top_k or 1

    @property
    def context_length(self) -> int:
        return self.context or self.max_seq_len

    # --- parameters ------------------------------------------------------------------------

    def attention_params(self) -> int:
        d, q, kv = self.d_model, self.q_dim, self.kv_dim
        return (d * q + 2 * d * kv + q * d  # q, k, v, out projections
                + (q + 2 * kv if self.qkv_bias else 0) + (d if self.out_bias else 0))

    def expert_params(self) -> int:
        """One MLP (one expert under MoE)."""
        d, f, m = self.d_model, self.ffn_dim, self.mlp_matrices
        return m * d * f + ((m - 1) * f + d if self.mlp_bias else 0)

    def mlp_params(self) -> int:
        if self.n_experts:
            return self.n_experts * self.expert_params() + self.d_model * self.n_experts
        return self.expert_params()

    def norm_params(self) -> int:
        """One norm: a gain per channel, and a bias for a LayerNorm that has one."""
        return self.d_model * (2 if self.norm_bias else 1)

    def block_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def root_params(self) -> int:
        d = self.d_model
        tables = (1 if self.tied else 2) * self.vocab_size * d  # embedding (+ untied head)
        return tables + self.max_seq_len * d + self.norm_params()  # positions, final norm

    def params(self) -> int:
        return self.n_layers * self.block_params() + self.root_params()

    # --- FLOPs (per token, forward + backward) --------------------------------------------

    def block_matmul_params(self) -> int:
        """Matmul weights one token multiplies in a block: every attention projection, the
        top_k experts it is routed to (not all of them) and the router."""
        d = self.d_model
        router = d * self.n_experts
        mlp = self.active_experts * self.mlp_matrices * d * self.ffn_dim
        return 2 * d * self.q_dim + 2 * d * self.kv_dim + mlp + router

    def block_matmul_flops_per_token(self) -> float:
        """6 x matmul params: 2 forward, 4 backward (input and weight gradients)."""
        return 6 * self.block_matmul_params()

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Causal attention (PaLM appendix B): QK^T and AV are 2*T*q_dim FLOPs each per
        token forward; causal masking halves them, and backward doubles forward:
        3 * 2 * 2 * T * q_dim / 2 = 6 * T * q_dim (grouped kv heads do not change it)."""
        return 6 * seq_len * self.q_dim

    def block_flops_per_token(self, seq_len: int) -> float:
        return self.block_matmul_flops_per_token() + self.attention_flops_per_token(seq_len)

    def root_flops_per_token(self) -> float:
        return 6 * self.vocab_size * self.d_model  # the output head; lookups are free

    def flops_per_token(self, seq_len: int) -> float:
        return self.n_layers * self.block_flops_per_token(seq_len) + self.root_flops_per_token()

    # --- activations (bytes per token) ----------------------------------------------------

    def attention_saved_elems(self) -> int:
        """Per token, saved by attention beyond the residual stream: q, k and v (the
        projections' outputs, saved by attention) and its output (saved by the out
        projection)."""
        return self.q_dim + 2 * self.kv_dim + self.q_dim

    def mlp_saved_elems(self) -> int:
        """Per token, saved inside the MLP beyond its input: the up projection's output and
        the activation's (GELU), or gate, up, act(gate) and their product (gated); under
        MoE once per routed expert, plus the router's logits."""
        per = (4 if self.mlp == "gated" else 2) * self.ffn_dim
        return self.active_experts * per + self.n_experts

    def block_activation_bytes(self, act_bytes: int) -> int:
        """Saved for backward by one block, per token, in the compute dtype `act_bytes`."""
        d = self.d_model
        elems = (
            d  # norm1 input (the residual stream)
            + d  # norm1 output = q/k/v projections' input
            + d  # norm2 input (stream after the attention residual)
            + d  # norm2 output = MLP input
            + self.attention_saved_elems()
            + self.mlp_saved_elems()
        )
        stats = 2 * 2 * act_bytes  # mean and rstd of both norms, one value per token each
        lse = self.n_heads * FP32  # attention's log-sum-exp per head, always fp32
        return elems * act_bytes + stats + lse

    def block_input_bytes(self, act_bytes: int) -> int:
        """Per token: what activation checkpointing keeps of a block (its input)."""
        return self.d_model * act_bytes

    def block_backward_transient_bytes(self, act_bytes: int) -> int:
        """Extra bytes per token while one block runs backward: the gradients in flight.

        The widest moment is the MLP: the incoming stream gradient (d), the gradients of
        the MLP's hidden tensors (f each: 2 for GELU, 3 gated, per routed expert), and the
        unit's full weight gradients (counted separately as unsharded gradients).
        """
        hidden = (self.mlp_matrices * self.active_experts) * self.ffn_dim
        return (self.d_model + hidden) * act_bytes

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

    def to_dict(self) -> dict[str, int | str | bool]:
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
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else getattr(
        cfg, "model_type", None)
    if isinstance(model_type, str) and model_type:  # a Hugging Face config
        from .hf_config import ARCHITECTURES, shape_from_hf

        if model_type in ARCHITECTURES:
            d = cfg if isinstance(cfg, dict) else cfg.to_dict()  # type: ignore[attr-defined]
            return shape_from_hf(d, type(cfg).__name__)
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
    if model_type and get("max_position_embeddings", None) == values.get("max_seq_len"):
        # Another Hugging Face architecture: its positions are rarely a learned table.
        values["context"] = values.pop("max_seq_len")
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

