"""Issue 42: data and weight mistakes of a `--model.hf` run are found in the launcher,
before any worker starts, in one line naming the option that was given. An empty
--data.eval_path was reported as `data.path='...'`, 12-18 s in, after the workers started
and a dozen lines of third-party warnings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_train import shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, save_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("pre")
    save_tiny("llama", cwd / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(cwd / "llama")
    (cwd / "train.txt").write_text("some text to train on\n" * 50)
    (cwd / "empty.jsonl").write_text("")
    return cwd


def _fails(ws: Path, *args: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = shardwise_train("--model.hf", "llama", "--nproc", "2", *args, cwd=ws)
    took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launching" not in proc.stdout, "the error must come before any worker starts"
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardwise train: error")]
    assert len(errors) == 1, proc.stderr
    # Nothing of a third party before the error line.
    assert proc.stderr.lstrip().startswith("shardwise train: error"), proc.stderr
    return errors[0], took


def test_empty_eval_file_names_data_eval_path(ws: Path) -> None:
    line, took = _fails(ws, "--data.path", "train.txt", "--data.eval_path", "empty.jsonl")
    assert "data.eval_path=" in line and "empty.jsonl" in line and "data.path=" not in line
    assert took < 10  # about 2 s here (the interpreter and torch); 12-18 s before


def test_broken_weights_found_before_the_workers(ws: Path) -> None:
    (ws / "broken").mkdir()
    for f in (ws / "llama").iterdir():
        (ws / "broken" / f.name).write_bytes(f.read_bytes())
    (ws / "broken" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    t0 = time.perf_counter()
    proc = shardwise_train("--model.hf", "broken", "--data.path", "train.txt", "--nproc", "2",
                           cwd=ws)
    assert proc.returncode == 2 and "launching" not in proc.stdout, proc.stdout + proc.stderr
    assert "model.hf=" in proc.stderr or "model.safetensors" in proc.stderr, proc.stderr
    assert time.perf_counter() - t0 < 10
