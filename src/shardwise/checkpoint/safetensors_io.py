"""Writing safetensors files one tensor (or one slice of rows) at a time, and durable I/O.

safetensors' own Python API serializes a whole dict of tensors at once. To hold at most one
tensor (or one piece of one) in memory we write the format ourselves; it is small and
documented (https://github.com/huggingface/safetensors#format):

    8 bytes   N, the header length, unsigned little-endian
    N bytes   JSON: {key: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
              "__metadata__": {str: str}}, padded with spaces to a multiple of 8
    rest      the tensors' raw little-endian bytes, back to back in header order; offsets
              are relative to the start of this section

Every shape is known before the first byte is written, so the header goes first and the
data streams after it. The SHA-256 of the whole file is computed on the way out, so no
file is read back to checksum it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch

# torch dtype <-> safetensors dtype tag (the subset both sides know).
_ST_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {str(d).removeprefix("torch."): d for d in _ST_DTYPE}

_HASH_CHUNK = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling used in manifests."""
    if dtype not in _ST_DTYPE:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; supported: "
                         f"{sorted(_BY_NAME)}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


class Entry(NamedTuple):
    """One tensor of a file: its key, dtype and shape (written in this order)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length plus the padded JSON header for `entries` stored back to back."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for e in entries:
        if e.key in header or e.key == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor key {e.key!r}")
        header[e.key] = {"dtype": _ST_DTYPE[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the reference writer aligns the data section to 8
    return struct.pack("<Q", len(blob)) + blob


def data_offsets(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where each tensor's bytes are in a safetensors file: (the data section's start,
    key -> [begin, end) relative to it), from the header alone.

    safetensors' reader validates the header (shapes, dtypes, offsets inside the file) but
    does not expose the offsets; a reader that copies bytes with pread needs them.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        blob = f.read(n)
    if len(blob) != n:
        raise ValueError(f"{path}: the header says {n} bytes, the file holds {len(blob)}")
    header = json.loads(blob)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[key] = (int(begin), int(end))
    return 8 + n, out


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (on the CPU; 0-d and bf16 included)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class StreamWriter:
    """Writes one safetensors file: the header now, then tensors or row slices in order.

    `write` takes the next tensor, or the next rows of it (a tensor may arrive in several
    consecutive slices). `close` checks every byte arrived, fsyncs, and returns (size,
    sha256). Writes go to `path` directly; callers publish by renaming.
    """

    def __init__(self, path: str, entries: Sequence[Entry],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.entries = list(entries)
        head = header_bytes(self.entries, metadata)
        self._ends: list[int] = []
        end = 0
        for e in self.entries:
            end += e.nbytes
            self._ends.append(end)
        self._hash = hashlib.sha256()
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._size = 0
        self._pos = 0  # bytes of the data section written so far
        self._index = 0  # the entry the next bytes belong to
        self._put(head)

    def _put(self, data: memoryview | bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def write(self, t: torch.Tensor, key: str | None = None) -> None:
        """Append `t` (a whole tensor, or its next rows) to the entry being written.

        `key`, when given, must name that entry: a check that producer and header agree.
        """
        if t.numel() == 0:
            return  # zero-size entries hold no bytes
        while self._index < len(self.entries) and self._pos == self._ends[self._index]:
            self._index += 1  # skip finished (and zero-size) entries
        if self._index >= len(self.entries):
            raise ValueError(f"{self.path}: more data than the header announced")
        e = self.entries[self._index]
        if key is not None and key != e.key:
            raise ValueError(f"{self.path}: got data for {key} while writing {e.key}")
        if t.dtype != e.dtype:
            raise ValueError(f"{self.path}: {e.key} is {e.dtype}, got a {t.dtype} tensor")
        data = raw_bytes(t)
        if self._pos + len(data) > self._ends[self._index]:
            raise ValueError(f"{self.path}: {e.key} got {len(data)} bytes past its end "
                             f"(shape {e.shape})")
        self._put(data)
        self._pos += len(data)

    def close(self) -> tuple[int, str]:
        total = self._ends[-1] if self._ends else 0
        if self._pos != total:
            self.abort()
            raise ValueError(f"{self.path}: wrote {self._pos} of {total} data bytes")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        self._file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def sha256_file(path: str) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)  # one reused buffer: hashing costs no memory per file size
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def fsync_dir(path: str) -> None:
    """Make renames and new names inside directory `path` durable (POSIX only)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Write a small text file durably (write, flush, fsync)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
