"""The checkpoint manifest: what a sharded checkpoint holds and where each row lives.

[Note: checkpoint format] A checkpoint is a directory:

    manifest.json            this file's JSON (written last: its presence marks a complete save)
    rank00000.safetensors    the rows one rank wrote (model shards and optimizer state)
    rank00001.safetensors    ...

Every tensor is described in the *2-D row view* of [Note: layout]: a tensor of shape
(D0, *rest) is D0 rows (a 0-d tensor is one row). Its entry in `tensors` names the global
shape, the dtype and its pieces `[file, row_start, row_end]`: the rows stored under the
tensor's own name in that file, in order, covering [0, D0) exactly. A tensor saved from
parameters sharded on another dim d ([Note: balanced shards]) says `"dim": d`: its rows are
slices along d, and each piece holds rows of `movedim(d, 0)` (shape (rows, *rest) with rest
the other dims in order), as the ranks hold them; a rank sharding it on another dim reads
it whole (slots.read_rows); such a checkpoint says `format_version` 2 (FORMAT_VERSION_DIMS), so
that an older shardwise refuses it instead of misreading its pieces. Names:

    model/<state-dict key>          a parameter or buffer (tied parameters once: `aliases`)
    optim/<param fqn>/<state name>  optimizer state shaped like its parameter (AdamW moments)

Scalar optimizer state (AdamW's `step`) and hyperparameters live in the JSON itself. `files`
holds each file's size and SHA-256; `sha256` is the hash of the canonical JSON of everything
else, so a damaged manifest is refused too. Nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .safetensors_io import dtype_from_name, dtype_name

FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1
# A checkpoint holding any tensor with rows on a dim other than 0 says version 2, so that a
# shardwise that predates the "dim" field refuses it rather than read its pieces as dim-0
# rows (a silent wrong load); one without such tensors stays version 1, readable by both.
FORMAT_VERSION_DIMS = 2
READABLE_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_DIMS)
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: missing, damaged, or not this model's."""


class CheckpointNotFoundError(CheckpointError, ValueError):
    """No checkpoint at the path given: a bad argument (ValueError) and a CheckpointError."""


def rank_file(global_rank: int) -> str:
    return f"rank{global_rank:05d}.safetensors"


def model_name(key: str) -> str:
    return f"model/{key}"


def optim_name(fqn: str, state: str) -> str:
    return f"optim/{fqn}/{state}"


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    # (file, row_start, row_end), sorted, covering [0, dim0) without gaps or overlaps.
    pieces: list[tuple[str, int, int]] = field(default_factory=list)
    # The dim whose slices are the rows (0 unless saved from shards on another dim).
    dim: int = 0

    @property
    def dim0(self) -> int:
        return self.shape[self.dim] if self.shape else 1

    @property
    def rest(self) -> tuple[int, ...]:
        return tuple(n for i, n in enumerate(self.shape) if i != self.dim)

    def to_json(self) -> dict[str, Any]:
        out = {"shape": list(self.shape), "dtype": dtype_name(self.dtype),
               "pieces": [list(p) for p in self.pieces]}
        if self.dim:
            out["dim"] = self.dim  # absent for dim 0: checkpoints as before
        return out


@dataclass
class Manifest:
    step: int | None
    extra: Any
    versions: dict[str, str]
    saved_by: dict[str, Any]
    files: dict[str, dict[str, Any]]  # name -> {"bytes": int, "sha256": str}
    tensors: dict[str, TensorInfo]
    model_keys: list[str]  # every state-dict key, in the saving model's order
    aliases: dict[str, str]  # tied key -> the key its tensor is stored under
    optimizer: dict[str, Any] | None

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION_DIMS if any(t.dim for t in self.tensors.values()) \
            else FORMAT_VERSION

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": self.format_version, "step": self.step,
            "extra": self.extra, "versions": self.versions, "saved_by": self.saved_by,
            "files": self.files,
            "model": {"keys": self.model_keys, "aliases": self.aliases},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "optimizer": self.optimizer,
        }

    def to_json(self) -> str:
        # Round-trip first so the digest sees exactly what a reader will parse (tuples become
        # lists, non-string keys strings).
        body = json.loads(json.dumps(self.body()))
        body["sha256"] = _digest(body)
        return _pretty(body)

    def model_tensor(self, key: str) -> TensorInfo | None:
        """The stored tensor behind state-dict key `key` (following a tied alias)."""
        return self.tensors.get(model_name(self.aliases.get(key, key)))


def _pretty(body: dict[str, Any]) -> str:
    """Readable and diffable: one line per top-level field, per file and per tensor."""
    lines = []
    for k, v in body.items():
        if isinstance(v, dict) and k in ("files", "tensors") and v:
            inner = [f"  {json.dumps(n)}: {json.dumps(x)}" for n, x in v.items()]
            lines.append(f" {json.dumps(k)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _digest(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def read_manifest(ckpt_dir: str) -> Manifest:
    """Parse and check `ckpt_dir/manifest.json`; CheckpointError naming the file if bad."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete shardwise checkpoint") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupted: {e}") from None
    try:
        return _parse(body, path)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is malformed: {type(e).__name__}: {e}") from None


def _parse(body: Any, path: str) -> Manifest:
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardwise checkpoint manifest")
    version = body.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format_version {version!r}; this shardwise reads "
                              f"versions {list(READABLE_VERSIONS)}")
    stored = body.pop("sha256", None)
    if stored != _digest(body):
        raise CheckpointError(f"{path} is corrupted: its checksum does not match its contents")
    files = body["files"]
    for name, info in files.items():
        if os.path.basename(name) != name or not isinstance(info["bytes"], int) \
                or not isinstance(info["sha256"], str):
            raise CheckpointError(f"{path}: bad entry for file {name!r}")
    tensors = {}
    for name, t in body["tensors"].items():
        info = TensorInfo(tuple(int(x) for x in t["shape"]), dtype_from_name(t["dtype"]),
                          [(str(f), int(a), int(b)) for f, a, b in t["pieces"]],
                          int(t.get("dim", 0)))
        if info.dim and version == FORMAT_VERSION:
            raise CheckpointError(f"{path}: {name} has rows on dim {info.dim} in a "
                                  f"format_version {FORMAT_VERSION} manifest (which has none)")
        if not 0 <= info.dim < max(len(info.shape), 1):
            raise CheckpointError(f"{path}: {name} has rows on dim {info.dim}, which a "
                                  f"tensor of shape {list(info.shape)} does not have")
        row = 0
        for f, a, b in info.pieces:
            if f not in files or a != row or b <= a:
                raise CheckpointError(f"{path}: {name} has a bad piece {[f, a, b]} "
                                      f"(expected rows from {row} in a listed file)")
            row = b
        if row != info.dim0:
            raise CheckpointError(f"{path}: {name} pieces cover rows [0, {row}), "
                                  f"not [0, {info.dim0})")
        tensors[name] = info
    model = body["model"]
    opt = body["optimizer"]
    if opt is not None and not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(f"{path}: optimizer entry has no param_groups list")
    return Manifest(
        step=body["step"], extra=body["extra"], versions=dict(body["versions"]),
        saved_by=dict(body["saved_by"]), files=dict(files), tensors=tensors,
        model_keys=[str(k) for k in model["keys"]], aliases=dict(model["aliases"]),
        optimizer=opt,
    )


def versions() -> dict[str, str]:
    import platform

    import safetensors

    from .. import __version__

    return {"shardwise": __version__, "torch": torch.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}
