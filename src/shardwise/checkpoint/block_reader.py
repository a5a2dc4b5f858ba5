"""Reading blocks of stored tensors with pread, under one bounded buffer per rank.

[Note: bounded reads] A rank reads its block of each pretrained tensor (its dim-0 rows,
under TP a (rows, columns) block) straight from the file with `os.preadv`, in row chunks
of at most `buffer_bytes`:

- a chunk whose bytes are exactly its destination's (the same dtype, whole rows, a CPU
  tensor) is read into the destination itself: no buffer at all;
- otherwise (a dtype conversion, column slices, a device shard) the chunk is read into one
  staging buffer, reused for the whole load and never larger than `buffer_bytes` (or one
  row, if a row is larger), then copied into place, converting the dtype on the way.

Nothing is memory-mapped, so nothing of the files counts in this process's resident
memory: a rank's peak is its shards plus the staging buffer, whatever the number and size
of the files. The first version copied from safetensors' memory maps and unmapped a file
after 64 MiB had been read through it; a model saved in many smaller files (HF's 5 GB
shards of a large model read by many ranks, or 10 files of 40 MB) then kept every file's
touched pages mapped to the end. A 416 MB Llama in 10 files at 2 ranks
(benchmarks/load_pretrained_memory.py, RESULTS.md): peak growth per rank 418-430 MiB
before (199 MiB of shards + the file pages, 1.05-1.08x the model), 273 MiB with one unmap
budget over all files, 205 MiB with pread (shards + 7 MiB), in the same time.

Column slices are read one contiguous run per row (exactly the block's bytes, no more).
Each chunk is also counted for NaN/inf in the dtype it was loaded as (finite.py's one-read
fast path while the chunk is still in cache), for `load_pretrained`'s verdict.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from .finite import count_nonfinite
from .manifest import CheckpointError
from .pretrained_files import StoredTensor

DEFAULT_BUFFER_BYTES = 64 * 2**20

Block = tuple[slice, ...]


def _runs(shape: tuple[int, ...], block: Block, rows: tuple[int, int], itemsize: int
          ) -> list[tuple[int, int]]:
    """(byte offset in the tensor, byte count) of each contiguous run of `block`'s rows
    [rows[0], rows[1]), in row-major order: one run when the trailing dims are whole."""
    lo, hi = rows
    trailing = shape[1:]
    cut = [i for i, (s, n) in enumerate(zip(block[1:], trailing)) if (s.start, s.stop) != (0, n)]
    row = math.prod(trailing)
    if not cut:
        return [(lo * row * itemsize, (hi - lo) * row * itemsize)]
    k = cut[-1]  # dims after k are whole: a run is block[k]'s extent of them
    inner = math.prod(trailing[k + 1:])
    run = (block[1 + k].stop - block[1 + k].start) * inner * itemsize
    strides = [math.prod(trailing[i + 1:]) for i in range(len(trailing))]
    out = []
    outer = [range(s.start, s.stop) for s in block[1: 1 + k]]
    for r in range(lo, hi):
        for idx in itertools.product(*outer):
            at = r * row + sum(i * st for i, st in zip(idx, strides)) \
                + block[1 + k].start * strides[k]
            out.append((at * itemsize, run))
    return out


class BlockReader:
    """Copies blocks of stored tensors into tensors the caller owns ([Note: bounded reads]).

    `bytes_read`: the stored bytes of every block read (what this rank pulled from disk or
    the page cache). `peak_buffer_bytes`: the largest staging buffer it held. `nonfinite`:
    (stored key, block) -> count of NaN/inf values read, in the destination's dtype.
    """

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.buffer_bytes = buffer_bytes
        self.bytes_read = 0
        self.peak_buffer_bytes = 0
        self.nonfinite: dict[tuple[str, str, tuple[tuple[int, int], ...]], int] = {}
        self._fds: dict[str, int] = {}
        self._staging: torch.Tensor | None = None  # uint8, grown on demand up to the bound

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path} cannot be read: {e}") from None
        return self._fds[path]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the new
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, nbytes)
        return self._staging[:nbytes]

    def _read(self, path: str, offset: int, into: torch.Tensor) -> None:
        """Fill the contiguous uint8 CPU tensor `into` from `path` at `offset` (every read
        goes through here: the tests count them)."""
        view = memoryview(into.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd(path), [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"{path} is truncated: {offset + len(view)} bytes "
                                      f"expected, it ends at {offset + done}")
            done += n

    def read_into(self, st: StoredTensor, block: Block, out: torch.Tensor) -> None:
        """Copy `st[block]` into `out` (shaped like the block; 0-d: one row)."""
        shape = st.shape or (1,)  # a 0-d tensor reads as one row of one element
        block = block or (slice(0, 1),)
        rows = block[0].stop - block[0].start
        if rows == 0:
            return  # an empty shard (its rows are another rank's): nothing to read
        row_bytes = math.prod(s.stop - s.start for s in block[1:]) * st.dtype.itemsize
        step = max(1, self.buffer_bytes // max(row_bytes, 1))
        flat = out if st.shape else out.reshape(1)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            a = block[0].start
            runs = _runs(shape, block, (a + lo, a + hi), st.dtype.itemsize)
            dst = flat[lo:hi]
            nbytes = (hi - lo) * row_bytes
            direct = (len(runs) == 1 and dst.dtype == st.dtype and dst.device.type == "cpu"
                      and dst.is_contiguous())
            if direct:
                self._read(st.file, st.offset + runs[0][0], dst.reshape(-1).view(torch.uint8))
            else:
                buf = self._buffer(nbytes)
                at = 0
                for off, n in runs:
                    self._read(st.file, st.offset + off, buf[at: at + n])
                    at += n
                dst.copy_(buf.view(st.dtype).reshape(dst.shape))
            self.bytes_read += nbytes
            bad = count_nonfinite(dst)
            if bad:
                key = (st.file, st.key, tuple((s.start, s.stop) for s in block))
                self.nonfinite[key] = self.nonfinite.get(key, 0) + bad

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._staging = None

