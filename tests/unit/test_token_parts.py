"""Samples of a Hugging Face run (token_parts.py, hf_inputs.py): the seeded held-out split
draws from every file, packed documents do not see each other, unpacked rows are padded
per batch, sources mix by weight, and the per-rank streams resume at any world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardwise.train import eval_metrics as E
from shardwise.train import token_cache as TC
from shardwise.train import token_parts as P
from tests.hf_tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "model")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tiny(tmp_path: Path, n: int = 300) -> Path:
    return _jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i} " * (i % 7), "completion": f"c{i}"}
                                         for i in range(n)])


def _parts(data: TC.TokenData, val_fraction: float, seq: int, packed: bool = True,
           seed: int = 1234) -> tuple[P.TokenPart, P.TokenPart]:
    pieces = P.pieces(data, seq + 1)
    held = P.held_out(pieces, val_fraction, seed)
    return (P.TokenPart(data, pieces, ~held, seq, packed),
            P.TokenPart(data, pieces, held, seq, packed))


def test_the_held_out_split_draws_from_every_file(tmp_path, folder) -> None:
    # Four files, sorted by name; the old split took the last 5% of tokens in file order,
    # so the validation set was all of d.jsonl (and nothing of the others).
    for name in "abcd":
        _jsonl(tmp_path / "data" / f"{name}.jsonl",
               [{"text": f"{name}{name}{name} item {i}: " + "x = 1\n" * (i % 5)}
                for i in range(150)])
    data = TC.prepare(tmp_path / "data", folder, tmp_path / "cache")
    pieces = P.pieces(data, 17)
    held = P.held_out(pieces, 0.05, seed=1234)
    file_of = np.searchsorted(np.cumsum([0, 150, 150, 150]), pieces.doc, side="right") - 1
    share = np.bincount(file_of[held], minlength=4) / held.sum()
    assert (share > 0.1).all(), share  # every file is represented, none dominates
    val_tokens = pieces.length[held].sum() / pieces.length.sum()
    assert 0.05 <= val_tokens < 0.06
    assert np.array_equal(held, P.held_out(pieces, 0.05, seed=1234))  # every rank, resume
    assert not np.array_equal(held, P.held_out(pieces, 0.05, seed=1))
    # A long text file is cut into pieces first: it is held out in places, not at its end.
    (tmp_path / "long.txt").write_text("".join(f"line {i}: y = {i}\n" for i in range(2000)))
    one = TC.prepare(tmp_path / "long.txt", folder, tmp_path / "cache")
    p1 = P.pieces(one, 33)
    h1 = P.held_out(p1, 0.05, 1234)
    assert len(p1.start) > 100 and np.flatnonzero(h1).min() < len(p1.start) / 2


def _doc_loss(model: torch.nn.Module, ids: list[int]) -> float:
    x = torch.tensor([ids])
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_packed_row_gives_each_document_its_loss_alone(tmp_path, folder, kind) -> None:
    from tests.hf_models import build
    from tests.hf_tokenizer import VOCAB_SIZE

    docs = [{"text": t} for t in ("def a():\n    return 1\n", "Some prose.", "x = [1, 2]\n",
                                  "import os\nprint(os.sep)\n", "b")]
    data = TC.prepare(_jsonl(tmp_path / "d.jsonl", docs), folder, tmp_path / "cache")
    n = len(data.tokens)
    pieces = P.pieces(data, n + 1)  # no document is cut; one window holds all of them
    part = P.TokenPart(data, pieces, np.ones(len(pieces.start), bool), n - 1, packed=True)
    x, y, pos = part.rows(np.array([0]))
    longer = {"n_positions": 128} if kind == "gpt2" else {"max_position_embeddings": 128}
    model = build(kind, vocab_size=VOCAB_SIZE, use_cache=False, **longer).eval()
    assert n < 128
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=pos).logits[0]
        nll = F.cross_entropy(logits, y[0].clamp(min=0), reduction="none")
        bounds = [*data.docs.tolist(), n]
        for d in range(len(docs)):
            ids = data.tokens[bounds[d]: bounds[d + 1]].tolist()
            # Targets y[t] predict token t + 1: document d's are its tokens 1.. (not its first).
            mine = slice(bounds[d], bounds[d + 1] - 1)
            assert (y[0, bounds[d] - 1] == -100) or d == 0  # its first token is no target
            got = nll[mine].sum().item()
            assert got == pytest.approx(_doc_loss(model, ids), abs=1e-4), d
        # Without the position restarts, the later documents see the earlier ones.
        plain = model(input_ids=x).logits[0]
        last = slice(bounds[3], bounds[4] - 1)
        alone = _doc_loss(model, data.tokens[bounds[3]: bounds[4]].tolist())
        across = F.cross_entropy(plain[last], y[0, last], reduction="sum").item()
        assert abs(across - alone) > 1e-2


def test_unpacked_rows_are_documents_padded_per_batch(tmp_path, folder) -> None:
    data = TC.prepare(_tiny(tmp_path), folder, tmp_path / "cache")
    train, val = _parts(data, 0.1, 16, packed=False)
    # A row per piece of at most 17 tokens (a longer document is cut), minus pieces with no
    # counted target (a prompt's first piece).
    assert 290 < len(train) + len(val) <= len(P.pieces(data, 17).start)
    x, y, pos = train.rows(np.array([0, 1, 2, 3]))
    assert pos is None and x.shape == y.shape
    starts, lens = train.span_start[:4], train.span_len[:4]
    assert x.shape[1] == lens.max() - 1  # padded to the longest row of this batch only
    for r, (s, m) in enumerate(zip(starts.tolist(), lens.tolist())):
        toks = torch.from_numpy(data.tokens[s: s + m].astype(np.int64))
        keep = torch.from_numpy(data.mask[s + 1: s + m].astype(bool))
        assert torch.equal(x[r, : m - 1], toks[:-1])
        assert torch.equal(y[r, : m - 1], torch.where(keep, toks[1:], -100))
        assert (y[r, m - 1:] == -100).all()  # padding never counts


def test_sources_mix_by_weight_and_streams_resume_anywhere(tmp_path, folder) -> None:
    a = TC.prepare(_tiny(tmp_path / "a"), folder, tmp_path / "cache")
    b = TC.prepare(_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i} " * 9} for i in range(400)]),
                   folder, tmp_path / "cache")
    pa, pb = _parts(a, 0.1, 16)[0], _parts(b, 0.1, 16)[0]
    mix = P.Mixture([pa, pb], [0.2, 0.8])
    order = mix.order(5, 0)
    from_b = (order >= len(pa)).mean()
    assert 0.75 < from_b < 0.85 and len(order) == len(mix)
    assert np.array_equal(order, mix.order(5, 0)) and not np.array_equal(order, mix.order(5, 1))
    world, bs = 3, 2
    streams = [P.TokenBatchStream(mix, 16, bs, r, world, seed=5) for r in range(world)]
    single = P.TokenBatchStream(mix, 16, bs * world, 0, 1, seed=5)
    for _ in range(4):
        got = [s.next() for s in streams]
        x, y, pos = single.next()
        for i, t in enumerate((x, y, pos)):
            assert torch.equal(torch.cat([g[i] for g in got]), t)
        assert ((y >= 0).sum(1) > 0).all()  # no sequence without a counted target
    state = streams[0].state_dict()
    ref = [single.next()[0] for _ in range(2)]
    two = [P.TokenBatchStream(mix, 16, 3, r, 2, seed=5) for r in range(2)]
    for s in two:
        s.load_state_dict(state)
    for r in ref:
        assert torch.equal(torch.cat([s.next()[0] for s in two]), r)


def test_validation_batches_are_fixed_and_drawn_across_the_set(tmp_path, folder) -> None:
    data = TC.prepare(_tiny(tmp_path), folder, tmp_path / "cache")
    val = P.Mixture([_parts(data, 0.2, 16)[1]], [1.0])
    n, rows = P.eval_rows(val, seed=7)
    a = list(E.batches(n, rows, 2, 1, 2, 3))
    b = list(E.batches(*P.eval_rows(val, seed=7), 2, 1, 2, 3))
    assert len(a) == 3 and all(torch.equal(p[1], q[1]) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="no sequence of 4096 tokens"):
        from shardwise.train.hf_inputs import _named

        _named(len(_parts(data, 0.1, 4096)[1]), "validation", "d.jsonl", 4096, 10)


def test_perplexity_and_accuracy_count_only_counted_targets() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]]])
    y = torch.tensor([[0, 2, -100]])
    s = E.sums(logits, y)
    want = F.cross_entropy(logits[0, :2], y[0, :2], reduction="sum").item()
    assert s.tolist() == pytest.approx([want, 2.0, 1.0])
    r = E.result(s)
    assert r.loss == pytest.approx(want / 2) and r.perplexity == pytest.approx(np.exp(want / 2))
    assert r.accuracy == 0.5 and r.tokens == 2
    assert set(r.record()) == {"val_loss", "val_perplexity", "val_accuracy"}
