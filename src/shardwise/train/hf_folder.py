"""A local Hugging Face model folder, read without transformers: what it holds and the keys
that identify it (a resume refuses another model silently standing in for the run's).

A folder is `save_pretrained`'s output: config.json, model.safetensors (or shards plus
model.safetensors.index.json) and the tokenizer's files. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja")
# Besides the weights: what export --hf copies so that from_pretrained finds everything.
CONFIG_FILES = ("config.json", "generation_config.json")


def check_folder(path: str) -> None:
    """A folder with config.json and safetensors weights, or a ValueError naming what lacks."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model.hf={path!r} is not a folder (give a local folder written by "
                         "save_pretrained: config.json, safetensors weights, tokenizer files)")
    if not (p / "config.json").is_file():
        raise ValueError(f"model.hf={path!r} has no config.json (give a folder written by "
                         "save_pretrained)")
    if not any((p / w).is_file() for w in WEIGHTS):
        has_bin = any(p.glob("*.bin"))
        raise ValueError(f"model.hf={path!r} has no model.safetensors or "
                         "model.safetensors.index.json" + (
                             " (only pickled .bin weights, which shardwise never loads: "
                             "convert with save_pretrained(..., safe_serialization=True))"
                             if has_bin else ""))
    config(path)


def config(path: str) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.hf={path!r}: config.json is not readable JSON ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"model.hf={path!r}: config.json has no model_type")
    return data


def max_positions(path: str) -> int:
    return positions_of(config(path))


def positions_of(c: dict) -> int:
    """The positions a model's config.json declares (2048 when it names none)."""
    for k in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        if isinstance(c.get(k), int) and c[k] > 0:
            return int(c[k])
    return 2048


def has_tokenizer(path: str) -> bool:
    p = Path(path)
    return (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file() or (
        (p / "vocab.json").is_file() and (p / "merges.txt").is_file())


def _digest(files: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes() if f.stat().st_size < 64 * 2**20 else _header(f))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _header(f: Path) -> bytes:
    """A large weight file's identity: its safetensors header (names, dtypes, shapes,
    offsets) and size, not its gigabytes of content."""
    with f.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return fh.read(min(n, 2**26)) + str(f.stat().st_size).encode()


def model_key(path: str) -> str:
    """Identifies the pretrained model: config.json and the weight files."""
    p = Path(path)
    files = [p / "config.json"] + sorted(p.glob("*.safetensors")) + (
        [p / WEIGHTS[1]] if (p / WEIGHTS[1]).is_file() else [])
    return _digest(files, p)


def tokenizer_key(path: str) -> str:
    p = Path(path)
    return _digest([p / n for n in TOKENIZER_FILES if (p / n).is_file()], p)
