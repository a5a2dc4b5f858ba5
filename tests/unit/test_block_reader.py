"""The pread block reader (checkpoint/block_reader.py): any block of any stored tensor, in
chunks under the buffer bound, equals slicing the tensor safetensors loads; NaN/inf counted
per block; the cross-rank totals count a block read by several ranks once."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardwise.checkpoint.block_reader import BlockReader, _runs
from shardwise.checkpoint.pretrained_files import find_files
from shardwise.checkpoint.pretrained_finite import _encode, totals


@pytest.fixture()
def stored(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=g),
        "b": torch.randn(4, 3, 6, generator=g).to(torch.bfloat16),
        "c": torch.randn(9, generator=g).half(),
        "s": torch.tensor(3.5),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


def _blocks(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Every block a rank may own: any dim-0 rows; past dim 0 one cut dim (TP's columns)."""
    rows = [slice(a, b) for a in range(shape[0] + 1) for b in range(a, shape[0] + 1)]
    whole = [slice(0, n) for n in shape[1:]]
    out = [(r, *whole) for r in rows]
    for d, n in enumerate(shape[1:]):
        for a, b in ((0, 1), (1, n), (n // 2, n)):
            cut = list(whole)
            cut[d] = slice(a, b)
            out += [(r, *cut) for r in rows[:: max(1, len(rows) // 6)]]
    return out


@pytest.mark.parametrize("buffer_bytes", [1, 10, 64, 1 << 20])
@pytest.mark.parametrize("into", [None, torch.float32, torch.float64])
def test_every_block_equals_the_stored_slice(tmp_path: Path, stored: dict[str, torch.Tensor],
                                             buffer_bytes: int, into: torch.dtype | None
                                             ) -> None:
    files = find_files(str(tmp_path))
    reader = BlockReader(buffer_bytes)
    try:
        for key, t in stored.items():
            st = files.tensors[key]
            dtype = t.dtype if into is None or not t.is_floating_point() else into
            if not t.shape:
                for block in ((slice(0, 1),), (slice(0, 0),)):
                    out = torch.full((1,), -1.0, dtype=dtype)
                    reader.read_into(st, block, out)
                    want = t.reshape(1).to(dtype) if block[0].stop else out
                    assert torch.equal(out, want), (key, block)
                continue
            for block in _blocks(tuple(t.shape)):
                want = t[block].to(dtype)
                out = torch.empty(want.shape, dtype=dtype)
                reader.read_into(st, block, out)
                assert torch.equal(out, want), (key, block)
    finally:
        reader.close()
    # The staging buffer stays under the bound (or one row, if a row is larger).
    row = max(t[0].numel() * t.element_size() for t in stored.values() if t.shape)
    assert reader.peak_buffer_bytes <= max(buffer_bytes, row)
    assert not reader.nonfinite


def test_runs_are_the_blocks_bytes() -> None:
    """Contiguous runs: one for whole rows; one per (row, outer index) for a cut dim."""
    shape = (4, 3, 5)
    flat = torch.arange(60).reshape(shape)
    for block in _blocks(shape):
        for lo, hi in itertools.combinations(range(block[0].start, block[0].stop + 1), 2):
            runs = _runs(shape, block, (lo, hi), 1)
            got = torch.cat([flat.reshape(-1)[o: o + n] for o, n in runs])
            want = flat[(slice(lo, hi), *block[1:])].reshape(-1)
            assert torch.equal(got, want), (block, lo, hi)
    assert len(_runs(shape, (slice(0, 4), slice(0, 3), slice(0, 5)), (1, 3), 4)) == 1


def test_nonfinite_counted_per_block_in_the_loaded_dtype(tmp_path: Path) -> None:
    t = torch.zeros(6, 4)
    t[1, 2], t[4, 0], t[4, 3] = float("nan"), float("inf"), 1e6  # 1e6 overflows fp16
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    st = find_files(str(tmp_path)).tensors["w"]
    reader = BlockReader(16)  # one row per chunk: counts add up over chunks
    for block, dtype, want in (((slice(0, 3), slice(0, 4)), torch.float32, 1),
                               ((slice(3, 6), slice(0, 4)), torch.float32, 1),
                               ((slice(3, 6), slice(0, 4)), torch.float16, 2),
                               ((slice(0, 6), slice(0, 2)), torch.float32, 1)):
        reader.nonfinite.clear()
        out = torch.empty((block[0].stop - block[0].start, block[1].stop - block[1].start),
                          dtype=dtype)
        reader.read_into(st, block, out)
        assert sum(reader.nonfinite.values()) == want, (block, dtype, reader.nonfinite)
    reader.close()


def test_totals_count_a_block_once_and_add_distinct_ones() -> None:
    f = "/x/model-00001.safetensors"
    rank0 = {(f, "w", ((0, 3), (0, 4))): 2, (f, "b", ((0, 4),)): 1}
    rank1 = {(f, "w", ((3, 6), (0, 4))): 5, (f, "b", ((0, 4),)): 1}  # b: read whole by both
    replica = dict(rank0)  # HYBRID_SHARD: another replica read rank 0's rows
    assert totals([_encode(rank0), _encode(rank1), _encode(replica)]) == [
        (f, "b", 1), (f, "w", 7)]
    assert totals([_encode({}), b""]) == []
