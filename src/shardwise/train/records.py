"""Record files other than JSON Lines: a `.json` file (a JSON array of records, or JSON Lines
under that name, as `datasets`' `to_json` writes by default), and, through the Hugging Face
`datasets` library, `.parquet` and `.arrow` files and folders written by `save_to_disk`.

Every record is read with the same rules as a JSONL line (hf_data.record_doc: `text`,
`prompt`/`completion` or chat `messages`; the first record decides the format; other
columns are ignored), and errors name the file and the record ("d.parquet row 7",
"d.json record 3", 1-based).

`datasets` is imported on first use only, and nothing is downloaded: local files are read
with its packaged builders (parquet, arrow) and `load_from_disk`.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from . import hf_data as H

# Written by `save_to_disk` beside the .arrow files: metadata, not records.
DATASET_META = ("state.json", "dataset_info.json", "dataset_dict.json")
_INSTALL = "pip install 'shardwise[hf]' (or: pip install datasets)"


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk`."""
    return path.is_dir() and (path / "state.json").is_file() and \
        (path / "dataset_info.json").is_file()


def saved_splits(path: Path) -> list[str]:
    """The splits of a folder written by `DatasetDict.save_to_disk` ([] if it is not one)."""
    f = path / "dataset_dict.json"
    if not (path.is_dir() and f.is_file()):
        return []
    try:
        splits = json.loads(f.read_text()).get("splits", [])
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    return [s for s in splits if isinstance(s, str) and is_saved_dataset(path / s)]


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading parquet, arrow and saved datasets needs the `datasets` "
                         f"library: {_INSTALL}") from None
    return datasets


def _rows(rows: Iterable[Any], name: str, unit: str, nbytes: int,
          ) -> Iterator[tuple[H.Doc, str, int]]:
    """Documents of records; the source's bytes are counted at its last record (progress)."""
    fmt = ""
    it = iter(rows)
    pending = None
    for i, obj in enumerate(it, 1):
        if pending is not None:
            yield pending
        doc, fmt = H.record_doc(obj, f"{name} {unit} {i}", fmt)
        pending = (doc, f"{name} {unit} {i}", 0)
    if pending is not None:
        yield pending[0], pending[1], nbytes


def json_docs(path: Path, name: str) -> Iterator[tuple[H.Doc, str, int]]:
    """A `.json` file: a JSON array of records, else JSON Lines (one object per line)."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from H.jsonl_docs(path, name)
        return
    try:
        records = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        msg = (f"{e.msg} at line {e.lineno} column {e.colno}"
               if isinstance(e, json.JSONDecodeError) else "not UTF-8")
        raise ValueError(f"{name}: not valid JSON ({msg})") from None
    yield from _rows(records, name, "record", path.stat().st_size)


def _dataset_rows(ds: Any) -> Iterator[dict[str, Any]]:
    for batch in ds.iter(batch_size=H.BATCH_DOCS):
        keys = list(batch)
        n = len(batch[keys[0]]) if keys else 0
        for i in range(n):
            yield {k: batch[k][i] for k in keys}


def file_docs(path: Path, name: str) -> Iterator[tuple[H.Doc, str, int]]:
    """The records of a `.json`, `.parquet` or `.arrow` file."""
    if path.suffix == ".json":
        yield from json_docs(path, name)
        return
    ds_lib = _datasets()
    size = path.stat().st_size
    try:
        if path.suffix == ".arrow":
            # What save_to_disk writes (Arrow stream format): memory-mapped, no cache.
            ds = ds_lib.Dataset.from_file(str(path))
            rows: Iterable[Any] = _dataset_rows(ds)
        else:
            # Streaming: read in record batches, nothing converted into a cache. A private
            # cache_dir keeps the builder's bookkeeping out of the user's home.
            with tempfile.TemporaryDirectory(prefix="shardwise-ds-") as tmp:
                ds = ds_lib.load_dataset("parquet", data_files=str(path), split="train",
                                         streaming=True, cache_dir=tmp)
                yield from _rows(ds, name, "row", size)
            return
    except (OSError, ValueError, TypeError) as e:
        if isinstance(e, ValueError) and str(e).startswith(name):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{name}: cannot be read as {path.suffix[1:]} ({first})") from None
    yield from _rows(rows, name, "row", size)


def saved_docs(path: Path, name: str) -> Iterator[tuple[H.Doc, str, int]]:
    """The records of a folder written by `Dataset.save_to_disk` (`load_from_disk`)."""
    ds = _datasets().load_from_disk(str(path))
    size = sum(p.stat().st_size for p in path.glob("*.arrow"))
    yield from _rows(_dataset_rows(ds), name, "row", size)
