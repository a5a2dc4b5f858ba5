"""Sharded checkpoints: every rank saves its rows; any world size and strategy loads them.

See [Note: checkpoint format] (manifest.py) for what is on disk and [Note: atomic publish]
(atomic.py) for why a crash never leaves a checkpoint that loads wrongly. Every check that
can fail on one rank is agreed on by all (`sync.agreed`), so an error raises everywhere and no
rank is left waiting in a collective. All of it runs over the model's ranks ([Note: model
ranks] in engine/core/context.py): on a model sharded on a subgroup, only its ranks call
these, and its first rank (global rank 0 when the model runs on every rank) writes the
manifest and the replicated tensors.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from ..engine.api.fully_shard import reshard_between_steps
from ..engine.comm import collectives as C
from ..engine.core.context import ModelGroup, model_group, units_of
from ..engine.core.policies import check_bool, check_module, check_path
from ..engine.core.sharded_param import ShardedParam
from . import atomic, optim_state
from .finite import check_finite
from .manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointNotFoundError,
    Manifest,
    TensorInfo,
    model_name,
    rank_file,
    read_manifest,
    versions,
)
from .reader import RowReader, check_size, verify_files
from .safetensors_io import Entry, StreamWriter, dtype_from_name, dtype_name, fsync_dir, write_text
from .slots import ModelView, Slot, model_view, read_rows, set_plain
from .sync import agreed, as_error

log = logging.getLogger(__name__)

PathLike = str | os.PathLike


def _target(path: PathLike) -> str:
    return os.path.abspath(check_path("path", path))


def _check_optimizer(optimizer: object) -> None:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} is not allowed: must be a "
                         "torch.optim.Optimizer or None")


# --- save ------------------------------------------------------------------------------


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Any = None,
    allow_nonfinite: bool = False,
    trainable_only: bool = False,
) -> None:
    """Save `model` (and `optimizer`) as a sharded checkpoint directory at `path`.

    Every rank of the model must call it (on a subgroup, no other rank). Each rank writes
    the rows it owns (replica 0 only under HYBRID_SHARD/NO_SHARD) to its own safetensors
    file; the model's first rank (rank 0 unless the model runs on a subgroup) writes the
    replicated tensors and the manifest, and publishes the directory atomically, replacing
    an existing checkpoint at `path` only once the new one is complete. `extra` must be
    JSON-serializable; `load_checkpoint` returns it. A parameter or optimizer state holding
    NaN/inf raises ValueError on every rank before anything is written, unless
    `allow_nonfinite` (see finite.py; the check reads each tensor once, about 3% of a save).
    `trainable_only` saves only the parameters that require grad (a LoRA run's adapters:
    the frozen base is never written again); load such a checkpoint with
    `trainable_only=True` too.
    """
    target = ""
    group = model_group(model)
    with agreed(group=group):
        target = _target(path)
        check_module("model", model)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise ValueError(f"step={step!r} must be an int >= 0 or None")
        _check_optimizer(optimizer)
        try:
            extra = json.loads(json.dumps(extra, allow_nan=True))
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra must be JSON-serializable (dicts, lists, strings, "
                             f"numbers, bools, None): {e}") from None
        check_bool("trainable_only", trainable_only)
        view = model_view(model, trainable_only)
        slots = [e.slot() for e in view.entries]
        opt_json, opt_state = None, {}
        if optimizer is not None:
            opt_json, opt_slots, opt_state = optim_state.collect(optimizer, view)
            slots += opt_slots
        for s in slots:
            dtype_name(s.dtype)  # refuse dtypes safetensors cannot hold, before any write
            if s.local.is_meta:
                raise RuntimeError(f"{s.name} is still on the meta device; materialize or "
                                   f"load the model before saving it")
        check_bool("allow_nonfinite", allow_nonfinite)
        if not allow_nonfinite:
            check_finite(slots, C.rank())

    with agreed(as_error, group=group):
        if group.is_first:
            atomic.prepare(target)

    def discard() -> None:  # a failed save leaves no partial directory behind
        if group.is_first:
            atomic.discard(target)

    partial = atomic.partial_path(target)
    report: dict[str, Any] = {}
    with agreed(as_error, cleanup=discard, group=group):
        report = _write_rank_file(partial, slots)
        report["optim_state"] = opt_state
    atomic.crash_point("files_written")

    reports = [json.loads(b) for b in group.gather_bytes(json.dumps(report).encode())]
    with agreed(as_error, cleanup=discard, group=group):
        if group.is_first:
            m = _merge(reports, view, opt_json, step, extra, group)
            write_text(os.path.join(partial, MANIFEST), m.to_json())
            fsync_dir(partial)
            atomic.crash_point("manifest_written")
            atomic.publish(target)
            log.info("saved checkpoint %s (step %s, %d files)", target, step, len(m.files))


def _write_rank_file(partial: str, slots: list[Slot]) -> dict[str, Any]:
    """Write this rank's rows; return what the manifest needs to know about them."""
    mine = [s for s in slots if s.writes]
    stored = [s for s in mine if s.end > s.start]
    tensors = {s.name: {"shape": list(s.shape), "dtype": dtype_name(s.dtype),
                        "rows": [s.start, s.end], "dim": s.dim} for s in mine}
    if not stored:
        return {"file": None, "tensors": tensors}
    name = rank_file(C.rank())
    path = os.path.join(partial, name)
    writer = StreamWriter(path, [Entry(s.name, s.dtype, tuple(s.local.shape)) for s in stored],
                          {"format": "pt", "shardwise": f"rows of a sharded checkpoint; "
                                                        f"see {MANIFEST}"})
    try:
        for s in stored:
            writer.write(s.local)
    except BaseException:
        writer.abort()
        raise
    size, digest = writer.close()
    fsync_dir(partial)
    return {"file": name, "bytes": size, "sha256": digest, "tensors": tensors}


def _merge(reports: list[dict[str, Any]], view: ModelView, opt_json: dict[str, Any] | None,
           step: int | None, extra: Any, group: ModelGroup) -> Manifest:
    files: dict[str, dict[str, Any]] = {}
    tensors: dict[str, TensorInfo] = {}
    opt_state: dict[str, Any] = {}
    for rank, rep in zip(group.ranks, reports):
        if rep.get("file"):
            files[rep["file"]] = {"bytes": rep["bytes"], "sha256": rep["sha256"]}
        for name, t in rep["tensors"].items():
            shape, dtype = tuple(t["shape"]), dtype_from_name(t["dtype"])
            dim = t.get("dim", 0)
            info = tensors.setdefault(name, TensorInfo(shape, dtype, dim=dim))
            if (info.shape, info.dtype, info.dim) != (shape, dtype, dim):
                raise CheckpointError(f"ranks disagree on {name}: rank {rank} has "
                                      f"{shape} {dtype} rows on dim {dim}, another "
                                      f"{info.shape} {info.dtype} on dim {info.dim}")
            a, b = t["rows"]
            if b > a:
                info.pieces.append((rep["file"], a, b))
        for fqn, desc in rep.get("optim_state", {}).items():
            have = opt_state.setdefault(fqn, {"tensors": [], "scalars": {}})
            have["tensors"] += [n for n in desc["tensors"] if n not in have["tensors"]]
            for n, spec in desc["scalars"].items():
                have["scalars"].setdefault(n, spec)
    for name, info in tensors.items():
        pieces, row = [], 0
        for f, a, b in sorted(info.pieces, key=lambda p: (p[1], p[2])):
            if pieces and (a, b) == pieces[-1][1:]:
                continue  # an identical copy (two writers of one replica): keep one
            if a != row:
                raise CheckpointError(f"{name}: rows [{row}, {a}) written by no rank or twice")
            pieces.append((f, a, b))
            row = b
        if row != info.dim0:
            raise CheckpointError(f"{name}: rows [{row}, {info.dim0}) written by no rank")
        info.pieces = pieces
    if opt_json is not None:
        opt_json = {**opt_json, "state": opt_state}
    return Manifest(step=step, extra=extra, versions=versions(),
                    saved_by={"world_size": group.size, "files": len(files)},
                    files=files, tensors=tensors, model_keys=view.keys,
                    aliases=view.aliases, optimizer=opt_json)


# --- load ------------------------------------------------------------------------------


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    trainable_only: bool = False,
) -> Any:
    """Load a checkpoint saved at any world size into `model` (and `optimizer`); return extra.

    Every rank of the model must call it (on a subgroup, no other rank). Each rank reads only
    the rows it holds. With `verify`, every file's SHA-256 is checked first (the files are
    split among the model's ranks, so each byte is
    read once more in total). Nothing in the model or optimizer changes unless everything
    was read successfully; a missing, truncated or corrupted file, or a checkpoint of a
    different architecture, raises CheckpointError on every rank. `trainable_only`: the
    checkpoint holds only the parameters that require grad (saved with it); the others are
    left as they are.
    """
    m: Manifest | None = None
    ckpt = ""
    group = model_group(model)
    with agreed(group=group):
        target = _target(path)
        check_module("model", model)
        _check_optimizer(optimizer)
        check_bool("verify", verify)
        check_bool("trainable_only", trainable_only)
        ckpt = atomic.resolve(target)
        if not os.path.isdir(ckpt):
            raise CheckpointNotFoundError(f"path={os.fspath(path)!r} is not allowed: no "
                                          "checkpoint directory there")
        if ckpt != target:
            log.warning("%s is missing: loading %s, left by a save that crashed while "
                        "replacing it", target, ckpt)
        reshard_between_steps(model, "load_checkpoint")
        m = read_manifest(ckpt)
        view = model_view(model, trainable_only)
        _check_model(view, m, ckpt)
        if optimizer is not None:
            optim_state.check(optimizer, view, m, ckpt)
        for name, info in sorted(m.files.items()):
            check_size(os.path.join(ckpt, name), info["bytes"])
    assert m is not None

    if verify:
        with agreed(group=group):
            verify_files(ckpt, m, group.index, group.size)

    staged: list[tuple[ShardedParam, torch.Tensor]] = []
    plain: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    opt_sd = None
    stored = _stored_names(view, m)
    reader = RowReader(ckpt, m)
    with agreed(as_error, group=group):
        try:
            for e in view.entries:
                name = stored[e.key]
                rows = read_rows(reader.read, name, m.tensors[name], e.sp)
                if e.sp is not None:
                    staged.append((e.sp, rows))
                else:
                    plain.append((e.key, e.tensor, rows))
            if optimizer is not None:
                opt_sd = optim_state.read_state(optimizer, view, m, reader.read)
        finally:
            reader.close()

    # Everything was read: commit (no collectives and nothing that can fail on bad data).
    with torch.no_grad():
        for sp, rows in staged:
            sp.materialize()
            sp.local.copy_(rows.reshape(sp.local.shape))
        units = units_of(model)
        device = units[0].mesh.device if units else torch.device("cpu")
        for key, t, rows in plain:
            set_plain(model, key, t, rows.reshape(t.shape), device)
    if optimizer is not None:
        optimizer.load_state_dict(opt_sd)
    return m.extra


def _stored_names(view: ModelView, m: Manifest) -> dict[str, str]:
    """Model entry key -> the stored tensor it loads from.

    A parameter the model ties (several keys) that the checkpoint stores more than once (it
    was saved untied) takes the tensor of its last key, as nn.Module.load_state_dict of the
    saved keys leaves it on the unsharded model.
    """
    out: dict[str, str] = {}
    for key in view.keys:  # state-dict order: a later key replaces an earlier one
        out[view.aliases.get(key, key)] = model_name(m.aliases.get(key, key))
    return out


def _check_model(view: ModelView, m: Manifest, where: str) -> None:
    """The first key whose presence or shape differs, in the model's order."""
    shapes = {e.key: e.shape for e in view.entries}
    for key in view.keys:
        shape = shapes[view.aliases.get(key, key)]
        info = m.model_tensor(key)
        if info is None:
            raise CheckpointError(f"{where} does not match the model: {key} (shape "
                                  f"{shape}) is not in the checkpoint")
        if info.shape != shape:
            raise CheckpointError(f"{where} does not match the model: {key} has shape "
                                  f"{info.shape} in the checkpoint, {shape} in the model")
    mine = set(view.keys)
    for key in m.model_keys:
        if key not in mine:
            info = m.model_tensor(key)
            shape = info.shape if info is not None else "?"
            raise CheckpointError(f"{where} does not match the model: {key} (shape {shape}) "
                                  f"is in the checkpoint but not in the model")
