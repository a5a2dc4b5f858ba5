"""Tokenize once, then memory-map: the token cache of a Hugging Face fine-tuning run.

Usage (one source; train/hf_inputs.py does this for every source of a run, and
token_parts.py cuts the entry into samples):

    # The launcher may call prepare() first, printing progress; the ranks then hit the cache.
    data = prepare_shared(path, model_folder, cache_dir)    # on every rank (a collective)
    data.tokens, data.mask, data.docs                       # memory-mapped token ids, mask
    data.key              # what a resume compares (data.reset)

[Note: token cache] A cache entry is a folder `<cache_dir>/<key>/` holding `tokens.bin` (the
packed token ids, raw little-endian uint16 when the vocabulary fits, else int32), `mask.bin`
(one uint8 per token: 1 when it counts as a target), `docs.bin` (int64 little-endian: the
first token of each document, in order) and `meta.json`. The key hashes the
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

from . import hf_data as H

log = logging.getLogger(__name__)
FORMAT = 3  # 2: docs.bin, the start of each document; 3: TRL's chat and completion targets
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
    docs: np.ndarray  # (D,) int64: where each document starts (docs[0] == 0)
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
    sizes = (("tokens.bin", n * np.dtype(meta["dtype"]).itemsize), ("mask.bin", n),
             ("docs.bin", int(meta["documents"]) * 8))
    for name, want in sizes:
        f = path / name
        size = f.stat().st_size if f.is_file() else -1
        if size != want:
            raise ValueError(f"token cache entry {str(path)!r} is damaged ({name}: {size} "
                             f"bytes, {want} expected): delete that folder to "
                             "tokenize again")
    tokens = np.memmap(path / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,))
    mask = np.memmap(path / "mask.bin", dtype=np.uint8, mode="r", shape=(n,))
    docs = np.fromfile(path / "docs.bin", dtype="<i8").astype(np.int64, copy=False)
    return TokenData(tokens, mask, docs, meta["key"], meta, path, built=False)


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
    from ..engine.comm.collectives import all_gather_bytes

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
    with (tmp / "tokens.bin").open("wb") as ft, (tmp / "mask.bin").open("wb") as fm, \
            (tmp / "docs.bin").open("wb") as fd:
        for docs, wheres, nbytes in _batches(data_path):
            for e in enc.encode(docs, wheres):
                counted = int(e.mask.sum())
                if counted == 0:  # nothing to learn from (a chat without assistant turns)
                    skipped += 1
                    continue
                if len(e.ids) and int(e.ids.max()) > limit:  # would wrap around silently
                    raise RuntimeError(f"token id {int(e.ids.max())} does not fit {dtype.name}"
                                       f" (the tokenizer reports {enc.vocab_size} ids)")
                fd.write(np.asarray([n_tokens], "<i8").tobytes())
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
