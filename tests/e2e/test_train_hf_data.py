"""`shardwise train --model.hf` with the data people have: a weighted mix of a parquet file
and a JSONL file, a separate evaluation file, unpacked (padded) batches; evaluation reports
perplexity and token accuracy and keeps checkpoints/best; `generate --chat` answers from it.
One training launch (2 ranks, 3 steps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import ok, shardwise_train
from tests.e2e.test_train_hf import shardwise
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, save_tokenizer

datasets = pytest.importorskip("datasets")


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                         {"role": "assistant", "content": f"It is {2 * i}."}]}


def test_mix_eval_file_unpacked_best_and_chat(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(tmp_path / "llama")
    datasets.Dataset.from_list([_chat(i) for i in range(200)]).to_parquet(
        str(tmp_path / "chat.parquet"))
    (tmp_path / "pc.jsonl").write_text("".join(
        json.dumps({"prompt": f"Q{i}: double {i}?", "completion": f" {2 * i}"}) + "\n"
        for i in range(200)))
    (tmp_path / "eval.json").write_text(json.dumps([_chat(i) for i in range(500, 540)]))
    out = ok(shardwise_train(
        "--model.hf", "llama", "--data.mix", "chat.parquet:0.7,pc.jsonl:0.3",
        "--data.eval_path", "eval.json", "--data.packing", "false", "--name", "mix",
        "--model.block_size", "32", "--train.batch_size", "2", "--train.steps", "3",
        "--train.eval_interval", "1", "--train.eval_batches", "2", "--train.lr", "0.01",
        "--train.warmup_steps", "1", "--log.event_steps", "0", "--log.sample_tokens", "0",
        "--nproc", "2", cwd=tmp_path))
    assert "perplexity" in out and "token accuracy" in out, out
    rows = read_metrics(tmp_path / "runs" / "mix" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isclose(r["val_perplexity"], math.exp(r["val_loss"]), rel_tol=1e-9)
        assert 0.0 <= r["val_accuracy"] <= 1.0
    best = tmp_path / "runs" / "mix" / "checkpoints" / "best"
    extra = json.loads((best / "manifest.json").read_text())["extra"]
    low = min(rows, key=lambda r: r["val_loss"])
    assert (extra["step"], extra["val_loss"]) == (low["step"], low["val_loss"])
    assert [r["step"] for r in rows if r.get("best")][-1] == low["step"]
    assert f"best val loss    {low['val_loss']:.4f} at step {low['step']}" in out, out
    gen = shardwise("generate", "runs/mix", "--checkpoint", "best", "--chat", "--prompt",
                    "What is 3 + 3?", "--temperature", "0", "--max-new-tokens", "4", cwd=tmp_path)
    assert gen.returncode == 0 and "What is" not in gen.stdout, gen.stderr
