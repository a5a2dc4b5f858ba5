"""Review: `shardwise train --model.hf` on prompt/completion data, where micro-batches hold
different numbers of counted targets. docs/training.md: "The loss is the mean over counted
targets." With the same global batch and the same (pretrained) starting weights, the step-1
loss must be that mean whichever way the batch is split: one rank x 2 rows, one rank x 1 row
x grad_accum 2, or 2 ranks x 1 row. The trainer averaged each micro-batch's own mean with
equal weights (trainer.py: loss / grad_accum, and the ranks' mean), so the logged loss (and
the gradient) depended on the split.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.train import options as O
from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import ok, shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, save_tokenizer

SEQ = 16
COMMON = ["--model.hf", "llama", "--data.path", "pc.jsonl", "--model.block_size", str(SEQ),
          "--train.steps", "1", "--train.eval_interval", "0", "--train.eval_batches", "1",
          "--log.event_steps", "0", "--log.sample_tokens", "0", "--train.warmup_steps", "1",
          "--threads", "1"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("review_hf")
    save_tiny("llama", cwd / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(cwd / "llama")
    with open(cwd / "pc.jsonl", "w") as f:
        for i in range(200):  # completions of very different lengths
            comp = " def f(x): return x + 1" * (1 if i % 2 else 6)
            f.write(json.dumps({"prompt": f"Q{i}: write code for item number {i} please\nA:",
                                "completion": comp}) + "\n")
    return cwd


def _global_mean(ws: Path) -> tuple[float, list[int]]:
    """Step 1's global batch (2 rows), by hand: the mean over its counted targets."""
    from transformers import AutoModelForCausalLM

    from shardwise.train import token_cache as TC
    from shardwise.train import token_parts as P

    with contextlib.chdir(ws):  # the saved data.path is relative to the run's cwd
        cfg = O.build(O.read_toml(ws / "runs" / "b2" / "config.toml"))
    data = TC.prepare(ws / "pc.jsonl", ws / "llama", ws / "runs" / "token-cache")
    train, _ = P.split(data, cfg.data.val_fraction, SEQ, cfg.data.seed)
    x, y, pos = P.TokenBatchStream(train, SEQ, 2, 0, 1, cfg.data.seed).next()
    model = AutoModelForCausalLM.from_pretrained(str(ws / "llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    return loss.item(), (y != -100).sum(1).tolist()


@pytest.mark.parametrize("split", [
    ("b2", ["--nproc", "1", "--train.batch_size", "2"]),
    ("accum", ["--nproc", "1", "--train.batch_size", "1", "--train.grad_accum", "2"]),
    ("ranks", ["--nproc", "2", "--train.batch_size", "1"]),
], ids=["one-rank-2-rows", "grad-accum-2", "two-ranks"])
def test_loss_is_the_mean_over_counted_targets_however_the_batch_is_split(
        ws: Path, split: tuple[str, list[str]]) -> None:
    name, args = split
    if not (ws / "runs" / "b2").exists():
        ok(shardwise_train(*COMMON, "--name", "b2", "--nproc", "1", "--train.batch_size", "2",
                           cwd=ws))
    if name != "b2":
        ok(shardwise_train(*COMMON, "--name", name, *args, cwd=ws))
    want, counts = _global_mean(ws)
    assert counts[0] != counts[1], counts  # the rows count different numbers of targets
    got = read_metrics(ws / "runs" / name / "metrics.jsonl")[0]["loss"]
    assert abs(got - want) < 1e-5, (
        f"{name}: step-1 loss {got} != mean over the global batch's counted targets {want} "
        f"(rows count {counts} targets)")
