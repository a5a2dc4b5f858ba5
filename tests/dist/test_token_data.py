"""The token cache on several ranks: one rank per node tokenizes, every rank maps the same
tokens and reads its own slice of each global batch; a bad input fails on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardwise.testing import run_distributed
from shardwise.train import token_cache as TC
from shardwise.train import token_parts as P
from tests.dist.token_workers import shared_prepare
from tests.hf_tokenizer import save_tokenizer


def test_prepare_shared_builds_once_and_ranks_read_their_slices(tmp_path: Path) -> None:
    folder = save_tokenizer(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i} " * (i % 5), "completion": f"a{i}"})
                            + "\n" for i in range(200)))
    cache = tmp_path / "cache"
    out = run_distributed(shared_prepare, 3, str(data), str(folder), str(cache))
    assert [o["built"] for o in out] == [True, False, False]  # rank 0 tokenized, once
    assert len({o["key"] for o in out}) == 1 and len({o["tokens"] for o in out}) == 1
    assert [p.name for p in cache.iterdir()] == [out[0]["key"]]
    # The three ranks' batches are the single-process stream's global batches, in rank order.
    ref = P.TokenBatchStream(P.split(TC.prepare(data, folder, cache), 0.1, 16, seed=9)[0],
                             16, 6, 0, 1, seed=9)
    for step in range(3):
        x, y, _ = ref.next()
        assert torch.equal(torch.tensor(sum((o["x"][step] for o in out), [])), x)
        assert torch.equal(torch.tensor(sum((o["y"][step] for o in out), [])), y)


def test_prepare_shared_bad_input_fails_on_every_rank(tmp_path: Path) -> None:
    folder = save_tokenizer(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n{"txt": "b"}\n')
    out = run_distributed(shared_prepare, 2, str(data), str(folder), str(tmp_path / "cache"))
    assert [o["error"] for o in out] == ["d.jsonl line 2: no 'text' field (this file's first "
                                         "record is 'text')"] * 2
    assert not (tmp_path / "cache").exists()
