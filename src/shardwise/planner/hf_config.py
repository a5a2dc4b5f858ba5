"""A transformer's shape from a Hugging Face `config.json`, and the presets shipped with
shardwise (planner/configs/*.json: the published configs of the models people train).

Each architecture is read the way its `transformers` modeling file builds the model, so
the parameter count of the shape equals the count of the model built from the same config
(tests/unit/test_plan_config.py builds each on the meta device and compares, exactly):

- llama, mistral, gemma: q/k/v/o projections (grouped kv heads), a gated MLP (gate, up,
  down), two norms per block and a final one, RMSNorm gains only; llama and gemma bias all
  four projections when `attention_bias`, llama the MLP when `mlp_bias`; gemma ties the head
  by default and has its own head_dim (256 by default);
- qwen2: as llama, with biases on q, k and v (always) and none on o;
- mixtral: as mistral with `num_local_experts` gated MLPs and a router per block,
  `num_experts_per_tok` of them per token;
- gpt2: a learned position table, fused qkv, a GELU MLP of `n_inner` (4 x n_embd), every
  linear layer and LayerNorm biased, the head tied.

Only the dimensions are read: a field the count needs and the file lacks is an error, not
a guess. Optional fields take the defaults of the architecture's config class.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from .shape import TransformerShape

# model_type -> the config.json field each shape field comes from (required ones first).
_LLAMA_LIKE = {"d_model": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "vocab_size": "vocab_size",
               "ffn_dim": "intermediate_size"}
_GPT2 = {"d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
         "vocab_size": "vocab_size", "max_seq_len": "n_positions"}
ARCHITECTURES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE, "gemma": _LLAMA_LIKE, "gpt2": _GPT2,
}
# Each class's default for `tie_word_embeddings` (transformers' configuration_*.py).
_TIED_BY_DEFAULT = {"gemma", "gpt2"}

PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b", "qwen2-7b", "mixtral-8x7b")


def _int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    v = cfg.get(key)
    if v is None:
        if default is not None:
            return default
        raise ValueError(f"{source}: the field {key!r} is missing (a "
                         f"{cfg.get('model_type')} config needs "
                         f"{', '.join(ARCHITECTURES[cfg['model_type']].values())})")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{source}: {key}={v!r} must be a positive int")
    return v


def _bool(cfg: dict[str, Any], key: str, default: bool, source: str) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{source}: {key}={v!r} must be true or false")
    return v


def model_type_of(cfg: dict[str, Any], source: str) -> str:
    """The architecture a config describes: `model_type`, else its `architectures` entry."""
    mt = cfg.get("model_type")
    if not mt:
        archs = cfg.get("architectures") or []
        by_class = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "MixtralForCausalLM": "mixtral",
                    "GemmaForCausalLM": "gemma", "GPT2LMHeadModel": "gpt2"}
        mt = next((by_class[a] for a in archs if a in by_class), None)
        if mt is None:
            raise ValueError(f"{source}: no model_type (and architectures={archs!r} names no "
                             f"supported class); supported: {', '.join(sorted(ARCHITECTURES))}")
    if mt not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type={mt!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return mt


def shape_from_hf(cfg: dict[str, Any], source: str = "config") -> TransformerShape:
    """The shape a Hugging Face config describes (ValueError naming what is missing)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: a config must be a JSON object, not {type(cfg).__name__}")
    mt = model_type_of(cfg, source)
    cfg = {**cfg, "model_type": mt}
    dims = {k: _int(cfg, key, source) for k, key in ARCHITECTURES[mt].items()}
    tied = _bool(cfg, "tie_word_embeddings", mt in _TIED_BY_DEFAULT, source)
    if mt == "gpt2":
        d = dims["d_model"]
        return TransformerShape(**dims, ffn_dim=_int(cfg, "n_inner", source, 4 * d),
                                tied=tied, qkv_bias=True, out_bias=True, mlp_bias=True,
                                norm_bias=True)
    heads = dims["n_heads"]
    head_dim = _int(cfg, "head_dim", source,
                    256 if mt == "gemma" else dims["d_model"] // heads)
    attention_bias = mt in ("llama", "gemma") and _bool(cfg, "attention_bias", False, source)
    experts = top_k = 0
    if mt == "mixtral":
        experts = _int(cfg, "num_local_experts", source, 8)
        top_k = _int(cfg, "num_experts_per_tok", source, 2)
    return TransformerShape(
        **dims, n_kv_heads=_int(cfg, "num_key_value_heads", source, heads), head_dim=head_dim,
        mlp="gated", tied=tied, qkv_bias=attention_bias or mt == "qwen2",
        out_bias=attention_bias,
        mlp_bias=mt == "llama" and _bool(cfg, "mlp_bias", False, source),
        n_experts=experts, top_k=top_k,
        context=_int(cfg, "max_position_embeddings", source, 0) if cfg.get(
            "max_position_embeddings") is not None else 0)


def read_config(what: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the config dict, a label) for a preset name, a config.json or a folder holding one."""
    name = str(what)
    if name.lower() in PRESETS:
        text = resources.files(__package__).joinpath(f"configs/{name.lower()}.json").read_text()
        return json.loads(text), name.lower()
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "config.json file or a folder holding one")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name!r}: not a readable JSON file ({e})") from None
    return cfg, str(path)


def load_shape(what: str | os.PathLike[str] | dict[str, Any]) -> tuple[TransformerShape, str]:
    """(shape, label): `what` is a preset name, a path or an already-read config dict."""
    if isinstance(what, dict):
        return shape_from_hf(what, "config"), str(what.get("model_type", "config"))
    cfg, label = read_config(what)
    shape = shape_from_hf(cfg, f"config {label!r}")
    return shape, label
