"""Consolidated safetensors from a live model or a checkpoint.

The files follow Hugging Face's naming (model.safetensors, or shards plus
model.safetensors.index.json), but hold weights only: no config.json or tokenizer.

Output directory, as `save_pretrained` writes it:

    model.safetensors                      everything fits in `max_shard_bytes`, or
    model-00001-of-00003.safetensors ...   tensors split in order at the size limit, plus
    model.safetensors.index.json           {"metadata": {"total_size"}, "weight_map"}

Keys are the original module's state-dict keys; tied parameters are stored once, under the
first key (loading with `strict=False` leaves the tie to the model). Tensors stream through
`StreamWriter` one at a time, so no process holds more than one full tensor (live export:
one all-gather at a time; offline: one stored piece at a time). Each file is written under a
temporary name and renamed when complete; the index comes last.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import atomic
from .manifest import CheckpointError, model_name, read_manifest
from .reader import RowReader, check_size, verify_file
from .safetensors_io import Entry, StreamWriter, fsync_dir, write_text
from .slots import read_rows

if TYPE_CHECKING:
    from .sharded import PathLike

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default "5GB"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class ExportProgress:
    phase: str  # "verify" (checking a checkpoint file) or "tensor" (writing one)
    name: str  # file or tensor key
    index: int  # 1-based position within the phase
    count: int
    nbytes: int


ProgressFn = Callable[[ExportProgress], None]


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


class ConsolidatedWriter:
    """Writes `entries` in order into the HF layout under `out_dir`, one file at a time."""

    def __init__(self, out: str, entries: list[Entry], max_shard_bytes: int,
                 metadata: dict[str, str]) -> None:
        # A file name: exactly that one file, whatever its size.
        self.file_mode = out.endswith(".safetensors")
        if self.file_mode:
            self.out_dir, single = os.path.dirname(out), os.path.basename(out)
            self.shards = [list(entries)]
        else:
            self.out_dir, single = out, SINGLE
            self.shards = plan_shards(entries, max_shard_bytes)
        n = len(self.shards)
        self.names = [single] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shard_of = {e.key: i for i, shard in enumerate(self.shards) for e in shard}
        self.metadata = metadata
        self.total = sum(e.nbytes for e in entries)
        self._current = -1
        self._writer: StreamWriter | None = None
        os.makedirs(self.out_dir, exist_ok=True)

    def _tmp(self, i: int) -> str:
        return os.path.join(self.out_dir, f".{self.names[i]}.partial")

    def _advance_to(self, i: int) -> None:
        while self._current < i:
            if self._writer is not None:
                self._writer.close()
                os.replace(self._tmp(self._current),
                           os.path.join(self.out_dir, self.names[self._current]))
            self._current += 1
            self._writer = StreamWriter(self._tmp(self._current), self.shards[self._current],
                                        self.metadata) if self._current < len(self.shards) \
                else None

    def write(self, key: str, t: torch.Tensor) -> None:
        """The next tensor `key`, whole or its next rows."""
        i = self.shard_of[key]
        if i < self._current:
            raise ValueError(f"{key} arrived after its file was finished")
        self._advance_to(i)
        assert self._writer is not None
        self._writer.write(t, key)

    def close(self) -> list[str]:
        self._advance_to(len(self.shards))
        if len(self.names) > 1:
            weight_map = {e.key: self.names[i] for i, shard in enumerate(self.shards)
                          for e in shard}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            write_text(os.path.join(self.out_dir, INDEX), json.dumps(index, indent=2) + "\n")
        self._remove_stale()
        fsync_dir(self.out_dir)
        return [os.path.join(self.out_dir, n) for n in self.names]

    def _remove_stale(self) -> None:
        """Files of an earlier export in the other layout would make the directory ambiguous."""
        if self.file_mode:
            return  # a file the caller named: the rest of its directory is not ours
        keep = set(self.names) | ({INDEX} if len(self.names) > 1 else set())
        for name in os.listdir(self.out_dir):
            if name in keep:
                continue
            if name in (SINGLE, INDEX) or _SHARD_RE.fullmatch(name):
                os.unlink(os.path.join(self.out_dir, name))

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def _check_limit(max_shard_bytes: int) -> None:
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be a positive int")


def _metadata(aliases: dict[str, str]) -> dict[str, str]:
    meta = {"format": "pt"}
    if aliases:
        meta["tied_weights"] = json.dumps(aliases)  # tied key -> the key that stores it
    return meta


def export_safetensors(path: PathLike, model: nn.Module, *,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write the sharded `model`'s full weights as consolidated safetensors.

    `path` is a directory (model.safetensors, or shards plus the index past
    `max_shard_bytes`), or a file name ending in `.safetensors` (that one file, any size).
    Every rank of the model must call it (tensors are all-gathered one at a time); the
    model's first rank writes (rank 0 unless the model runs on a subgroup: [Note: model
    ranks] in engine/core/context.py). Returns the paths of the weight files (on every rank
    of the model).
    """
    writer: ConsolidatedWriter | None = None
    names: list[str] = []
    # Here, not at the top: the offline `export_checkpoint` (`shardwise export`) needs none
    # of the engine, whose import is most of that command's time.
    from ..engine.core.context import model_group
    from ..engine.core.policies import check_module, check_path
    from .slots import model_view, writes_shards
    from .state_dict import gather_full
    from .sync import agreed, as_error

    group = model_group(model)
    # The checks raise no OSError: only the writer's is converted.
    with agreed(as_error, group=group):
        _check_limit(max_shard_bytes)
        out = os.path.abspath(check_path("path", path))
        check_module("model", model)
        if os.path.exists(out) and not os.path.isdir(out) and not out.endswith(".safetensors"):
            raise ValueError(f"path={os.fspath(path)!r} is not allowed: it is a file; give a "
                             "folder or a file name ending in .safetensors")
        view = model_view(model)
        entries = []
        for e in view.entries:
            if e.sp.is_meta if e.sp is not None else e.tensor.is_meta:
                raise RuntimeError(f"{e.key} is still on the meta device; materialize or "
                                   f"load the model before exporting it")
            dtype = e.sp.orig_dtype if e.sp is not None else e.tensor.dtype
            entries.append(Entry(e.key, dtype, e.shape))
        if group.is_first:
            writer = ConsolidatedWriter(out, entries, max_shard_bytes, _metadata(view.aliases))
            names = [os.path.join(writer.out_dir, n) for n in writer.names]

    # The writer keeps going after a failed write: the other ranks still gather every tensor
    # with it, and all raise together at the end.
    err: BaseException | None = None
    for e in view.entries:
        if e.sp is not None:
            if not writes_shards(e.sp):
                continue  # another replica's shard group gathers this one
            full = gather_full(e.sp)
        else:
            full = e.tensor.detach()
        if writer is not None and err is None:
            try:
                writer.write(e.key, full)
            except Exception as ex:  # noqa: BLE001 - must reach the agreement below
                err = as_error(ex)
                writer.abort()
        del full  # one full tensor at a time
    with agreed(as_error, group=group):
        if err is not None:
            raise err
        if writer is not None:
            writer.close()
    n = group.all_gather_bytes(json.dumps(names).encode())[0]  # the writer knows them
    return list(json.loads(n))


def export_checkpoint(checkpoint: PathLike, out: PathLike, *,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, verify: bool = True,
                      progress: ProgressFn | None = None) -> list[str]:
    """Offline: a sharded checkpoint directory -> consolidated safetensors at `out`.

    `out` is a directory or a `.safetensors` file name, as for `export_safetensors`.
    One process, no process group; memory is bounded by the largest stored piece (at most
    one tensor). With `verify`, every file's SHA-256 is checked first.
    """
    _check_limit(max_shard_bytes)
    ckpt = atomic.resolve(os.path.abspath(os.fspath(checkpoint)))
    m = read_manifest(ckpt)
    files = sorted(m.files.items())
    for i, (name, info) in enumerate(files, 1):
        path = os.path.join(ckpt, name)
        check_size(path, info["bytes"])
        if verify:
            if progress:
                progress(ExportProgress("verify", name, i, len(files), info["bytes"]))
            verify_file(path, info)
    keys = [k for k in m.model_keys if k not in m.aliases]
    entries = []
    for k in keys:
        info = m.tensors.get(model_name(k))
        if info is None:
            raise CheckpointError(f"{ckpt}: manifest lists {k} but stores no tensor for it")
        entries.append(Entry(k, info.dtype, info.shape))
    writer = ConsolidatedWriter(os.path.abspath(os.fspath(out)), entries, max_shard_bytes,
                                _metadata(m.aliases))
    reader = RowReader(ckpt, m)
    try:
        for i, e in enumerate(entries, 1):
            if progress:
                progress(ExportProgress("tensor", e.key, i, len(entries), e.nbytes))
            name = model_name(e.key)
            info = m.tensors[name]
            if info.dim:  # rows on another dim ([Note: checkpoint format]): whole, moved back
                writer.write(e.key, read_rows(reader.read, name, info, None).contiguous())
                reader.close()
                continue
            for _, a, b in info.pieces:
                writer.write(e.key, reader.read(name, a, b, own=False))
                # Unmap: pages of a memory-mapped file count as this process's memory.
                reader.close()
        return writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
