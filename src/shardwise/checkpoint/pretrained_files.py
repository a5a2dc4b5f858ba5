"""Where pretrained weights are on disk, and reading blocks of them through bounded mmaps.

A path given to `load_pretrained` resolves to safetensors files and the tensors in them:

    folder/model.safetensors.index.json    Hugging Face's sharded layout (and shardwise's export)
    folder/model.safetensors               one file
    folder/adapter_model.safetensors       a peft adapter folder (no base weights beside it)
    file.safetensors                       that one file

Only headers are read here (shapes, dtypes and where each tensor's bytes are);
block_reader.py reads tensor blocks ([Note: bounded reads]).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from .manifest import MANIFEST, CheckpointError
from .reader import _ST_TO_NAME
from .safetensors_io import data_offsets, dtype_from_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER = "adapter_model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    key: str  # the key in the file
    file: str  # absolute path of the file holding it
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # where its bytes start in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class PretrainedFiles:
    path: str  # what the caller gave, absolute
    files: list[str]
    tensors: dict[str, StoredTensor]  # checkpoint key -> where it is
    tied: dict[str, str]  # shardwise export: tied key -> the key that stores it


def _dtype(st: str, where: str) -> torch.dtype:
    name = _ST_TO_NAME.get(st)
    if name is None:
        raise CheckpointError(f"{where}: dtype {st} is not supported; supported: "
                              f"{sorted(_ST_TO_NAME)}")
    return dtype_from_name(name)


def _header(path: str) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Every tensor of one safetensors file (header only), and its metadata."""
    try:
        # safe_open validates the header (offsets against shapes and the file's size).
        f = safe_open(path, framework="pt")
        start, offsets = data_offsets(path)
        out = {}
        for key in f.keys():
            sl = f.get_slice(key)
            st = StoredTensor(key, path, tuple(sl.get_shape()),
                              _dtype(sl.get_dtype(), f"{path}: {key}"), start + offsets[key][0])
            if offsets[key][1] - offsets[key][0] != st.nbytes:
                raise CheckpointError(f"{path}: {key} holds {offsets[key][1] - offsets[key][0]} "
                                      f"bytes, its shape and dtype need {st.nbytes}")
            out[key] = st
        return out, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _index_files(root: str) -> tuple[list[str], dict[str, str]]:
    """The files an index names, and key -> file name."""
    where = os.path.join(root, INDEX)
    try:
        with open(where) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} cannot be read: {e}") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{where} has no weight_map of key -> file name")
    names = sorted(set(wmap.values()))
    for n in names:
        if os.path.basename(n) != n or not n.endswith(".safetensors"):
            raise CheckpointError(f"{where} names {n!r}: only .safetensors files in the "
                                  "same folder are read")
    return names, wmap


def find_files(path: str) -> PretrainedFiles:
    """Resolve `path` (a folder or a .safetensors file) and read every header."""
    full = os.path.abspath(path)
    if os.path.isfile(full):
        if not full.endswith(".safetensors"):
            raise ValueError(f"path={path!r} is not allowed: a file must be .safetensors "
                             "(pickled .bin/.pt weights are never loaded)")
        files, wmap = [full], None
    elif os.path.isdir(full):
        names = set(os.listdir(full))
        if INDEX in names:
            rel, wmap = _index_files(full)
            files = [os.path.join(full, n) for n in rel]
        elif SINGLE in names or ADAPTER in names:
            files, wmap = [os.path.join(full, SINGLE if SINGLE in names else ADAPTER)], None
        elif MANIFEST in names:
            raise ValueError(f"path={path!r} is not allowed: it is a shardwise sharded "
                             "checkpoint; load it with sw.load_checkpoint, or export it "
                             "first (shardwise export)")
        else:
            raise ValueError(f"path={path!r} is not allowed: the folder has no {SINGLE}, "
                             f"{INDEX} or {ADAPTER}")
    else:
        raise ValueError(f"path={path!r} is not allowed: no such file or folder")
    tensors: dict[str, StoredTensor] = {}
    tied: dict[str, str] = {}
    for fpath in files:
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath} is missing (named by {INDEX})")
        found, meta = _header(fpath)
        for key, st in found.items():
            if key in tensors:
                raise CheckpointError(f"{key} is stored twice: in {tensors[key].file} and "
                                      f"{fpath}")
            tensors[key] = st
        if "tied_weights" in meta:  # written by sw.export_safetensors
            try:
                tied.update(json.loads(meta["tied_weights"]))
            except (json.JSONDecodeError, TypeError):
                raise CheckpointError(f"{fpath}: metadata tied_weights is not JSON") from None
    if wmap is not None:
        for key, name in sorted(wmap.items()):
            st = tensors.get(key)
            if st is None or os.path.basename(st.file) != name:
                raise CheckpointError(f"{os.path.join(full, INDEX)} maps {key} to {name}, "
                                      "but that file does not hold it")
    return PretrainedFiles(full, files, tensors, tied)
