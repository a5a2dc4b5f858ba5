"""Byte-level data: the default corpus, the split, per-rank slices and the saved position."""

from __future__ import annotations

import pytest
import torch

from shardwise.train import data as D
from shardwise.train import eval_metrics as E


def _tokens(n: int = 20_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


def test_stdlib_corpus_is_deterministic() -> None:
    a = D.read_corpus(None, 200_000, seed=1)
    b = D.read_corpus(None, 200_000, seed=1)
    c = D.read_corpus(None, 200_000, seed=2)
    assert a == b and len(a) == 200_000
    assert a != c
    assert b"def " in a or b"import" in a


def test_user_text_file_and_folder(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("alpha " * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta " * 100)
    one = D.read_corpus(tmp_path / "a.txt", 10_000, seed=0)
    assert one == b"alpha " * 100
    both = D.read_corpus(tmp_path, 10_000, seed=0)
    assert b"alpha" in both and b"beta" in both


def test_split_is_a_partition_with_val_at_the_end() -> None:
    text = bytes(range(256)) * 40
    s = D.split(text, 0.1, seq_len=16)
    assert len(s.train) + len(s.val) == len(text)
    assert len(s.val) == int(len(text) * 0.1)
    assert bytes(s.val.tolist()) == text[-len(s.val):]


def test_split_too_small_says_so() -> None:
    import pytest

    with pytest.raises(ValueError, match="too little"):
        D.split(b"x" * 100, 0.1, seq_len=64)


def test_ranks_read_disjoint_slices_of_one_global_batch() -> None:
    toks = _tokens()
    world, bs, seq = 3, 4, 16
    streams = [D.BatchStream(toks, seq, bs, r, world, seed=7) for r in range(world)]
    single = D.BatchStream(toks, seq, bs * world, 0, 1, seed=7)
    for _ in range(5):
        xs = [s.next()[0] for s in streams]
        together = single.next()[0]
        assert torch.equal(torch.cat(xs), together)
        flat = {tuple(x.tolist()) for x in torch.cat(xs)}
        assert len(flat) == bs * world  # no window twice within a step


def test_targets_are_inputs_shifted_by_one() -> None:
    x, y = D.BatchStream(_tokens(), 16, 4, 0, 1, seed=0).next()
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_position_restores_at_another_world_size() -> None:
    toks = _tokens()
    a = D.BatchStream(toks, 16, 4, 0, 2, seed=3)  # global batch 8
    for _ in range(30):
        a.next()
    state = a.state_dict()
    ref = [a.next()[0] for _ in range(3)]
    # Resume on 1 rank with the same global batch: the very same sequences follow.
    b = D.BatchStream(toks, 16, 8, 0, 1, seed=3)
    b.load_state_dict(state)
    for r in ref:
        assert torch.equal(b.next()[0][:4], r)


def test_epochs_reshuffle_and_wrap() -> None:
    toks = _tokens(2_000)  # 124 windows of 16
    s = D.BatchStream(toks, 16, 10, 0, 1, seed=0)
    for _ in range(13):
        s.next()
    assert s.epoch == 1 and s.index == 10


def test_val_batches_are_fixed() -> None:
    toks = _tokens(5_000)
    a = [x for x, _ in E.batches(*D.eval_rows(toks, 16), 4, 1, 2, 3)]
    b = [x for x, _ in E.batches(*D.eval_rows(toks, 16), 4, 1, 2, 3)]
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and len(a) == 3


def test_check_size_refuses_what_the_workers_would(tmp_path) -> None:
    """The launcher's check from file sizes alone (no worker started) raises the error that
    split / BatchStream would raise after reading the text."""
    from shardwise.train.data import check_size

    (tmp_path / "small.txt").write_bytes(b"hello world!")
    with pytest.raises(ValueError, match="the corpus has 12 bytes"):
        check_size(str(tmp_path / "small.txt"), 8_000_000, 0, 0.05, 64, 8, 2)
    for i, n in enumerate([5000, 0, 300, 7000]):
        (tmp_path / f"f{i}").write_bytes(b"x" * n)
    (tmp_path / "small.txt").unlink()
    for max_bytes in (3000, 9000, 100_000):
        text = D.read_corpus(str(tmp_path), max_bytes, 3)
        try:
            D.BatchStream(D.split(text, 0.05, 64).train, 64, 20, 0, 2, 3)
            want = None
        except ValueError as e:
            want = str(e)
        try:
            check_size(str(tmp_path), max_bytes, 3, 0.05, 64, 20, 2)
            got = None
        except ValueError as e:
            got = str(e)
        assert got == want, max_bytes
