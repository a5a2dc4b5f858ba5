"""The units a plan reasons about, in forward order, from a meta model or a bare count.

For a model this is exactly `shard_model`'s assignment (`engine.wrap`), so the plan and the
run agree about which parameters travel together. For a bare parameter count the units are
those of a GPT of the given (or guessed) shape: one per block plus the root, with the same
parameter shapes `shardwise.train.model.GPT` declares.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.quantize import NF4
from ..engine.api.fully_shard import ParamSpec, UnitSpec, assign_params, wrap_targets
from ..engine.core.policies import WrapPolicyLike, find_block_classes, resolve_wrap_policy
from .shape import TransformerShape, shape_of_model


@dataclass(frozen=True)
class PlanUnit:
    """A unit and the work attributed to it.

    spec: its parameters (engine.wrap.UnitSpec; name "" is the root).
    layers: transformer blocks whose activations and FLOPs run inside this unit's forward.
    head: the root: it holds the embedding, head and loss activations.
    """

    spec: UnitSpec
    layers: int
    head: bool

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.spec.params)


@dataclass(frozen=True)
class ModelUnits:
    """Units in forward order (the root first: its pre-hook runs before any child's)."""

    units: tuple[PlanUnit, ...]
    buffers_bytes: int
    shape: TransformerShape | None
    notes: tuple[str, ...] = ()
    # A QLoRA base: the parameters the loader holds as NF4 (checkpoint/quantize.py's
    # `frozen_linears`: frozen nn.Linear weights outside the spec's skip list).
    quantized: frozenset[str] = frozenset()

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)


def _is_within(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def units_of_model(model: nn.Module, policy: WrapPolicyLike,
                   shape: TransformerShape | None, quantize: NF4 | None = None) -> ModelUnits:
    """`shard_model`'s units for `model` (best built on the meta device: nothing allocated);
    `quantize`: the NF4 spec its frozen linears load with (`load_pretrained(quantize=)`)."""
    targets = wrap_targets(model, resolve_wrap_policy(policy, model))
    specs = {u.name: u for u in assign_params(model, targets)}
    order = [name for name, _ in model.named_modules() if name in specs]
    notes: list[str] = []

    # Attribute each transformer block to the deepest unit containing it: that unit's
    # forward is where the block's activations are created and its FLOPs are spent.
    layers = dict.fromkeys(order, 0)
    block_classes = tuple(find_block_classes(model))
    blocks = [n for n, m in model.named_modules() if block_classes and isinstance(m, block_classes)]
    for b in blocks:
        owner = max((u for u in order if _is_within(b, u)), key=len)
        layers[owner] += 1
    if shape is not None and len(blocks) != shape.n_layers:
        # Blocks not recognizable as modules: their work happens somewhere in the root.
        if blocks:
            notes.append(f"found {len(blocks)} blocks but the shape says {shape.n_layers}; "
                         "the difference is planned inside the root unit")
        layers[""] += shape.n_layers - len(blocks)

    units = tuple(PlanUnit(specs[n], layers[n], n == "") for n in order)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    quantized: frozenset[str] = frozenset()
    if quantize is not None:
        from ..checkpoint.quantize import frozen_linears

        quantized = frozenset(f"{n}.weight" for n, _ in frozen_linears(model, quantize))
        if not quantized:
            raise ValueError("quantize=nf4 finds no frozen nn.Linear weight to quantize: "
                             "freeze the base first (peft's get_peft_model does)")
    return ModelUnits(units, buffers, shape, tuple(notes), quantized)


def _is_gpt(s: TransformerShape) -> bool:
    """The block of `shardwise.train.model.GPT`: fused qkv, GELU MLP, no biases."""
    return (s.mlp == "gelu" and s.n_kv_heads == s.n_heads and s.q_dim == s.d_model
            and not (s.qkv_bias or s.out_bias or s.mlp_bias or s.norm_bias or s.n_experts))


def block_param_shapes(s: TransformerShape) -> dict[str, tuple[int, ...]]:
    """One block's parameters by name, as the model declares them. Names follow the
    model's own (our GPT's, else Hugging Face's Llama/Mixtral), so the TP plan
    (planner/tp.py) splits them as it would split the real model's."""
    d, f, q, kv = s.d_model, s.ffn_dim, s.q_dim, s.kv_dim
    if _is_gpt(s):
        return {"norm1.weight": (d,), "attn.w_qkv": (3 * d, d), "attn.w_out": (d, d),
                "norm2.weight": (d,), "mlp.w_in": (f, d), "mlp.w_out": (d, f)}
    out: dict[str, tuple[int, ...]] = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{norm}.weight"] = (d,)
        if s.norm_bias:
            out[f"{norm}.bias"] = (d,)
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[f"self_attn.{name}.weight"] = (rows, d)
        if s.qkv_bias:
            out[f"self_attn.{name}.bias"] = (rows,)
    out["self_attn.o_proj.weight"] = (d, q)
    if s.out_bias:
        out["self_attn.o_proj.bias"] = (d,)
    up = (s.mlp_matrices - 1) * f  # gate and up stacked, or up alone
    if s.n_experts:
        E = s.n_experts
        out["mlp.gate.weight"] = (E, d)  # the router
        out["mlp.experts.gate_up_proj"] = (E, up, d)
        out["mlp.experts.down_proj"] = (E, d, f)
        if s.mlp_bias:
            out["mlp.experts.gate_up_proj_bias"] = (E, up)
            out["mlp.experts.down_proj_bias"] = (E, d)
        return out
    names = ("gate_proj", "up_proj") if s.mlp == "gated" else ("up_proj",)
    for name in names:
        out[f"mlp.{name}.weight"] = (f, d)
        if s.mlp_bias:
            out[f"mlp.{name}.bias"] = (f,)
    out["mlp.down_proj.weight"] = (d, f)
    if s.mlp_bias:
        out["mlp.down_proj.bias"] = (d,)
    return out


def root_param_shapes(s: TransformerShape) -> dict[str, tuple[int, ...]]:
    """The root unit's parameters: embedding, position table, final norm, untied head."""
    d = s.d_model
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (s.vocab_size, d)}
    if s.max_seq_len:
        out["wpe.weight"] = (s.max_seq_len, d)
    out["norm.weight"] = (d,)
    if s.norm_bias:
        out["norm.bias"] = (d,)
    if not s.tied:
        out["lm_head.weight"] = (s.vocab_size, d)
    return out


def _specs(prefix: str, shapes: dict[str, tuple[int, ...]]) -> tuple[ParamSpec, ...]:
    pre = f"{prefix}." if prefix else ""
    return tuple(ParamSpec(pre + k, v, torch.float32, True) for k, v in shapes.items())


def synthetic_shape(params: int) -> TransformerShape:
    """A Llama-proportioned GPT (d_model = 128 x layers) with about `params` parameters,
    shrinking depth until the blocks leave room for an embedding table."""
    layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    while True:
        d = 128 * layers
        s = TransformerShape(n_layers=layers, d_model=d, n_heads=max(1, d // 128),
                             vocab_size=1)
        room = params - layers * s.block_params() - d
        if room >= d or layers == 1:
            vocab = max(1, min(32000, room // d))
            return TransformerShape(n_layers=layers, d_model=d, n_heads=s.n_heads,
                                    vocab_size=vocab)
        layers -= 1


def units_of_count(params: int, shape: TransformerShape | None,
                   policy: WrapPolicyLike) -> ModelUnits:
    """Units of a GPT with `params` parameters: per-block units (policy "transformer") or a
    single root unit (policy None). Parameters the shape does not explain (a wider MLP,
    biases, an untied head) are spread evenly over the blocks as one more parameter each,
    so the total is exactly `params` and no unit is distorted."""
    if policy is not None and (not isinstance(policy, str) or policy.lower() not in (
            "transformer", "none", "root")):
        raise ValueError(f"auto_wrap_policy={policy!r}: a bare parameter count can only be "
                         "planned with 'transformer' (one unit per block) or None (one unit)")
    per_block = policy is not None and policy.lower() == "transformer"
    notes = []
    if shape is None:
        shape = synthetic_shape(params)
        notes.append(f"shape guessed from the parameter count: {shape.n_layers} layers x "
                     f"{shape.d_model} wide, vocab {shape.vocab_size} (give a shape to set it)")
    extra = params - shape.params()
    if extra < 0:
        raise ValueError(f"params={params:,} is smaller than the shape's own "
                         f"{shape.params():,} parameters ({shape})")
    root_params = _specs("", root_param_shapes(shape))
    one_block = block_param_shapes(shape)
    blocks = [_specs(f"blocks.{i}", one_block) for i in range(shape.n_layers)]
    L = shape.n_layers
    for i in range(L):
        share = extra // L + (1 if i < extra % L else 0)
        if share:  # taken to be matmul weights: TP splits them too (planner/tp.py)
            blocks[i] += (ParamSpec(f"blocks.{i}.other", (share,), torch.float32, True),)
    if extra > 0.02 * params:
        notes.append(f"{extra:,} parameters beyond the shape's {shape.params():,} are "
                     "spread over the blocks")
    if per_block:
        units = [PlanUnit(UnitSpec("", tuple(root_params)), 0, True)]
        units += [PlanUnit(UnitSpec(f"blocks.{i}", b), 1, False) for i, b in enumerate(blocks)]
    else:
        flat = tuple(root_params) + tuple(p for b in blocks for p in b)
        units = [PlanUnit(UnitSpec("", flat), shape.n_layers, True)]
    return ModelUnits(tuple(units), 0, shape, tuple(notes))


def resolve_model(what: object, shape: TransformerShape | None) -> object:
    """A Hugging Face config (preset name, path or dict) read into its TransformerShape;
    anything else as it is."""
    if not isinstance(what, nn.Module) and hasattr(what, "model_type") and callable(
            getattr(what, "to_dict", None)):
        what = what.to_dict()  # a transformers PretrainedConfig
    if isinstance(what, (str, os.PathLike, dict)):
        from .hf_config import load_shape

        if shape is not None:
            raise ValueError(f"shape={shape!r}: a config carries its own shape; pass shape= "
                             "only with a bare parameter count")
        try:
            return load_shape(what)[0]
        except ValueError as e:
            raise ValueError(f"model_or_param_count={what!r}: {e}") from None
    return what


def model_units(what: object, policy: WrapPolicyLike,
                shape: TransformerShape | None, quantize: NF4 | None = None) -> ModelUnits:
    """The units of a model, a config, a shape or a bare parameter count; `quantize` (a
    model's frozen linears in NF4) needs a model."""
    what = resolve_model(what, shape)
    if isinstance(what, ModelUnits):
        return what
    if isinstance(what, nn.Module):
        return units_of_model(what, policy, shape or shape_of_model(what), quantize)
    if quantize is not None:
        raise ValueError("quantize=nf4 needs a model (built on the meta device, its base "
                         "frozen by peft) to know which weights are frozen linears; a config, "
                         "shape or count has none (shardwise plan: --model.hf DIR or --config "
                         "with --lora.rank)")
    if isinstance(what, TransformerShape):
        if shape is not None and shape != what:
            raise ValueError(f"shape={shape!r}: the model is already a TransformerShape")
        return units_of_count(what.params(), what, policy)
    if isinstance(what, (int, float)) and not isinstance(what, bool) and 1 <= what < math.inf:
        return units_of_count(int(round(what)), shape, policy)
    raise ValueError(f"model_or_param_count={what!r} must be an nn.Module (ideally on the "
                     "meta device), a Hugging Face config (a preset name, a config.json path "
                     "or a dict), a TransformerShape or a positive parameter count")
