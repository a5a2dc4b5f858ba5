"""Where pretrained weights are on disk, and reading blocks of them through bounded mmaps.

A path given to `load_pretrained` resolves to safetensors files and the tensors in them:

    folder/model.safetensors.index.json    Hugging Face's sharded layout (and shardwise's export)
    folder/model.safetensors               one file
    folder/adapter_model.safetensors       a peft adapter folder (no base weights beside it)
    file.safetensors                       that one file

Only headers are read here (shapes and dtypes); `BlockReader` reads tensor blocks.

[Note: bounded reads] `safe_open(...).get_slice(key)[block]` returns a view of the file's
memory map, so a block is copied straight into the shard that keeps it (converting the dtype
on the way) with no intermediate buffer. The pages it touched stay mapped, and mapped file
pages count as this process's resident memory, so the reader unmaps a file (drops its
handle) once `buffer_bytes` have been read through it, and copies a larger block in row
chunks of at most `buffer_bytes`. A rank's memory is then its shards plus one such buffer.
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
from .safetensors_io import dtype_from_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER = "adapter_model.safetensors"
DEFAULT_BUFFER_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoredTensor:
    key: str  # the key in the file
    file: str  # absolute path of the file holding it
    shape: tuple[int, ...]
    dtype: torch.dtype

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
        f = safe_open(path, framework="pt")
        out = {}
        for key in f.keys():
            sl = f.get_slice(key)
            out[key] = StoredTensor(key, path, tuple(sl.get_shape()),
                                    _dtype(sl.get_dtype(), f"{path}: {key}"))
        return out, dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
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


class BlockReader:
    """Copies blocks of stored tensors into tensors the caller owns; see [Note: bounded reads].

    `bytes_read` counts the stored bytes of every block read (what this rank pulled from
    disk or the page cache).
    """

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.buffer_bytes = buffer_bytes
        self.bytes_read = 0
        self._open: dict[str, tuple[object, int]] = {}  # file -> (handle, bytes through it)

    def _handle(self, path: str) -> object:
        if path not in self._open:
            try:
                self._open[path] = (safe_open(path, framework="pt"), 0)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") \
                    from None
        return self._open[path][0]

    def _count(self, path: str, nbytes: int) -> None:
        self.bytes_read += nbytes
        handle, n = self._open[path]
        if n + nbytes >= self.buffer_bytes:
            del self._open[path]  # unmap: its touched pages leave this process's RSS
        else:
            self._open[path] = (handle, n + nbytes)

    def read_into(self, st: StoredTensor, block: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy `st[block]` into `out` (shaped like the block; 0-d: one row)."""
        if not st.shape:  # a 0-d tensor: slices do not apply
            if block[0].stop == block[0].start:
                return  # an empty shard (its one row is another rank's): nothing to read
            value = self._handle(st.file).get_tensor(st.key)  # type: ignore[attr-defined]
            out.copy_(value.reshape(out.shape))
            self._count(st.file, st.dtype.itemsize)
            return
        rows = block[0].stop - block[0].start
        if rows == 0:
            return
        row_bytes = math.prod(s.stop - s.start for s in block[1:]) * st.dtype.itemsize
        step = max(1, self.buffer_bytes // max(row_bytes, 1))
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            a = block[0].start
            try:
                sl = self._handle(st.file).get_slice(st.key)  # type: ignore[attr-defined]
                view = sl[(slice(a + lo, a + hi), *block[1:])]
                out[lo:hi].copy_(view.reshape(out[lo:hi].shape))
            except SafetensorError as e:
                raise CheckpointError(f"{st.file}: cannot read {st.key}: {e}") from None
            del sl, view  # the views pin the mapping
            self._count(st.file, (hi - lo) * row_bytes)

    def close(self) -> None:
        self._open.clear()
