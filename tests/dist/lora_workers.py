"""peft LoRA on a meta-built, sharded model: materialize starts it as the base model, and
sw.save_adapter writes an adapter folder peft loads; activation checkpointing on the
built-in GPT gives the same numbers as without."""

from __future__ import annotations

import os

import torch

import shardwise as sw
from shardwise.engine.comm import collectives as C


def _lora(folder: str | None = None):  # -> the peft model, sharded, still on meta
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from tests.hf_models import tiny_config

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tiny_config("llama"))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                             target_modules=["q_proj", "v_proj"]))
    sw.shard_model(model, auto_wrap_policy="transformer")
    return model


def lora_materialize(rank: int, world: int, out: str) -> dict:
    model = _lora()
    # The route the issue reported: the model's own _init_weights draws B non-zero.
    sw.materialize(model, init_fn=model.get_base_model()._init_weights, seed=0)
    b_max = max(p.full_tensor().abs().max().item()
                for n, p in model.named_parameters() if "lora_B" in n)
    a_min = min(p.full_tensor().abs().max().item()
                for n, p in model.named_parameters() if "lora_A" in n)
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        adapted = model(input_ids=x).logits
        with model.disable_adapter():
            base = model(input_ids=x).logits
    # A non-zero B, so the saved adapter is not trivially zeros.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.to_local().fill_(0.5 + rank)
    path = os.path.join(out, "adapter")
    sw.save_adapter(path, model)
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters() if "lora_" in n}
    refused = ""
    try:
        sw.save_adapter(path, model)
    except ValueError as e:
        refused = str(e)
    C.barrier()
    return {"b_max": b_max, "a_min": a_min, "same": torch.equal(adapted, base),
            "full": {k: v.tolist() for k, v in full.items()}, "refused": refused}


def ac_parity(rank: int, world: int) -> dict:
    """The built-in GPT with and without activation checkpointing: the same losses and
    gradients, step by step."""
    from shardwise.train import options as O
    from shardwise.train.build import build_gpt

    out = {}
    for ac in (False, True):
        cfg = O.build({"model.preset": "tiny", "model.n_layer": "2",
                       "train.activation_checkpointing": str(ac)})
        model = build_gpt(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step * world + rank)
            x = torch.randint(0, 256, (2, 17), generator=g)
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[ac] = losses
    return out
