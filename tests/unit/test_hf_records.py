"""Record files beside JSONL: `.json` (an array of records, or JSON Lines under that name),
and through the `datasets` library parquet, arrow and `save_to_disk` folders. Each must give
exactly the tokens and loss mask of the same records as JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.train import hf_inputs
from shardwise.train import token_cache as TC
from tests.hf_tokenizer import save_tokenizer

PC = [{"prompt": f"Question {i}: what is {i} + {i}?\nAnswer:", "completion": f" {2 * i}."}
      for i in range(12)]
CHAT = [{"messages": [{"role": "user", "content": f"Say {i}"},
                      {"role": "assistant", "content": f"{i}!"}]} for i in range(6)]
TEXT = [{"text": f"def f{i}():\n    return {i}\n"} for i in range(5)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "model")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _same(a: TC.TokenData, b: TC.TokenData) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.mask.tolist() == b.mask.tolist()
    assert a.docs.tolist() == b.docs.tolist()


@pytest.mark.parametrize("records", [PC, CHAT, TEXT], ids=["prompt-completion", "chat", "text"])
def test_a_json_array_reads_as_records_not_as_text(tmp_path, folder, records) -> None:
    # What datasets' to_json(lines=False) writes: one JSON array. It used to be one text
    # document: brackets, keys and quotes in the loss, and no prompt mask.
    (tmp_path / "d.json").write_text(json.dumps(records, indent=1))
    got = TC.prepare(tmp_path / "d.json", folder, tmp_path / "cache")
    want = TC.prepare(_jsonl(tmp_path / "d.jsonl", records), folder, tmp_path / "cache")
    _same(got, want)
    assert got.meta["documents"] == len(records)
    if records is PC:
        assert 0 < got.meta["counted"] < len(got.tokens) / 2  # the prompts do not count


def test_json_lines_under_a_json_name_and_bad_records(tmp_path, folder) -> None:
    _jsonl(tmp_path / "lines.json", PC)  # datasets' default to_json: JSON Lines
    got = TC.prepare(tmp_path / "lines.json", folder, tmp_path / "cache")
    _same(got, TC.prepare(_jsonl(tmp_path / "d.jsonl", PC), folder, tmp_path / "cache"))
    (tmp_path / "bad.json").write_text(json.dumps([PC[0], PC[1], {"prompt": "x"}]))
    with pytest.raises(ValueError, match=r"^bad.json record 3: no 'completion' field"):
        TC.prepare(tmp_path / "bad.json", folder, tmp_path / "c2")
    (tmp_path / "broken.json").write_text('[{"text": "a"}, oops]')
    with pytest.raises(ValueError, match=r"^broken.json: not valid JSON \(Expecting value at "
                                         r"line 1 column 17\)"):
        TC.prepare(tmp_path / "broken.json", folder, tmp_path / "c3")
    assert not (tmp_path / "c2").exists() and not (tmp_path / "c3").exists()


def test_parquet_arrow_and_saved_datasets_read_like_jsonl(tmp_path, folder) -> None:
    datasets = pytest.importorskip("datasets")
    want = TC.prepare(_jsonl(tmp_path / "d.jsonl", PC), folder, tmp_path / "cache")
    ds = datasets.Dataset.from_list([{**r, "id": i} for i, r in enumerate(PC)])  # extra column
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=ds, validation=ds.select(range(3))).save_to_disk(
        str(tmp_path / "dd"))
    for path in ("d.parquet", "saved", "saved/data-00000-of-00001.arrow"):
        _same(TC.prepare(tmp_path / path, folder, tmp_path / "cache"), want)
    # A DatasetDict stands for its train split (training) or validation split (evaluation).
    assert hf_inputs.resolve(str(tmp_path / "dd"), "train") == str(tmp_path / "dd" / "train")
    assert hf_inputs.resolve(str(tmp_path / "dd"), "eval") == str(tmp_path / "dd" / "validation")
    val = TC.prepare(hf_inputs.resolve(str(tmp_path / "dd"), "eval"), folder, tmp_path / "cache")
    assert val.meta["documents"] == 3
    with pytest.raises(ValueError, match="is a saved DatasetDict .* give one split's folder"):
        TC.prepare(tmp_path / "dd", folder, tmp_path / "cache")
    # A folder of them: each file by its own rules, save_to_disk's metadata skipped.
    (tmp_path / "mixed").mkdir()
    ds.to_parquet(str(tmp_path / "mixed" / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "mixed" / "b"))
    both = TC.prepare(tmp_path / "mixed", folder, tmp_path / "cache")
    assert both.meta["documents"] == 2 * len(PC)
    assert np.array_equal(both.tokens[: len(want.tokens)], want.tokens)
    bad = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c",
                                                                           "completion": None}])
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"^bad.parquet row 2: the 'completion' field must be "
                                         "a string, not NoneType"):
        TC.prepare(tmp_path / "bad.parquet", folder, tmp_path / "c4")


def test_mix_is_parsed_and_checked(tmp_path) -> None:
    (tmp_path / "a.jsonl").write_text("{}")
    (tmp_path / "b.parquet").write_text("")
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")
    assert hf_inputs.parse_mix(f"{a}:0.7, {b}:0.3") == [(a, 0.7), (b, 0.3)]
    for text, msg in ((f"{a}:0", "each weight > 0"), (f"{a}", "PATH:WEIGHT"),
                      (f"{a}:x", "PATH:WEIGHT"), (f"{tmp_path}/nope:1", "does not exist"),
                      (f"{a}:1,{a}:2", "names a path twice")):
        with pytest.raises(ValueError, match=msg):
            hf_inputs.parse_mix(text)
