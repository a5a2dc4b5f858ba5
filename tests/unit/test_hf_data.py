"""Tokenized data for Hugging Face models: formats, loss masks, packing, the token cache, the
per-rank streams and every bad input (with nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.train import hf_data as H
from shardwise.train import token_cache as TC
from tests.hf_tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    return save_tokenizer(root / "chat"), save_tokenizer(root / "plain", chat_template=False)


@pytest.fixture(scope="module")
def tok(folders: tuple[Path, Path]):  # noqa: ANN201 - a transformers tokenizer
    return H.load_tokenizer(folders[0])


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _ids(tok, text: str) -> list[int]:  # noqa: ANN001
    return tok(text, add_special_tokens=False)["input_ids"]


def test_text_documents_are_packed_with_eos_in_path_order(tmp_path, folders, tok) -> None:
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "b.txt").write_text("def b():\n    return 2\n")
    (tmp_path / "data" / "sub" / "c.md").write_text("Some prose, then code.")
    (tmp_path / "data" / ".hidden").write_text("never read")
    _jsonl(tmp_path / "data" / "a.jsonl", [{"text": "first doc"}, {"text": "second"}])
    seen: list[TC.Progress] = []
    data = TC.prepare(tmp_path / "data", folders[0], tmp_path / "cache", progress=seen.append)
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total  # the last report: all done
    assert (seen[-1].documents, seen[-1].tokens) == (4, len(data.tokens))
    eos = tok.eos_token_id
    want = [*_ids(tok, "first doc"), eos, *_ids(tok, "second"), eos,
            *_ids(tok, "def b():\n    return 2\n"), eos, *_ids(tok, "Some prose, then code."), eos]
    assert data.tokens.tolist() == want and data.tokens.dtype == np.uint16
    assert data.mask.tolist() == [1] * len(want)  # text: every token counts, EOS included
    assert data.meta["documents"] == 4 and data.meta["counted"] == len(want)
    assert data.docs.tolist() == [0, want.index(eos) + 1, *[
        i + 1 for i, t in enumerate(want) if t == eos][1:3]]  # where each document starts


def test_long_text_is_tokenized_in_pieces_with_the_same_ids(tmp_path, folders, tok,
                                                            monkeypatch) -> None:
    text = "".join(f"line {i}: x = {i * 7}\n\n" for i in range(400))
    (tmp_path / "t.txt").write_text(text)
    monkeypatch.setattr(H, "_PIECE_CHARS", 100)
    data = TC.prepare(tmp_path / "t.txt", folders[0], tmp_path / "cache")
    assert data.tokens.tolist() == [*_ids(tok, text), tok.eos_token_id]


def test_prompt_completion_counts_exactly_the_completion_tokens(tmp_path, folders, tok) -> None:
    recs = [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:", "completion": f" {2 * i}."}
            for i in range(30)]
    data = TC.prepare(_jsonl(tmp_path / "pc.jsonl", recs), folders[0], tmp_path / "cache")
    eos = tok.eos_token_id
    want_ids, want_mask = [], []
    for r in recs:
        p, c = _ids(tok, r["prompt"]), _ids(tok, r["completion"])
        want_ids += [*p, *c, eos]
        want_mask += [0] * len(p) + [1] * len(c) + [1]  # the EOS closing a completion counts
    assert data.tokens.tolist() == want_ids and data.mask.tolist() == want_mask
    assert data.meta["counted"] == sum(len(_ids(tok, r["completion"])) + 1 for r in recs)
    counted = [t for t, m in zip(want_ids, want_mask) if m and t != eos]
    assert tok.decode(counted) == "".join(r["completion"] for r in recs)


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "Eleven."}]


@pytest.mark.parametrize("template", [True, False], ids=["template", "fallback"])
def test_chat_counts_assistant_turns_only(tmp_path, folders, template: bool) -> None:
    folder = folders[0 if template else 1]
    tok = H.load_tokenizer(folder)
    recs = [{"messages": CONVERSATION},
            {"messages": CONVERSATION[:2]},  # no assistant turn: nothing to learn, left out
            {"messages": CONVERSATION[:4]}]  # ends on a user turn: its EOS does not count
    data = TC.prepare(_jsonl(tmp_path / "chat.jsonl", recs), folder, tmp_path / "cache")
    ids, mask = data.tokens.tolist(), data.mask.tolist()
    assert data.meta["documents"] == 2 and data.meta["skipped_documents"] == 1
    first = int(data.docs[1])  # a conversation gets no EOS of ours (TRL adds none)
    if template:
        full = tok.apply_chat_template(CONVERSATION, tokenize=False)
        want = "Seven.<|end|>Eleven.<|end|>"  # each reply to its end token, not the newline
    else:
        full = ("system: Be brief.\nuser: Name a prime.\nassistant: Seven.<|endoftext|>\n"
                "user: Another?\nassistant: Eleven.<|endoftext|>\n")
        want = "Seven.<|endoftext|>Eleven.<|endoftext|>"
    assert tok.decode(ids[:first]) == full
    assert tok.decode([t for t, m in zip(ids[:first], mask[:first]) if m]) == want
    second = [t for t, m in zip(ids[first:], mask[first:]) if m]
    assert tok.decode(second).startswith("Seven.") and mask[-1] == 0
    assert "Another" not in tok.decode(second) and "prime" not in tok.decode(second)


def _tiny(tmp_path: Path, n: int = 300) -> Path:
    return _jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i} " * (i % 7), "completion": f"c{i}"}
                                         for i in range(n)])


def test_second_prepare_reads_the_cache_and_keys_follow_data_and_tokenizer(
        tmp_path, folders, monkeypatch) -> None:
    path = _tiny(tmp_path)
    first = TC.prepare(path, folders[0], tmp_path / "cache")
    assert first.built

    def no_tokenizing(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("tokenized again")

    monkeypatch.setattr(H.Encoder, "encode", no_tokenizing)
    again = TC.prepare(path, folders[0], tmp_path / "cache")
    assert not again.built and again.key == first.key
    assert np.array_equal(again.tokens, first.tokens) and isinstance(again.tokens, np.memmap)
    monkeypatch.undo()
    with (first.path / "mask.bin").open("r+b") as f:  # a truncated entry is named, not read
        f.truncate(10)
    with pytest.raises(ValueError, match=r"token cache entry .* is damaged \(mask.bin: 10 "):
        TC.prepare(path, folders[0], tmp_path / "cache")
    # A changed data byte, another tokenizer (here: the chat template alone) -> new keys.
    other_tok = TC.data_key(path, folders[1])
    path.write_text(path.read_text().replace("c299", "c2999"))
    other_data = TC.data_key(path, folders[0])
    assert len({first.key, other_tok, other_data}) == 3
    rebuilt = TC.prepare(path, folders[0], tmp_path / "cache")
    assert rebuilt.built and rebuilt.key == other_data
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.key, other_data])  # no temporary folder left behind


def test_large_vocabularies_are_stored_as_int32(tmp_path, folders, monkeypatch) -> None:
    init = H.Encoder.__init__

    def big(self, tok) -> None:  # noqa: ANN001
        init(self, tok)
        self.vocab_size = 100_000

    monkeypatch.setattr(H.Encoder, "__init__", big)
    data = TC.prepare(_tiny(tmp_path, 20), folders[0], tmp_path / "cache")
    assert data.tokens.dtype == np.int32 and data.meta["dtype"] == "<i4"


def test_an_id_past_the_file_dtype_is_refused_not_wrapped(tmp_path, folders,
                                                          monkeypatch) -> None:
    def too_big(self, docs, wheres):  # noqa: ANN001
        return [H.Encoded(np.array([70_000, 0]), np.array([1, 1], np.uint8))]

    monkeypatch.setattr(H.Encoder, "encode", too_big)
    with pytest.raises(RuntimeError, match="token id 70000 does not fit uint16"):
        TC.prepare(_tiny(tmp_path, 5), folders[0], tmp_path / "runs" / "cache")
    assert not (tmp_path / "runs").exists()


BAD = {
    "missing field": ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}],
                      "d.jsonl line 2: no 'completion' field"),
    "no known field": ([{"txt": "a"}], "d.jsonl line 1: no 'text', 'prompt'/'completion' or "
                                       "'messages' field (found: txt)"),
    "not a string": ([{"text": "a"}, {"text": "b"}, {"text": 3}],
                     "d.jsonl line 3: the 'text' field must be a string, not int"),
    "bad message": ([{"messages": [{"role": "user"}]}],
                    "d.jsonl line 1: messages[0] must be an object"),
    "empty": ([], "holds no text to train on"),
    "no assistant": ([{"messages": CONVERSATION[:2]}], "holds no text to train on"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_records_fail_in_one_line_and_write_nothing(tmp_path, folders, case: str) -> None:
    records, message = BAD[case]
    path = _jsonl(tmp_path / "d.jsonl", records)
    _refused(tmp_path, path, folders[0], message)


def _refused(tmp_path: Path, data: Path, folder: Path, message: str) -> None:
    cache = tmp_path / "runs" / "token-cache"
    with pytest.raises(ValueError) as info:
        TC.prepare(data, folder, cache)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "runs").exists()


def test_unreadable_json_names_the_line(tmp_path, folders) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    _refused(tmp_path, path, folders[0],
             "d.jsonl line 3: not valid JSON (Expecting value at column 10)")


def test_failure_after_the_first_batch_removes_partial_output(tmp_path, folders,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(H, "BATCH_DOCS", 4)
    records = [{"text": f"doc {i}"} for i in range(20)] + [{"txt": "late"}]
    (tmp_path / "runs").mkdir()  # an existing folder stays; only what prepare made goes
    cache = tmp_path / "runs" / "cache"
    with pytest.raises(ValueError, match="d.jsonl line 21"):
        TC.prepare(_jsonl(tmp_path / "d.jsonl", records), folders[0], cache)
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path) -> None:
    from tests.hf_tokenizer import make_tokenizer

    tok = make_tokenizer()
    # The turn count up front: rendering the first k messages is not the start of all of them.
    tok.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(str(tmp_path / "model"))
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}] * 2)
    _refused(tmp_path, path, tmp_path / "model",
             "d.jsonl line 1: the tokenizer's chat template does not render a conversation "
             "prefix by prefix")


def test_no_tokenizer_and_no_data_name_the_path(tmp_path, folders) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    _refused(tmp_path, data, tmp_path / "model", f"no tokenizer in {str(tmp_path / 'model')!r}")
    _refused(tmp_path, tmp_path / "nope.txt", folders[0], "does not exist")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path, tmp_path / "empty", folders[0], "is a folder with no files")
