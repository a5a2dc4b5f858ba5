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
