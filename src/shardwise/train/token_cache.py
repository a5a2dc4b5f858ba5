"""Tokenize once, then memory-map: the token cache of a Hugging Face fine-tuning run.

Usage (what the trainer does; only `prepare_shared` is a collective):

    # The launcher may call prepare() first, printing progress; the ranks then hit the cache.
    data = prepare_shared(cfg.data.path, model_folder, cache_dir)    # on every rank
    parts = split(data, val_fraction, seq_len)                # train / validation TokenPart
    stream = TokenBatchStream(parts.train, seq_len, batch_size, dp_rank, dp_world, seed, dev)
    x, y = stream.next()  # (B, T) int64 inputs; (B, T) int64 targets, -100 = does not count
    for x, y in val_batches(parts.val, seq_len, batch_size, dp_rank, dp_world, n, dev): ...
    data.key              # store in the run folder: a resume compares it (data.reset)

The targets are already shifted (y[:, t] is the token after x[:, t]), as for the built-in
GPT: compute `F.cross_entropy(logits.flatten(0, 1), y.flatten())` (ignore_index=-100 is its
default). Do not pass y as a Hugging Face model's `labels`: the model shifts labels itself, so
they would be off by one. The mean is over this rank's counted targets (every window has at
least one); with a mask, ranks hold different counts, so the mean of the ranks' means weighs
a token on a rank with few counted targets more than a token-weighted mean would.

`TokenBatchStream` is `data.BatchStream` with token windows: the same global order, per-rank
slices, `state_dict()` and restore at any world size ([Note: data position] in data.py).

[Note: token cache] A cache entry is a folder `<cache_dir>/<key>/` holding `tokens.bin` (the
packed token ids, raw little-endian uint16 when the vocabulary fits, else int32), `mask.bin`
(one uint8 per token: 1 when it counts as a target) and `meta.json`. The key hashes the
format version, the tokenizer's files (hf_data.TOKENIZER_FILES) and every data file's
relative name and bytes, so a changed byte in either makes a new entry, and the same key on
resume means the same tokens. An entry is written into a temporary folder and renamed into
place when complete: a failure (bad input, Ctrl-C) leaves nothing behind, not even a
cache_dir it created, and two ranks or runs building the same entry at once both end up
reading one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import data as D
from . import hf_data as H

log = logging.getLogger(__name__)
FORMAT = 1
IGNORE = -100  # the target of a position that does not count (F.cross_entropy's default)
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class Progress:
    """Tokenization so far; handed to `prepare`'s callback about once a second."""

    bytes_done: int
    bytes_total: int
    documents: int
    tokens: int
    seconds: float


@dataclass
class TokenData:
    """A complete cache entry, memory-mapped (nothing is read until used)."""

    tokens: np.ndarray  # (N,) uint16 or int32 memmap: the packed documents
    mask: np.ndarray  # (N,) uint8 memmap: 1 = this token counts as a target
    key: str  # hash of (format, tokenizer files, data bytes): [Note: token cache]
    meta: dict[str, Any]  # meta.json: counts, dtype, eos id, vocab size, the source paths
    path: Path  # the entry's folder
    built: bool  # this call tokenized (False: read from the cache)


def _hash_file(h: Any, path: Path, name: str) -> None:
    h.update(f"{name}\0{path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)


def data_key(data_path: str | Path, model_folder: str | Path) -> str:
    """The cache key of (data, tokenizer): 24 hex digits. Reads every data and tokenizer
    file once (sha256 runs at about 1 GB/s). Raises the one-line errors of a missing data
    path or tokenizer."""
    folder = Path(model_folder).expanduser()
    tok_files = H.tokenizer_files(folder)
    if not tok_files:
        H.load_tokenizer(folder)  # raises the "no tokenizer" error
    h = hashlib.sha256(f"shardwise-tokens-{FORMAT}\0".encode())
    for p in tok_files:
        _hash_file(h, p, "tokenizer/" + p.name)
    root = Path(data_path).expanduser()
    for p in H.data_files(root):
        _hash_file(h, p, "data/" + (p.name if p == root else p.relative_to(root).as_posix()))
    return h.hexdigest()[:24]


def open_entry(entry: str | Path) -> TokenData:
    """A complete cache entry folder, memory-mapped."""
    path = Path(entry)
    meta = json.loads((path / "meta.json").read_text())
    n = int(meta["tokens"])
    for name, itemsize in (("tokens.bin", np.dtype(meta["dtype"]).itemsize), ("mask.bin", 1)):
        f = path / name
        size = f.stat().st_size if f.is_file() else -1
        if size != n * itemsize:
            raise ValueError(f"token cache entry {str(path)!r} is damaged ({name}: {size} "
                             f"bytes, {n * itemsize} expected): delete that folder to "
                             "tokenize again")
    tokens = np.memmap(path / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,))
    mask = np.memmap(path / "mask.bin", dtype=np.uint8, mode="r", shape=(n,))
    return TokenData(tokens, mask, meta["key"], meta, path, built=False)


def prepare(data_path: str | Path, model_folder: str | Path, cache_dir: str | Path, *,
            progress: Callable[[Progress], None] | None = None) -> TokenData:
    """The tokenized data: read from `cache_dir` when this (data, tokenizer) was tokenized
    before, else tokenized with the model folder's tokenizer, packed and cached.

    Raises a one-line ValueError, having written nothing, for: a missing data path, no
    tokenizer in the folder, a JSONL line without the file's field (naming file, line and
    field), a line that is not JSON (its number), text that is not UTF-8, and data with no
    token that counts for the loss. `progress` is called about once a second while
    tokenizing (the library never prints; the CLI does)."""
    key = data_key(data_path, model_folder)
    cache = Path(cache_dir).expanduser()
    entry = cache / key
    if (entry / "meta.json").is_file():
        log.debug("token cache hit: %s", entry)
        return open_entry(entry)
    tok = H.load_tokenizer(model_folder)
    created = _first_missing(cache)
    tmp = cache / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        meta = _build(tmp, H.Encoder(tok), data_path, progress)
        meta.update(key=key, data_path=str(Path(data_path).expanduser().resolve()),
                    model_folder=str(Path(model_folder).expanduser().resolve()))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(entry)
        except OSError:  # another rank or run finished the same entry first
            if not (entry / "meta.json").is_file():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(created if created is not None else tmp, ignore_errors=True)
        raise
    data = open_entry(entry)
    data.built = True
    log.debug("tokenized %s into %s: %d tokens", data_path, entry, len(data.tokens))
    return data


def prepare_shared(data_path: str | Path, model_folder: str | Path, cache_dir: str | Path, *,
                   progress: Callable[[Progress], None] | None = None) -> TokenData:
    """`prepare` on every rank of the process group (a collective): the first rank of each
    node (LOCAL_RANK 0) tokenizes on a miss while the others wait, then every rank maps the
    same entry. An error on any rank is raised on every rank with the same one-line message;
    nodes whose data or tokenizer differ are refused. `progress` is called on those first
    ranks only."""
    from ..engine.comm.exchange import all_gather_bytes

    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    mine: dict[str, Any] = {}
    failure: Exception | None = None
    if first:
        try:
            data = prepare(data_path, model_folder, cache_dir, progress=progress)
            mine = {"key": data.key, "built": data.built}
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
            failure = e
            mine = {"error": str(e), "type": type(e).__name__}
    answers = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode())]
    if failure is not None:
        raise failure
    for a in answers:
        if "error" in a:
            kind = {"ValueError": ValueError, "OSError": OSError}.get(a["type"])
            raise kind(a["error"]) if kind else RuntimeError(f"{a['type']}: {a['error']}")
    keys = sorted({a["key"] for a in answers if a})
    if len(keys) != 1:
        raise ValueError(f"the nodes' data or tokenizer differ (cache keys {', '.join(keys)}): "
                         f"every node needs the same data.path and model files")
    data = open_entry(Path(cache_dir).expanduser() / keys[0])
    data.built = bool(mine.get("built", False))
    return data


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what a failure removes)."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def _batches(data_path: str | Path) -> Iterator[tuple[list[H.Doc], list[str], int]]:
    docs: list[H.Doc] = []
    wheres: list[str] = []
    nbytes = 0
    for doc, where, n in H.read_documents(data_path):
        docs.append(doc)
        wheres.append(where)
        nbytes += n
        if len(docs) >= H.BATCH_DOCS:
            yield docs, wheres, nbytes
            docs, wheres, nbytes = [], [], 0
    if docs:
        yield docs, wheres, nbytes


def _build(tmp: Path, enc: H.Encoder, data_path: str | Path,
           progress: Callable[[Progress], None] | None) -> dict[str, Any]:
    """Tokenize every document into tmp/tokens.bin and tmp/mask.bin; return the metadata."""
    dtype = np.dtype("<u2") if enc.vocab_size <= 1 << 16 else np.dtype("<i4")
    limit = int(np.iinfo(dtype).max)
    total = sum(p.stat().st_size for p in H.data_files(data_path))
    t0 = last = time.perf_counter()
    done = n_docs = n_tokens = n_counted = skipped = 0
    with (tmp / "tokens.bin").open("wb") as ft, (tmp / "mask.bin").open("wb") as fm:
        for docs, wheres, nbytes in _batches(data_path):
            for e in enc.encode(docs, wheres):
                counted = int(e.mask.sum())
                if counted == 0:  # nothing to learn from (a chat without assistant turns)
                    skipped += 1
                    continue
                if len(e.ids) and int(e.ids.max()) > limit:  # would wrap around silently
                    raise RuntimeError(f"token id {int(e.ids.max())} does not fit {dtype.name}"
                                       f" (the tokenizer reports {enc.vocab_size} ids)")
                ft.write(e.ids.astype(dtype).tobytes())
                fm.write(e.mask.tobytes())
                n_docs += 1
                n_tokens += len(e.ids)
                n_counted += counted
            done += nbytes
            now = time.perf_counter()
            if progress is not None and now - last >= 1.0:
                last = now
                progress(Progress(done, total, n_docs, n_tokens, now - t0))
    if n_counted == 0:
        raise ValueError(f"data.path={str(data_path)!r} holds no text to train on (no "
                         "documents, or none with a token that counts for the loss)")
    if progress is not None:
        # All of it (blank lines, which count toward no document, included).
        progress(Progress(total, total, n_docs, n_tokens, time.perf_counter() - t0))
    return {"format": FORMAT, "tokens": n_tokens, "counted": n_counted, "documents": n_docs,
            "skipped_documents": skipped, "dtype": dtype.str, "eos_id": enc.eos,
            "vocab_size": enc.vocab_size, "chat_template": enc.chat_template,
            "byteorder": sys.byteorder}


@dataclass
class TokenPart:
    """One side of the split: its tokens and mask (memmap views) and the start of each
    window of seq_len + 1 tokens that has at least one counted target."""

    tokens: np.ndarray  # (n,)
    mask: np.ndarray  # (n,)
    starts: np.ndarray  # (n_windows,) int64
    seq_len: int

    @classmethod
    def of(cls, tokens: np.ndarray, mask: np.ndarray, seq_len: int,
           all_count: bool) -> TokenPart:
        n = (len(tokens) - 1) // seq_len
        starts = np.arange(n, dtype=np.int64) * seq_len
        if not all_count:
            # Window k's targets are tokens k*T+1 .. k*T+T. A window with none counted
            # would give a 0/0 loss: it is left out.
            per = np.asarray(mask[1 : n * seq_len + 1]).reshape(n, seq_len).any(axis=1)
            starts = starts[per]
        return cls(tokens, mask, starts, seq_len)

    def rows(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of these windows, each (len(windows), seq_len) int64 on CPU."""
        T = self.seq_len
        x = np.empty((len(windows), T), np.int64)
        y = np.empty((len(windows), T), np.int64)
        keep = np.empty((len(windows), T), np.uint8)
        # One contiguous slice per window: a few pages of the map, no gather.
        for i, s in enumerate(self.starts[windows].tolist()):
            row = self.tokens[s : s + T + 1]
            x[i], y[i], keep[i] = row[:-1], row[1:], self.mask[s + 1 : s + T + 1]
        np.putmask(y, keep == 0, IGNORE)
        return torch.from_numpy(x), torch.from_numpy(y)


@dataclass
class TokenSplit:
    train: TokenPart
    val: TokenPart


def split(data: TokenData, val_fraction: float, seq_len: int) -> TokenSplit:
    """The last `val_fraction` of the packed tokens is validation (documents in data.path
    order); each part needs >= 2 windows of seq_len + 1 tokens, and one with a counted target."""
    n = len(data.tokens)
    n_val = int(n * val_fraction)
    need = 2 * (seq_len + 1)
    if n_val < need or n - n_val < need:
        raise ValueError(
            f"the data has {n} tokens: too little for a {val_fraction} validation split with "
            f"sequences of {seq_len} (each part needs >= {need} tokens); give more data or a "
            "smaller block size")
    all_count = int(data.meta["counted"]) == n  # text without BOS: no window to check
    cut = n - n_val
    parts = TokenSplit(TokenPart.of(data.tokens[:cut], data.mask[:cut], seq_len, all_count),
                       TokenPart.of(data.tokens[cut:], data.mask[cut:], seq_len, all_count))
    for name, p in (("training", parts.train), ("validation", parts.val)):
        if len(p.starts) == 0:
            raise ValueError(f"the {name} split has no sequence of {seq_len} tokens with a "
                             "token that counts for the loss; give more data")
    return parts


class TokenBatchStream(D.BatchStream):
    """Training batches of one rank from a TokenPart: `next()` gives (inputs, targets), each
    (batch_size, seq_len) int64, targets -100 where a token does not count."""

    def __init__(self, part: TokenPart, seq_len: int, batch_size: int, rank: int, world: int,
                 seed: int, device: torch.device | str = "cpu") -> None:
        if seq_len != part.seq_len:
            raise ValueError(f"the split was made for sequences of {part.seq_len}, "
                             f"not {seq_len}")
        self.part = part
        super().__init__(torch.empty(0), seq_len, batch_size, rank, world, seed, device)

    def _windows(self, tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
        return torch.from_numpy(self.part.starts)

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.part.rows(idx.numpy())
        return x.to(self.device), y.to(self.device)


def val_batches(part: TokenPart, seq_len: int, batch_size: int, rank: int, world: int,
                n_batches: int, device: torch.device | str = "cpu",
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same fixed validation batches every time: the first windows in order, cycled
    (data.val_batches' rule)."""
    dev = torch.device(device)
    for b in range(n_batches):
        start = (b * world + rank) * batch_size
        x, y = part.rows(np.arange(start, start + batch_size) % len(part.starts))
        yield x.to(dev), y.to(dev)
