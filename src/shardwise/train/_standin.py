"""TEMPORARY: full-tensor loading until sw.load_pretrained is merged."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

import shardwise as sw


def load_pretrained(model: nn.Module, path: str, *, strict: bool = True) -> None:
    from safetensors import safe_open

    p = Path(path)
    idx = p / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() \
        else ["model.safetensors"]
    stored = {}
    for f in files:
        with safe_open(str(p / f), "pt") as fh:
            for k in fh.keys():
                stored[k] = fh.get_tensor(k)
    sd = {}
    for key in model.state_dict():
        k = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if k in stored:
            sd[key] = stored[k]
        elif k == "lm_head.weight" and "model.embed_tokens.weight" in stored:
            sd[key] = stored["model.embed_tokens.weight"]
    sw.load_full_state_dict(model, sd, strict=False)


def hf_split(cfg):  # -> data.Split of token ids
    import torch
    from transformers import AutoTokenizer

    from . import data as D

    tok = AutoTokenizer.from_pretrained(cfg.model.hf, local_files_only=True)
    text = D.read_corpus(cfg.data.path or None, cfg.data.max_bytes, cfg.data.seed)
    ids = tok(text.decode("utf-8", errors="replace"))["input_ids"]
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    t = torch.tensor(ids, dtype=torch.int32)
    n_val = D._val_bytes(len(t), cfg.data.val_fraction, cfg.model.seq_len())
    return D.Split(train=t[: len(t) - n_val], val=t[len(t) - n_val:])
