"""Tiny Hugging Face models written with `save_pretrained` into a folder (nothing downloaded).

Shared by the tests of pretrained loading, `shardwise train --model.hf` and export. Sizes
are chosen so that no world size of 2-4 divides every dim 0 (vocab 53, kv projection 12,
MLP 40), and rotary head dims are even.

    folder = save_tiny("llama", tmp_path / "llama")              # model.safetensors
    folder = save_tiny("qwen2", tmp, max_shard_size="30KB")      # 2+ files + index
    model = meta_model(folder)                                   # built on the meta device
    ref = reference(folder)                                      # from_pretrained, fp32
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

KINDS = ("llama", "qwen2", "gpt2")
VOCAB = 53


def tiny_config(kind: str, **overrides: Any) -> Any:
    """A transformers config for a tiny `kind` model (eager attention: deterministic)."""
    import transformers as tf

    if kind == "gpt2":
        kw: dict[str, Any] = dict(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4,
                                  n_positions=32, bos_token_id=0, eos_token_id=1,
                                  attn_implementation="eager")
        kw.update(overrides)
        return tf.GPT2Config(**kw)
    kw = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
              bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    if kind == "llama":
        kw["tie_word_embeddings"] = False
        kw.update(overrides)
        return tf.LlamaConfig(**kw)
    if kind == "qwen2":
        kw["tie_word_embeddings"] = True
        kw.update(overrides)
        return tf.Qwen2Config(**kw)
    raise ValueError(f"kind={kind!r}: one of {KINDS}")


def build(kind: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialized tiny model (seeded), on the CPU, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))
    with torch.no_grad():  # biases and norms start at 0/1: make every value distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def save_tiny(kind: str, folder: str | os.PathLike, *, seed: int = 0,
              dtype: torch.dtype | None = None, max_shard_size: int | str | None = None,
              **overrides: Any) -> str:
    """Build a tiny `kind` model and `save_pretrained` it (safetensors) into `folder`.

    `dtype`: the stored dtype (the config records it); `max_shard_size` (e.g. "30KB") splits
    the weights into several files with a model.safetensors.index.json.
    """
    model = build(kind, seed, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    kw: dict[str, Any] = {}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(str(folder), **kw)
    return str(folder)


def meta_model(folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The folder's architecture built on the meta device (no weights), in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def reference(folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(folder)` in `dtype`: what loading must equal."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))
