"""Pretrained weights into a sharded model: each rank reads only the rows it owns.

`load_pretrained` takes a Hugging Face folder, a shardwise export or one .safetensors file
(pretrained_files.py) and a model sharded by `shard_model` / `fully_shard`, on the meta
device or materialized. Keys map as `from_pretrained` maps them (hf_keys.py). Each rank
reads its block of every sharded parameter (`slots.owned_block`: its dim-0 rows of the
padded chunking, under TP its (dp, tp) block) straight into the shard that keeps it,
converting to the parameter's dtype on the way ([Note: bounded reads]); buffers and
unsharded parameters are small and read whole by every rank.

Order of work, so that a refusal leaves every rank untouched:
1. plan: resolve the files, read the headers, map keys, check missing keys, shapes and
   meta tensors nothing will fill; every rank agrees on the outcome (`sync.agreed`, one
   all-reduce) before anything is written;
2. read: meta parameters into new shards (committed in step 4), materialized ones in place;
3. verdict: NaN/inf read by any rank raise on every rank, naming them (pretrained_finite.py);
4. commit: new shards replace meta parameters, buffers are set, and buffers that are
   computed rather than stored (rotary `inv_freq`) are computed as transformers does.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.api.fully_shard import reshard_between_steps
from ..engine.core.context import model_group, units_of
from ..engine.core.policies import check_bool, check_module, check_path
from ..engine.core.sharded_param import ShardedParam
from ..engine.ext.materialize import still_unfilled
from ..engine.ext.materialize import unfilled as sentinel_tensor
from .block_reader import DEFAULT_BUFFER_BYTES, BlockReader
from .hf_keys import KeyMap, hf_root, is_adapter_key, map_keys
from .manifest import CheckpointError
from .pretrained_files import StoredTensor, find_files
from .pretrained_finite import agree_finite
from .quantize import NF4, finish, resolve, rows_part, targets
from .slots import ModelEntry, ModelView, model_view, owned_block, set_plain
from .sync import agreed, as_error

log = logging.getLogger(__name__)

PathLike = str | os.PathLike


@dataclass(frozen=True)
class LoadResult:
    """What `load_pretrained` did (the same on every rank, except `bytes_read`)."""

    loaded_keys: list[str]  # model keys filled from the checkpoint (tied keys once)
    missing_keys: list[str]  # model keys the checkpoint lacks (strict=False), as HF reports
    unexpected_keys: list[str]  # checkpoint keys the model has no place for, as HF reports
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list)  # (key, checkpoint shape, model shape), skipped (strict=False)
    computed_buffers: list[str] = field(default_factory=list)  # e.g. rotary inv_freq
    bytes_read: int = 0  # stored bytes this rank read
    files: list[str] = field(default_factory=list)
    quantized_keys: list[str] = field(default_factory=list)  # now NF4 shards (quantize=)


@dataclass
class _Plan:
    sources: dict[str, StoredTensor]  # model entry key -> stored tensor to read
    result: LoadResult
    meta_buffers: list[tuple[str, nn.Module, str]]  # computed after loading
    quantized: dict[str, ShardedParam] = field(default_factory=dict)  # key -> to NF4


def _names(keys: list[str], limit: int = 8) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _is_meta(e: ModelEntry) -> bool:
    return e.sp.is_meta if e.sp is not None else e.tensor.is_meta


def _plan(model: nn.Module, view: ModelView, path: str, strict: bool) -> _Plan:
    files = find_files(path)
    km: KeyMap = map_keys(model, view.keys, list(files.tensors))
    if km.converted:
        raise ValueError(
            f"{path}: keys {_names(km.converted)} need one of transformers' tensor "
            "conversions (fused or split weights), which change rows; load_pretrained reads "
            "rows as stored. Convert the folder once with from_pretrained + save_pretrained")
    # A tied key loads through the key that stores the tensor: the first that has a source.
    by_entry: dict[str, list[str]] = {e.key: [e.key] for e in view.entries}
    for alias, stored in view.aliases.items():
        by_entry.setdefault(stored, [stored]).append(alias)
    has_adapters = any(is_adapter_key(t, km.adapters) for t in km.targets)
    sources: dict[str, StoredTensor] = {}
    missing, mismatched, skipped_meta = [], [], []
    copies: list[tuple[ModelEntry, StoredTensor, StoredTensor]] = []
    for e in view.entries:
        cks = list(dict.fromkeys(km.targets[k] for k in by_entry[e.key] if k in km.targets))
        st = files.tensors[cks[0]] if cks else None
        if st is not None and st.shape != e.shape:
            mismatched.append((e.key, st.shape, e.shape))
            st = None
        if st is not None:
            sources[e.key] = st
            copies += [(e, st, files.tensors[ck]) for ck in cks[1:]
                       if files.tensors[ck].shape == e.shape]
            continue
        # Not loaded: reported missing unless HF ignores it (its ignore list; adapter
        # weights when the checkpoint is a base model's).
        adapter = not has_adapters and is_adapter_key(e.key, km.adapters)
        if not (adapter or km.ignored_missing(e.key) or any(e.key == m for m, *_ in mismatched)):
            missing.append(e.key)
        if _is_meta(e):
            skipped_meta.append(e.key)
    if strict and (missing or mismatched):
        parts = []
        if missing:
            parts.append(f"missing keys {_names(missing)}")
        if mismatched:
            parts.append("shape mismatches " + _names(
                [f"{k} (checkpoint {list(a)}, model {list(b)})" for k, a, b in mismatched]))
        raise CheckpointError(f"{path} does not match the model: {'; '.join(parts)}. "
                              "Nothing was loaded (strict=False loads the rest)")
    if skipped_meta:
        raise ValueError(
            f"{_names(skipped_meta)} will not be loaded from {path} and are still on the meta "
            "device: initialize the model first (sw.materialize(model, init_fn=...)), then "
            "load_pretrained overwrites what the checkpoint holds")
    _check_tied_copies(path, copies)
    meta_buffers = _meta_buffers(model, set(view.keys))
    if meta_buffers and hf_root(model) is None:
        raise ValueError(
            f"buffers {_names([k for k, _, _ in meta_buffers])} are on the meta device and not "
            "stored in checkpoints: create them outside the meta device (or fill them after "
            "loading); load_pretrained computes them only for transformers models")
    result = LoadResult(
        loaded_keys=[e.key for e in view.entries if e.key in sources],
        missing_keys=missing, unexpected_keys=km.unexpected, mismatched_keys=mismatched,
        computed_buffers=[k for k, _, _ in meta_buffers], files=files.files)
    return _Plan(sources, result, meta_buffers)


def _check_tied_copies(path: str, copies: list[tuple[ModelEntry, StoredTensor, StoredTensor]]
                       ) -> None:
    """Refuse tied keys whose stored copies differ (this rank's block of them).

    `from_pretrained` then unties them (each key keeps its own values); a model sharded tied
    has one parameter for both, so any choice would differ from it. Identical copies (a
    checkpoint that stores both keys of one tensor) load as one. Compared in the parameter's
    dtype, as transformers compares the loaded parameters. Every rank compares its own rows
    and the plan's agreement raises on every rank.
    """
    if not copies:
        return
    reader = BlockReader(DEFAULT_BUFFER_BYTES)
    try:
        for e, a, b in copies:
            if e.sp is not None:
                dtype, block = e.sp.orig_dtype, owned_block(e.sp)
                shape = tuple(s.stop - s.start for s in block)
            else:
                shape, dtype = e.shape or (1,), e.tensor.dtype
                block = tuple(slice(0, n) for n in e.shape)
            if math.prod(shape) == 0:
                continue
            mine, other = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            reader.read_into(a, block, mine)
            reader.read_into(b, block, other)
            # NaN equals NaN here: identical copies load as one (and the read's finite
            # check names the NaN).
            if not torch.equal(mine, other) and not bool(
                    ((mine == other) | (mine.isnan() & other.isnan())).all()):
                raise ValueError(
                    f"{path}: {a.key} and {b.key} hold different values, but the model ties "
                    f"them (one parameter, {e.key}); from_pretrained would untie them. Build "
                    "the model untied (tie_word_embeddings=False in its config) or load a "
                    "checkpoint that stores the tied tensor once")
    finally:
        reader.close()


def _meta_buffers(model: nn.Module, stored: set[str]) -> list[tuple[str, nn.Module, str]]:
    """Meta buffers no checkpoint stores (non-persistent), in modules without own parameters.

    transformers computes them in `_init_weights`; a module with parameters of its own would
    have those re-initialized too, so such a module is refused instead.
    """
    out = []
    for mname, m in model.named_modules():
        for name, b in m._buffers.items():
            key = f"{mname}.{name}" if mname else name
            if b is None or not b.is_meta or key in stored:
                continue
            if any(p is not None for p in m._parameters.values()):
                raise ValueError(f"buffer {key} is on the meta device and not stored in "
                                 f"checkpoints, in {type(m).__name__} which has parameters of "
                                 "its own: create it outside the meta device")
            out.append((key, m, name))
    return out


def load_pretrained(model: nn.Module, path: PathLike, *, strict: bool = True,
                    allow_nonfinite: bool = False, quantize: str | NF4 | None = None
                    ) -> LoadResult:
    """Load pretrained weights from `path` into the sharded `model`; every rank of the model
    must call it (on a subgroup, no other rank: the agreements run over the model's ranks).

    `path`: a Hugging Face folder (model.safetensors, or model.safetensors.index.json with
    its files), a shardwise export (`sw.export_safetensors`), or one .safetensors file.
    `model` is sharded (`shard_model` / `fully_shard`, tensor parallel or not), on the meta
    device or materialized. Each rank reads only its own block of each parameter; the
    weights equal `AutoModelForCausalLM.from_pretrained(path)`'s, converted to the model's
    parameter dtypes (a bf16 checkpoint loads into fp32 shards exactly).

    `strict`: missing keys and shape mismatches raise CheckpointError naming them, on every
    rank, before anything is written. With `strict=False` they are skipped and reported in
    the result; a skipped parameter keeps its value, so it must not be on the meta device
    (initialize the model with `sw.materialize` first; otherwise ValueError names it).
    Unexpected keys are reported, never refused, as in transformers.

    `allow_nonfinite`: NaN/inf values read (counted in the parameter's dtype, so a value
    that overflows it counts too) raise ValueError on every rank, naming each file, key and
    how many values, before new shards replace meta parameters (pretrained_finite.py);
    True loads them anyway.

    `quantize`: "nf4" (or `sw.NF4(block_size, scaler_block_size, skip)`) loads every frozen
    `nn.Linear` weight but the output head as torchao's `NF4Tensor` (QLoRA's base): each
    rank quantizes its own rows, which equal `torch.chunk(to_nf4(w), N)[rank]` of the whole
    weight in the model's dtype ([Note: NF4 by rows] in quantize.py); a weight NF4 cannot
    split evenly into whole scaler blocks is refused by name first. Freeze the base before
    (peft does); the result's `quantized_keys` names what became NF4.

    Meta parameters become new Parameter objects: build the optimizer afterwards. A read
    failure (an I/O error) raises on every rank; parameters that were already materialized
    may then hold part of the new weights.
    """
    plan: _Plan | None = None
    group = model_group(model)
    with agreed(group=group):
        check_module("model", model)
        spec = resolve(quantize)
        where = check_path("path", path)
        check_bool("strict", strict)
        check_bool("allow_nonfinite", allow_nonfinite)
        reshard_between_steps(model, "load_pretrained")
        view = model_view(model)
        plan = _plan(model, view, where, strict)
        if spec is not None:
            plan.quantized = targets(model, spec)
            unread = [k for k in plan.quantized if k not in plan.sources]
            if unread:
                raise ValueError(f"quantize=nf4: {_names(unread)} are not in {where}; "
                                 "only weights loaded from it are quantized")
    assert plan is not None
    units = units_of(model)
    device = units[0].mesh.device if units else torch.device("cpu")

    reader = BlockReader(DEFAULT_BUFFER_BYTES)
    staged: list[tuple[ShardedParam, torch.Tensor]] = []
    plain: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    # key -> (NF4 codes, block absmaxes) of this rank's rows; the rows themselves are freed.
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with agreed(as_error, group=group):
        try:
            with torch.no_grad():
                for e in view.entries:
                    st = plan.sources.get(e.key)
                    if st is None:
                        continue
                    if e.key in plan.quantized:
                        rows = torch.empty((e.sp.local_rows, *e.sp.rest),
                                           dtype=e.sp.orig_dtype, device=e.sp.host_device)
                        reader.read_into(st, owned_block(e.sp), rows)
                        parts[e.key] = rows_part(rows, spec)
                    elif e.sp is not None:
                        _read_sharded(reader, st, e.sp, staged)
                    else:
                        value = torch.empty(e.shape or (1,), dtype=e.tensor.dtype)
                        reader.read_into(st, tuple(slice(0, n) for n in st.shape), value)
                        plain.append((e.key, e.tensor, value.reshape(e.shape)))
        finally:
            reader.close()
    if not allow_nonfinite:
        in_place = any(e.key in plan.sources and not _is_meta(e) for e in view.entries)
        agree_finite(reader.nonfinite, where, group, in_place)

    # Everything was read: the NF4 shards need one all-gather each (every rank, in the
    # view's order), then commit (no collectives, nothing that can fail on bad data).
    with torch.no_grad():
        nf4 = {k: finish(plan.quantized[k], codes, absmax, spec, plan.quantized[k].orig_dtype)
               for k, (codes, absmax) in parts.items()}
        for sp, padded in staged:
            sp.materialize(padded)
        for key, t, value in plain:
            set_plain(model, key, t, value, device)
        for key, q in nf4.items():
            plan.quantized[key].adopt_subclass_shard(q)
        for u in {id(sp.owner): sp.owner for sp in plan.quantized.values()}.values():
            u.set_params(u.params)  # the NF4 weights now gather through their hooks
    _compute_buffers(model, plan.meta_buffers, device)
    r = plan.result
    log.info("loaded %d tensors from %s (%d bytes read on this rank; %d missing, %d "
             "unexpected)", len(r.loaded_keys), os.fspath(path), reader.bytes_read,
             len(r.missing_keys), len(r.unexpected_keys))
    if r.unexpected_keys:
        log.warning("unexpected keys in %s, not loaded: %s", os.fspath(path),
                    _names(r.unexpected_keys))
    return LoadResult(r.loaded_keys, r.missing_keys, r.unexpected_keys, r.mismatched_keys,
                      r.computed_buffers, reader.bytes_read, r.files, list(nf4))


def _read_sharded(reader: BlockReader, st: StoredTensor, sp: ShardedParam,
                  staged: list[tuple[ShardedParam, torch.Tensor]]) -> None:
    """This rank's block of `st` into sp's shard: a new one for a meta parameter."""
    if sp.is_meta:
        padded = sp.new_padded_shard(zero_valid_rows=False)  # read_into writes them all
        staged.append((sp, padded))
        local = padded[: sp.local_rows]
    else:
        local = sp.local
    if sp.local_rows:  # an empty shard reads nothing (its rows on another dim: not dim 0)
        reader.read_into(st, owned_block(sp), sp.from_rows(local))


def _compute_buffers(model: nn.Module, meta: list[tuple[str, nn.Module, str]],
                     device: torch.device) -> None:
    """Buffers that are computed, not stored (rotary inv_freq), as transformers computes
    them after `from_pretrained`: its `_init_weights` on their module."""
    if not meta:
        return
    root = hf_root(model)
    assert root is not None  # refused in _plan otherwise
    hf = root[1]
    modules = []
    for _, m, name in meta:
        b = m._buffers[name]
        m._buffers[name] = sentinel_tensor(b.shape, b.dtype, device)
        if not any(m is x for x in modules):
            modules.append(m)
    with torch.no_grad():
        for m in modules:
            hf._init_weights(m)  # type: ignore[operator]
    unfilled = [k for k, m, name in meta if still_unfilled(m._buffers[name])]
    if unfilled:
        raise RuntimeError(f"buffers {_names(unfilled)} are not stored in the checkpoint and "
                           f"{type(hf).__name__}._init_weights did not compute them")
