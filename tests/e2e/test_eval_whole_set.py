"""Issue 42: validation loss is the token-weighted mean over the whole evaluation file, each
token counted once across ranks. A 38-record eval file at 2 ranks x batch 2 (9.5 global
batches: the last one half padding) against the hand computation: the unsharded model's
loss over every eval token once. Before the fix each pass drew 8 batches per rank and
cycled, counting 26 of the records twice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import ok, shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, corpus, make_tokenizer, save_tokenizer

pytest.importorskip("transformers")

SEQ = 48


def _records() -> list[str]:
    """38 short lines of the corpus (each well under SEQ tokens)."""
    lines = [ln.strip() for ln in corpus().splitlines() if 10 < len(ln.strip()) < 40]
    return lines[:38]


def test_eval_is_the_whole_file_once_at_two_ranks(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(tmp_path / "llama")
    (tmp_path / "train.txt").write_text(corpus())
    texts = _records()
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in texts))
    # lr 1e-30: the evaluated weights are the saved ones (an fp32 step that rounds to nothing).
    out = ok(shardwise_train(
        "--model.hf", "llama", "--data.path", "train.txt", "--data.eval_path", "eval.jsonl",
        "--data.packing", "false", "--model.block_size", str(SEQ), "--train.batch_size", "2",
        "--train.steps", "1", "--train.lr", "1e-30", "--train.warmup_steps", "0",
        "--log.event_steps", "0", "--log.sample_tokens", "0", "--nproc", "2", "--name", "ev",
        cwd=tmp_path))
    tok = make_tokenizer()
    docs = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert max(map(len, docs)) <= SEQ + 1
    n_targets = sum(len(d) - 1 for d in docs)
    assert f"evaluation: the whole set: 38 sequences, {n_targets:,} tokens" in out, out

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), dtype=torch.float32)
    total, right = 0.0, 0
    with torch.no_grad():
        for d in docs:
            ids = torch.tensor([d])
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0]
            total += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            right += int((logits.argmax(-1) == ids[0, 1:]).sum())
    rec = [r for r in read_metrics(tmp_path / "runs" / "ev" / "metrics.jsonl")
           if "val_loss" in r][-1]
    assert rec["val_loss"] == pytest.approx(total / n_targets, rel=1e-5)
    assert rec["val_perplexity"] == pytest.approx(math.exp(total / n_targets), rel=1e-5)
    assert rec["val_accuracy"] == pytest.approx(right / n_targets, abs=1e-9)
