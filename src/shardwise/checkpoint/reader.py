"""Reading rows of stored tensors (only the rows asked for) and verifying checkpoint files."""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from .manifest import CheckpointError, Manifest
from .safetensors_io import dtype_name, sha256_file

_ST_TO_NAME = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
               "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
               "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def verify_files(ckpt: str, m: Manifest, rank: int, world: int) -> None:
    """Check the SHA-256 of this rank's share of the files (file i goes to rank i % world)."""
    for i, (name, info) in enumerate(sorted(m.files.items())):
        if i % world == rank:
            verify_file(os.path.join(ckpt, name), info)


def check_size(path: str, expected: int) -> None:
    """CheckpointError naming `path` if it is missing or not `expected` bytes long (cheap)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    if size != expected:
        raise CheckpointError(f"{path} is {'truncated' if size < expected else 'too long'}: "
                              f"{size} bytes, the manifest says {expected}")


def verify_file(path: str, info: dict) -> None:
    """CheckpointError naming `path` unless its size and SHA-256 match the manifest's."""
    try:
        size, digest = sha256_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if size != info["bytes"]:
        raise CheckpointError(f"{path} is truncated or was changed: {size} bytes, the "
                              f"manifest says {info['bytes']}")
    if digest != info["sha256"]:
        raise CheckpointError(f"{path} is corrupted: its SHA-256 does not match the "
                              f"manifest's")


class RowReader:
    """Reads rows [start, end) of a stored tensor from whichever files hold them.

    Files are opened lazily (safetensors memory-maps them) and only the requested rows of
    each piece are copied out, so a rank reads about 1/N of the checkpoint. Returned tensors
    own their memory.
    """

    def __init__(self, ckpt: str, manifest: Manifest) -> None:
        self.ckpt = ckpt
        self.manifest = manifest
        self._handles: dict[str, object] = {}

    def _open(self, name: str) -> object:
        if name not in self._handles:
            path = os.path.join(self.ckpt, name)
            try:
                self._handles[name] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") \
                    from None
        return self._handles[name]

    def read(self, name: str, start: int, end: int, *, own: bool = True) -> torch.Tensor:
        """Rows [start, end) of tensor `name` as a (end - start, *rest) CPU tensor.

        `own=False` may return a view of the memory-mapped file, valid until `close()`.
        """
        info = self.manifest.tensors[name]
        parts = [(f, a, b) for f, a, b in info.pieces if max(a, start) < min(b, end)]
        if len(parts) == 1 and parts[0][1] <= start and end <= parts[0][2]:
            f, a, _ = parts[0]
            # safetensors hands out views of its (copy-on-write) memory map of the file: own
            # the memory, or optimizer state would stay backed by the file (SIGBUS if it is
            # truncated later) and keep the whole piece mapped.
            rows = self._slice(name, f, start - a, end - a)
            return rows.clone() if own else rows
        out = torch.empty((end - start, *info.rest), dtype=info.dtype)
        for f, a, b in parts:
            lo, hi = max(a, start), min(b, end)
            out[lo - start : hi - start] = self._slice(name, f, lo - a, hi - a)
        return out

    def _slice(self, name: str, fname: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the piece of `name` stored in file `fname`."""
        info = self.manifest.tensors[name]
        rows = next(b - a for f, a, b in info.pieces if f == fname)
        path = os.path.join(self.ckpt, fname)
        try:
            sl = self._open(fname).get_slice(name)  # type: ignore[attr-defined]
            shape, dtype = list(sl.get_shape()), _ST_TO_NAME.get(sl.get_dtype())
            if shape != [rows, *info.rest] or dtype != dtype_name(info.dtype):
                raise CheckpointError(
                    f"{path}: {name} is {dtype} {shape} in the file, but the manifest "
                    f"says {dtype_name(info.dtype)} {[rows, *info.rest]}")
            return sl[lo:hi]
        except (SafetensorError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot read {name}: {e}") from None

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when collected
