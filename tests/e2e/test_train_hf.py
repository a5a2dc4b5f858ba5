"""`shardwise train --model.hf`, LoRA, `export --hf / --adapter`, `generate` and
`--resume-from` end to end, on a tiny Llama saved with save_pretrained and a BPE tokenizer
trained here (nothing downloaded). Three training launches in all: a full fine-tune, a LoRA
run, and a --resume-from --data.reset of the first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.train import options as O
from shardwise.train.metrics import read_metrics
from shardwise.train.trainer import lr_at
from tests.e2e.test_train import ok, shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, corpus, save_tokenizer

pytest.importorskip("peft")

SEQ, BATCH, WORLD, STEPS = 16, 2, 2, 3
COMMON = ["--model.block_size", str(SEQ), "--train.batch_size", str(BATCH),
          "--train.eval_interval", "0", "--train.eval_batches", "1", "--log.event_steps", "0",
          "--log.sample_tokens", "4", "--train.warmup_steps", "1", "--nproc", str(WORLD)]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work folder: llama/ (weights + tokenizer), text.txt, other.txt, and the full
    fine-tune's run folder runs/full."""
    cwd = tmp_path_factory.mktemp("hf")
    save_tiny("llama", cwd / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(cwd / "llama")
    text = corpus()
    (cwd / "text.txt").write_text(text)
    (cwd / "other.txt").write_text(text[::-1])
    ok(shardwise_train("--model.hf", "llama", "--data.path", "text.txt", "--name", "full",
                       "--train.steps", str(STEPS), "--checkpoint.interval", "1",
                       "--checkpoint.keep", "3", *COMMON, cwd=cwd))
    return cwd


def _reference(ws: Path, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The same model, unsharded in one process, on the same global batches."""
    from transformers import AutoModelForCausalLM

    from shardwise.train import token_cache as TC
    from shardwise.train import token_parts as P

    with contextlib.chdir(ws):  # the saved data.path is relative to where the run started
        cfg = O.build(O.read_toml(ws / "runs" / "full" / "config.toml"))
    data = TC.prepare(ws / "text.txt", ws / "llama", ws / "runs" / "token-cache")
    pieces = P.pieces(data, SEQ + 1)
    held = P.held_out(pieces, cfg.data.val_fraction, cfg.data.seed)
    train = P.Mixture([P.TokenPart(data, pieces, ~held, SEQ, packed=True)], [1.0])
    # One rank reading the global batch: the 2 ranks' slices, in rank order.
    stream = P.TokenBatchStream(train, SEQ, BATCH * WORLD, 0, 1, cfg.data.seed)
    model = AutoModelForCausalLM.from_pretrained(str(ws / "llama"), dtype=torch.float32)
    params = [p for p in model.parameters()]
    t = cfg.train
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2))
    losses = []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y, pos = stream.next()
        # The mean over every counted target of the global batch (positions restart where
        # a held-out piece was cut out of the text: token_parts.py).
        logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_hf_train_matches_an_unsharded_loop_and_exports(ws: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = ws / "runs" / "full"
    got = [r["loss"] for r in read_metrics(run / "metrics.jsonl")]
    ref_losses, ref = _reference(ws, STEPS)
    assert len(got) == STEPS
    assert all(abs(a - b) < 1e-5 for a, b in zip(got, ref_losses)), (got, ref_losses)
    # The final parameters, through `export --hf`: from_pretrained loads them, and they equal
    # the unsharded loop's.
    ok_export = shardwise("export", "runs/full", "out", "--hf", cwd=ws)
    assert ok_export.returncode == 0, ok_export.stderr
    exported = AutoModelForCausalLM.from_pretrained(str(ws / "out"), dtype=torch.float32)
    mine = dict(exported.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.allclose(mine[name], p, atol=1e-5, rtol=0), name
    tok = AutoTokenizer.from_pretrained(str(ws / "out"))
    ids = tok("def f(", return_tensors="pt").input_ids
    assert exported.generate(ids, max_new_tokens=3, do_sample=False).shape[1] > ids.shape[1]
    # Never written over.
    again = shardwise("export", "runs/full", "out", "--hf", cwd=ws)
    assert again.returncode == 2 and "already exists" in again.stderr
    gen = shardwise("generate", "out", "--prompt", "def ", "--max-new-tokens", "3", cwd=ws)
    assert gen.returncode == 0 and gen.stdout.startswith("def"), gen.stderr


def shardwise(*args: str, cwd: Path):  # noqa: ANN201 - CompletedProcess
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_lora_trains_only_adapters_from_the_base_model(ws: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ok(shardwise_train("--model.hf", "llama", "--data.path", "text.txt", "--name", "lora",
                       "--train.steps", "2", "--lora.rank", "4", "--lora.targets",
                       "q_proj,v_proj", "--train.lr", "0.01", *COMMON, cwd=ws))
    run = ws / "runs" / "lora"
    rows = read_metrics(run / "metrics.jsonl")
    # Step 1 is the base model's loss on the same batch: the adapters start as a no-op.
    full = read_metrics(ws / "runs" / "full" / "metrics.jsonl")
    assert abs(rows[0]["loss"] - full[0]["loss"]) < 1e-6
    manifest = json.loads((run / "checkpoints" / "step-0000002" / "manifest.json").read_text())
    stored = [k for k in manifest["tensors"] if k.startswith("model/")]
    assert stored and all(".lora_A." in k or ".lora_B." in k for k in stored), stored

    for kind in ("--hf", "--adapter"):
        proc = shardwise("export", "runs/lora", kind[2:], kind, cwd=ws)
        assert proc.returncode == 0, proc.stderr
    base = load_file(str(ws / "llama" / "model.safetensors"))
    merged = load_file(str(ws / "hf" / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    # The merged folder and base + peft adapter give the same logits.
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(ws / "hf"))(input_ids=x).logits
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(ws / "llama")), str(ws / "adapter"))
        b = peft_model(input_ids=x).logits
    assert torch.allclose(a, b, atol=1e-5)
    gen = shardwise("generate", "runs/lora", "--prompt", "def ", "--max-new-tokens", "3",
                    cwd=ws)
    assert gen.returncode == 0 and gen.stdout.startswith("def"), gen.stderr


def test_resume_refuses_other_data_and_resumes_from_a_chosen_step(ws: Path) -> None:
    shutil.copytree(ws / "runs" / "full", ws / "runs" / "again")
    before = sorted(p.name for p in (ws / "runs" / "again").rglob("*"))
    proc = shardwise_train("--name", "again", "--resume-from", "step-1", "--data.path",
                           "other.txt", cwd=ws)
    assert proc.returncode == 2 and "the data differs" in proc.stderr, proc.stderr
    assert "--data.reset" in proc.stderr
    assert sorted(p.name for p in (ws / "runs" / "again").rglob("*")) == before  # untouched
    # --data.reset: step 1's weights, then a fresh phase on the other data up to the run's
    # total of 3 steps (train.steps counts from the run's first step, also with a reset).
    out = ok(shardwise_train("--name", "again", "--resume-from", "step-1", "--data.path",
                             "other.txt", "--data.reset", "--train.steps", "3", "--nproc",
                             "2", cwd=ws))
    assert "resumed at step 1" in out and "step-0000002 -> step-0000002.superseded" in out
    rows = read_metrics(ws / "runs" / "again" / "metrics.jsonl")
    with contextlib.chdir(ws):
        cfg = O.build(O.read_toml(ws / "runs" / "again" / "config.toml"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The schedule restarted at the phase, spanning its 2 steps: step 2 has the phase's
    # step 1 learning rate.
    phase = dataclasses.replace(cfg.train, steps=2)
    assert math.isclose(rows[1]["lr"], lr_at(1, phase), rel_tol=1e-9)
    assert cfg.data.reset is False and cfg.data.path == str(ws / "other.txt")
