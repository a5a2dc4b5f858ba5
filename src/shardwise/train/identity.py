"""What a run trained on: keys of its data, tokenizer and model, kept in each checkpoint's
`extra`, so that a resume with other data, another tokenizer or another model is noticed
and refused (unless --data.reset) instead of silently continuing the old position, schedule
and optimizer state on something else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .config import Config

KINDS = ("data", "tokenizer", "model")


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def data_key(cfg: Config) -> str:
    """The text the run reads: every file's name and content, and how much of it is taken."""
    d = cfg.data
    how = json.dumps({"max_bytes": d.max_bytes, "val_fraction": d.val_fraction,
                      "seed": d.seed}).encode()
    if not d.path:
        return _hash(b"stdlib", how)
    from .data import user_files

    root = Path(d.path).expanduser()
    h = hashlib.sha256(how)
    for f in user_files(root):
        h.update(f.relative_to(root).as_posix().encode() if root.is_dir() else f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def run_keys(cfg: Config) -> dict[str, str]:
    if cfg.model.hf:
        from .hf_folder import model_key, tokenizer_key
        from .hf_inputs import data_key as token_key

        model, tok = model_key(cfg.model.hf), tokenizer_key(cfg.model.hf)
        # The token cache's keys (the data files' bytes and the tokenizer's files) of every
        # source and the evaluation set, and how they are sampled.
        return {"data": token_key(cfg), "tokenizer": tok,
                "model": model + _lora(cfg) + _quantized(cfg)}
    else:
        model = _hash(json.dumps(cfg.model.gpt().__dict__, sort_keys=True).encode())
        tok = "bytes"
    return {"data": data_key(cfg), "tokenizer": tok, "model": model}


def _lora(cfg: Config) -> str:
    lo = cfg.lora
    return f"+lora(r={lo.rank},alpha={lo.scale()},targets={lo.targets or '-'})" if lo.rank \
        else ""


def _quantized(cfg: Config) -> str:
    # The base a QLoRA run computes with is the NF4 of model.hf's weights, not the weights.
    return f"+{cfg.model.quantize}" if cfg.model.quantize else ""


def differences(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    return [k for k in KINDS if k in saved and saved[k] != now.get(k)]
