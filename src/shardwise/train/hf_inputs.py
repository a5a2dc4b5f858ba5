"""The data of a `--model.hf` run: its sources (data.path, or data.mix with weights), its
evaluation set (data.eval_path, or the held-out split of every source), tokenized once
(token_cache.py) and cut into samples (token_parts.py).

    data = load(cfg, seq_len)     # a collective: each source is prepared by prepare_shared
    stream = TokenBatchStream(data.train, seq_len, batch, dp_rank, dp_world, seed, device)
    for batch in val_batches(data.val, seq_len, batch, dp_rank, dp_world, n, device, seed): ...

A folder written by `DatasetDict.save_to_disk` stands for one of its splits: `train` for
training, `validation` (else `test`) for evaluation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import records as R

if TYPE_CHECKING:
    from .config import Config, DataSection
    from .token_cache import Progress, TokenData
    from .token_parts import Mixture, TokenPart

TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "valid", "val", "test")


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`a.parquet:0.7,b.jsonl:0.3` -> [(path, weight), ...]; weights need not sum to 1."""
    out: list[tuple[str, float]] = []
    for item in (t.strip() for t in text.split(",")):
        path, sep, w = item.rpartition(":")
        try:
            weight = float(w) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not path or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.mix={text!r}: {item!r} is not allowed: give "
                             "PATH:WEIGHT items separated by commas, each weight > 0 "
                             "(e.g. a.parquet:0.7,b.jsonl:0.3)")
        if not Path(path).expanduser().exists():
            raise ValueError(f"data.mix={text!r}: {path!r} does not exist")
        out.append((path, weight))
    if len({p for p, _ in out}) != len(out):
        raise ValueError(f"data.mix={text!r} names a path twice: give each source once")
    return out


def sources(d: DataSection) -> list[tuple[str, float]]:
    """The training sources and their weights."""
    return parse_mix(d.mix) if d.mix else [(d.path, 1.0)]


def resolve(path: str, role: str) -> str:
    """A saved DatasetDict folder -> its split's folder (role: "train" or "eval")."""
    splits = R.saved_splits(Path(path).expanduser())
    if not splits:
        return path
    wanted = TRAIN_SPLITS if role == "train" else EVAL_SPLITS
    for w in wanted:
        if w in splits:
            return str(Path(path) / w)
    raise ValueError(f"{path!r} is a saved DatasetDict with splits {', '.join(splits)}, none "
                     f"of which is {' or '.join(wanted)}: give the split's folder itself "
                     f"({str(Path(path) / splits[0])!r})")


def data_key(cfg: Config) -> str:
    """What a resume compares ([Note: token cache] keys of every source and of the
    evaluation set, with the weights, packing and split that decide the samples)."""
    from .token_cache import data_key as entry_key

    d = cfg.data
    h = hashlib.sha256()
    for path, w in sources(d):
        h.update(f"{entry_key(resolve(path, 'train'), cfg.model.hf)}:{w!r}\0".encode())
    if d.eval_path:
        h.update(f"eval:{entry_key(resolve(d.eval_path, 'eval'), cfg.model.hf)}\0".encode())
    else:
        h.update(f"held-out:{d.val_fraction!r}\0".encode())
    h.update(f"packing:{d.packing}".encode())
    return h.hexdigest()[:24]


def check_files(cfg: Config) -> None:
    """Before any worker starts: every source and the evaluation set has files, not all
    empty; the error names the option that gave the path (data.path, data.mix or
    data.eval_path)."""
    from .hf_data import data_files

    d = cfg.data
    given = [("data.mix" if d.mix else "data.path", resolve(p, "train"))
             for p, _ in sources(d)]
    if d.eval_path:
        given.append(("data.eval_path", resolve(d.eval_path, "eval")))
    for option, path in given:
        files = data_files(path, option)
        if not any(f.stat().st_size for f in files):
            what = "to evaluate on" if option == "data.eval_path" else "to train on"
            raise ValueError(f"{option}={path!r} holds no text {what} (its files are empty)")


@dataclass
class HFData:
    train: Mixture
    val: Mixture
    n_train: int  # tokens
    n_val: int


def _named(part_len: int, side: str, path: str, seq_len: int, n_tokens: int) -> None:
    if part_len == 0:
        raise ValueError(
            f"the {side} split of {path!r} has no sequence of {seq_len} tokens with a token "
            f"that counts for the loss ({n_tokens} tokens in it): give more data, a smaller "
            "model.block_size" + (", or a larger data.val_fraction" if side == "validation"
                                  else ""))


def _whole(data: TokenData, seq_len: int, packed: bool) -> TokenPart:
    from .token_parts import TokenPart, pieces

    p = pieces(data, seq_len + 1)
    return TokenPart(data, p, np.ones(len(p.start), dtype=bool), seq_len, packed)


def load(cfg: Config, seq_len: int,
         progress: Callable[[Progress], None] | None = None) -> HFData:
    """Every source tokenized (a collective: token_cache.prepare_shared) and cut into
    samples. Raises a one-line ValueError, alike on every rank, when a side has no sample."""
    from . import token_cache as TC
    from . import token_parts as P

    d = cfg.data
    if d.packing:
        from .hf_model import check_packing

        check_packing()
    cache = d.cache(cfg.out_dir)
    train, val, weights = [], [], []
    for path, weight in sources(d):
        data = TC.prepare_shared(resolve(path, "train"), cfg.model.hf, cache,
                                 progress=progress)
        if d.eval_path:
            part = _whole(data, seq_len, d.packing)
        else:
            part, v = P.split(data, d.val_fraction, seq_len, d.seed, d.packing)
            _named(len(v), "validation", path, seq_len, v.n_tokens)
            val.append(v)
        _named(len(part), "training", path, seq_len, part.n_tokens)
        train.append(part)
        weights.append(weight)
    if d.eval_path:
        data = TC.prepare_shared(resolve(d.eval_path, "eval"), cfg.model.hf, cache,
                                 progress=progress)
        v = _whole(data, seq_len, d.packing)
        _named(len(v), "evaluation", d.eval_path, seq_len, v.n_tokens)
        val.append(v)
    train_mix, val_mix = P.Mixture(train, weights), P.Mixture(val, [1.0] * len(val))
    return HFData(train_mix, val_mix, train_mix.n_tokens, val_mix.n_tokens)
