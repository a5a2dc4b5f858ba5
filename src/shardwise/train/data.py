"""Byte-level text data: a corpus, a train/validation split, and a resumable batch stream.

The default corpus is the Python standard library's own `.py` sources (found through
`sysconfig`), so every machine that runs shardwise has it and nothing is downloaded. Files
are shuffled with a fixed seed and read until `max_bytes`; the last `val_fraction` of that
text is the validation split. Tokens are bytes (vocabulary 256).

[Note: data position] The training split is cut into non-overlapping windows of
`seq_len + 1` bytes (input and shifted target). Each epoch visits them in an order drawn from
(seed, epoch). A step consumes the next `global_batch` windows of that order; rank r takes
its contiguous slice of them. The stream's whole state is (epoch, index into the order), so
it is saved in a checkpoint and restored at any world size: the job continues from the same
window, whoever reads it.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Folders of the standard library that are test suites or vendored third-party code: they
# are the least representative Python, and some contain deliberately broken files.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
SEPARATOR = b"\n\n"
IGNORE = -100  # a target that does not count (F.cross_entropy's default ignore_index)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted by path (stable across runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def user_files(path: str | Path) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        if files:
            return files
        raise ValueError(f"data.path={str(path)!r} is a folder with no files")
    raise ValueError(f"data.path={str(path)!r} does not exist")


def _shuffled(files: list[Path], seed: int) -> list[Path]:
    order = list(files)
    if len(order) > 1:
        random.Random(seed).shuffle(order)
    return order


def _take(sizes: list[int], max_bytes: int) -> list[int]:
    """How many bytes of each file (in order) the corpus takes: files joined by SEPARATOR
    until max_bytes."""
    taken, total = [], 0
    for size in sizes:
        if total >= max_bytes:
            break
        n = min(size, max_bytes - total)
        if n:
            taken.append(n)
            total += n + len(SEPARATOR)
    return taken


def read_corpus(path: str | Path | None, max_bytes: int, seed: int) -> bytes:
    """Concatenated bytes of a deterministic subset of the files (shuffled with `seed`)."""
    files = user_files(path) if path else stdlib_files()
    if not files:
        raise ValueError("no standard-library .py files found via sysconfig; use --data.path")
    parts: list[bytes] = []
    total = 0
    for f in _shuffled(files, seed):
        if total >= max_bytes:
            break
        b = f.read_bytes()[: max_bytes - total]
        if b:
            parts.append(b)
            total += len(b) + len(SEPARATOR)
    return SEPARATOR.join(parts)[:max_bytes]


@dataclass
class Split:
    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8


def _val_bytes(n: int, val_fraction: float, seq_len: int) -> int:
    """Bytes of a corpus of `n` held out for validation; each part holds >= 2 windows."""
    n_val = int(n * val_fraction)
    need = 2 * (seq_len + 1)
    if n_val < need or n - n_val < need:
        raise ValueError(
            f"the corpus has {n} bytes: too little for a {val_fraction} validation split "
            f"with sequences of {seq_len} (each part needs >= {need} bytes); give more text "
            "(data.path, data.max_bytes) or a smaller model.block_size")
    return n_val


def _check_windows(n_windows: int, seq_len: int, batch_size: int, world: int) -> None:
    if n_windows < batch_size * world:
        raise ValueError(
            f"the training split has {n_windows} sequences of {seq_len}, fewer than "
            f"one global batch ({batch_size} x {world} ranks); give more text")


def check_size(path: str | Path | None, max_bytes: int, seed: int, val_fraction: float,
               seq_len: int, batch_size: int, world: int) -> None:
    """The errors `split` and `BatchStream` would raise, from file sizes alone: run before
    any worker starts. The standard library is taken to hold at least max_bytes (it holds
    tens of MB; listing it costs a second)."""
    if path:
        taken = _take([f.stat().st_size for f in _shuffled(user_files(path), seed)], max_bytes)
        n = min(sum(taken) + len(SEPARATOR) * max(len(taken) - 1, 0), max_bytes)
    else:
        n = max_bytes
    n_train = n - _val_bytes(n, val_fraction, seq_len)
    _check_windows(max((n_train - 1) // seq_len, 0), seq_len, batch_size, world)


def split(text: bytes, val_fraction: float, seq_len: int) -> Split:
    """The last `val_fraction` of the bytes is validation; each part holds >= 2 windows."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    n_val = _val_bytes(len(data), val_fraction, seq_len)
    return Split(train=data[: len(data) - n_val], val=data[len(data) - n_val :])


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens: (n_windows, seq_len + 1), a view."""
    n = (len(tokens) - 1) // seq_len
    # Consecutive windows share their boundary token (target of one = input of the next).
    return tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def _to_batch(rows: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.to(torch.long)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)  # (B, T) inputs, (B, T) targets


class BatchStream:
    """Training batches for one rank; see [Note: data position]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                 world: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.windows = self._windows(tokens, seq_len)
        self.batch_size = batch_size  # per rank
        self.rank, self.world = rank, world
        self.seed = seed
        self.device = torch.device(device)
        _check_windows(len(self.windows), seq_len, batch_size, world)
        self.epoch = 0
        self.index = 0  # next window of this epoch's order
        self._order = self._epoch_order(0)

    def _windows(self, tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One row per window (a subclass may index its windows another way)."""
        return windows(tokens, seq_len)

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows `idx`."""
        return _to_batch(self.windows[idx], self.device)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.windows), generator=g)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len), for this rank."""
        if self.index + self.global_batch > len(self._order):
            # Drop the ragged tail: every rank must see a full batch in every step.
            self.epoch += 1
            self.index = 0
            self._order = self._epoch_order(self.epoch)
        mine = self.index + self.rank * self.batch_size
        idx = self._order[mine : mine + self.batch_size]
        self.index += self.global_batch
        return self._batch(idx)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"data position saved with seed {state['seed']}, "
                             f"but data.seed={self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)


def eval_rows(tokens: torch.Tensor, seq_len: int,
              ) -> tuple[int, Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]]:
    """The validation split as (number of rows, rows of row ids): its windows in order, then
    the tail they leave (fewer than seq_len targets, padded with -100 targets), so that every
    byte after the first is a target exactly once."""
    w = windows(tokens, seq_len)
    n = len(w)
    left = len(tokens) - 1 - n * seq_len  # targets after the last full window
    rows = w
    if left > 0:
        last = torch.zeros(1, seq_len + 1, dtype=tokens.dtype)
        last[0, : left + 1] = tokens[n * seq_len :]
        rows = torch.cat([w, last])

    def get(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _to_batch(rows[torch.from_numpy(idx)], torch.device("cpu"))
        if left > 0:
            y[torch.from_numpy(idx == n), left:] = IGNORE
        return x, y

    return len(rows), get
