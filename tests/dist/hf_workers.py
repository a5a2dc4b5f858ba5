"""Hugging Face models built from configs (nothing downloaded), and peft LoRA on them."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from tests.dist.harness import run_parity

VOCAB = 53


def _config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, attn_implementation="eager")
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(tie_word_embeddings=False, **common)
    return tf.Qwen2ForCausalLM, tf.Qwen2Config(tie_word_embeddings=True, **common)


def build(kind: str, lora: bool) -> nn.Module:
    cls, cfg = _config(kind)
    model = cls(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]))
        with torch.no_grad():  # B starts at zero: make every adapter gradient non-trivial
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model


def _batch(step: int, n: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (n, 9), generator=g)
    return ids, ids.clone()


def _loss(m: nn.Module, b: tuple) -> torch.Tensor:
    return m(input_ids=b[0], labels=b[1]).loss


def hf_parity(rank: int, world: int, cases: tuple[tuple[str, bool, str], ...]) -> dict:
    out = {}
    for kind, lora, strategy in cases:
        def make(kind: str = kind, lora: bool = lora) -> nn.Module:
            return build(kind, lora)

        def shard(m: nn.Module, strategy: str = strategy) -> None:
            # "transformer" reads the model's _no_split_modules (the decoder layer class).
            sw.shard_model(m, sharding_strategy=strategy, auto_wrap_policy="transformer")

        # Labels are shifted inside the model, so each rank's loss is a mean over the same
        # number of tokens and the ranks' mean is the full batch's loss.
        out[f"{kind}/lora={lora}/{strategy}"] = run_parity(
            rank, world, make, shard, _batch, _loss, what=f"{kind} lora={lora} {strategy}")
    return out
