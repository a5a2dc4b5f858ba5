"""Checkpoint keys -> model keys, as Hugging Face's `from_pretrained` maps them.

For a transformers model (or one wrapped by peft) the rules are transformers' own: its
weight renamings for the model class (`get_model_conversion_mapping`, legacy renames such as
`LayerNorm.gamma` included) and the `base_model_prefix` added or stripped (`model.`,
`transformer.`), through `transformers.core_model_loading.rename_source_key`, so a
checkpoint maps exactly as `from_pretrained` maps it. A key that needs one of transformers'
tensor *conversions* (fusing experts, splitting qkv) is refused: those change rows, so no
rank could read only its own. Missing and unexpected keys are filtered with the model's
`_keys_to_ignore_on_load_missing/unexpected` and the extra patterns transformers adds
(stale `rotary_emb.inv_freq`, `position_ids`).

peft: a peft model's keys are its base model's under `base_model.model.`, with wrapped
layers' weights under `base_layer.` and adapter weights named by adapter
(`lora_A.default.weight`). Checkpoint keys under `base_model.model.` (a saved peft state
dict, or an adapter file whose keys lack the adapter name) and plain base keys both map.
transformers is imported only when the model is one of its classes, so `import shardwise`
stays torch-only.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from torch import nn

PEFT_PREFIX = "base_model.model."
_WRAPPED = ("base_layer", "original_module")  # where peft keeps a wrapped layer's weights


def hf_root(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(key prefix, module) of the first transformers PreTrainedModel in `model`."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return None  # nothing in the model can be a transformers class
    from transformers import PreTrainedModel

    for name, m in model.named_modules():
        if isinstance(m, PreTrainedModel):
            return (f"{name}." if name else ""), m
    return None


def adapter_names(model: nn.Module) -> list[str]:
    cfg = getattr(model, "peft_config", None)
    return sorted(cfg) if isinstance(cfg, dict) else []


def is_adapter_key(key: str, names: list[str]) -> bool:
    return any(f".{n}." in key or key.endswith(f".{n}") for n in names)


@dataclass
class KeyMap:
    targets: dict[str, str] = field(default_factory=dict)  # model key -> checkpoint key
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys, after ignore lists
    converted: list[str] = field(default_factory=list)  # keys needing a conversion
    ignore_missing: re.Pattern[str] | None = None  # on keys relative to the HF model
    prefix: str = ""  # where the HF model sits in the model's keys
    adapters: list[str] = field(default_factory=list)

    def ignored_missing(self, key: str) -> bool:
        if self.ignore_missing is None or not key.startswith(self.prefix):
            return False
        return self.ignore_missing.search(key[len(self.prefix):]) is not None


def _pattern(patterns: set[str]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


class _HFRenamer:
    """transformers' own renaming of one checkpoint key for the HF model at `prefix`."""

    def __init__(self, hf: nn.Module, inner_keys: set[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        mapping = get_model_conversion_mapping(hf)
        self.renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self.converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.prefix = hf.base_model_prefix  # type: ignore[attr-defined]
        self.lookup = dict.fromkeys(inner_keys, True)

    def __call__(self, key: str) -> tuple[str, bool]:
        """(renamed key, whether a tensor conversion matched)."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters,
                                             self.prefix, self.lookup)
        if renamed not in self.lookup and key in self.lookup:
            return key, False  # as transformers: an exact key is not renamed away
        return renamed, pattern is not None


def _unwrapped(key: str) -> str:
    for w in _WRAPPED:
        key = key.replace(f".{w}.", ".")
    return key


def map_keys(model: nn.Module, model_keys: list[str], ckpt_keys: list[str]) -> KeyMap:
    """Which checkpoint key loads each model key, and the checkpoint keys that load nothing."""
    keyset = set(model_keys)
    root = hf_root(model)
    out = KeyMap(adapters=adapter_names(model))
    renamer = None
    ignore_unexpected = None
    if root is not None:
        prefix, hf = root
        out.prefix = prefix
        inner = {k[len(prefix):] for k in model_keys if k.startswith(prefix)}
        renamer = _HFRenamer(hf, inner | {_unwrapped(k) for k in inner})
        out.ignore_missing = _pattern(set(getattr(hf, "_keys_to_ignore_on_load_missing", None)
                                          or ()))
        extra = set()
        buffers = [n for n, _ in hf.named_buffers()]
        if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
            extra.add(r"rotary_emb\.inv_freq")
        if any(n.endswith("position_ids") for n in buffers):
            extra.add(r"(^|\.)position_ids$")
        ignore_unexpected = _pattern(
            set(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ()) | extra)
    # transformers walks the keys in natural order and a later key overwrites an earlier
    # one that maps to the same place ("x" and "model.x"): the same here.
    for ck in sorted(ckpt_keys, key=_natural):
        target = ck if ck in keyset else None
        inner_key = ck
        if target is None:
            if out.prefix and ck.startswith(PEFT_PREFIX):
                inner_key = ck[len(PEFT_PREFIX):]
            converted = False
            if renamer is not None:
                inner_key, converted = renamer(inner_key)
            target = _resolve(out.prefix + inner_key, keyset, out.adapters)
            if target is None and converted:
                out.converted.append(ck)
                continue
        if target is None:
            if ignore_unexpected is None or ignore_unexpected.search(inner_key) is None:
                out.unexpected.append(ck)
            continue
        out.targets[target] = ck
    return out


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key: dot-separated parts, numbers by value ("layers.2" before "layers.10")."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _resolve(key: str, keyset: set[str], adapters: list[str]) -> str | None:
    """`key`, or where peft moved it: under `base_layer.`, or named by its adapter."""
    if key in keyset:
        return key
    head, _, leaf = key.rpartition(".")
    for cand in [f"{head}.{w}.{leaf}" for w in _WRAPPED] + \
            [f"{head}.{a}.{leaf}" for a in adapters] + [f"{key}.{a}" for a in adapters]:
        if head and cand in keyset:
            return cand
    return None
