"""Review: `shardwise export --hf` of a LoRA run merges as peft does (GPT-2 Conv1D too)."""

from __future__ import annotations

import os

import torch

from tests import hf_models as H


def merged_vs_peft(folder: str, targets: str, data: str, out: str) -> dict[str, float]:
    """Merge random adapters with hf_export._merged; compare with peft's merge_and_unload."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from shardwise.train import hf_export
    from shardwise.train.hf_model import lora_config
    from shardwise.train.options import build

    cfg = build({"model.hf": folder, "lora.rank": 4, "lora.targets": targets,
                 "data.path": data, "name": "x", "out_dir": os.path.dirname(out)})
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), lora_config(cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()  # as after training: B no longer zero
    adapters = {k: v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    ids = torch.arange(12).reshape(2, 6) % H.VOCAB
    pm.eval()
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    os.makedirs(out)
    from shardwise.checkpoint.export import DEFAULT_MAX_SHARD_BYTES

    hf_export._merged(cfg, adapters, out, DEFAULT_MAX_SHARD_BYTES)
    hf_export._copy_side_files(folder, out)
    got_model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = got_model(input_ids=ids).logits
    ref = pm.merge_and_unload().state_dict()
    wdiff = max((ref[k] - v).abs().max().item()
                for k, v in got_model.state_dict().items() if k in ref)
    return {"logits": (got - want).abs().max().item(), "weights": wdiff}
