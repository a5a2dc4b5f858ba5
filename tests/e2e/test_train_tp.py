"""`shardwise train --parallel.tp N` against a single-process reference of the same loop.

dp 1 x tp 2 keeps the global batch of a one-process run, so the reference is the trainer's
own pieces (data stream, optimizer groups, schedule, clipping) on an unsharded GPT that
starts from the same weights (a TP run builds the model whole with the run's seed). The run
then resumes at 1 rank without TP (the checkpoint resharded across both dimensions) and
must continue on the reference's curve.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from shardwise.train import data as D
from shardwise.train import options as O
from shardwise.train.metrics import read_metrics
from shardwise.train.model import GPT
from shardwise.train.trainer import _optimizer, lr_at
from tests.e2e.test_train import ok, shardwise_train

ARGS = ["--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "2",
        "--train.eval_interval", "0", "--train.eval_batches", "1",
        "--checkpoint.interval", "3", "--log.sample_tokens", "0", "--log.event_steps", "0"]
TOL = 1e-5  # relative (measured: identical to the last bit at dp 1 x tp 2 on CPU)


def reference_losses(steps: int) -> list[float]:
    """The trainer's step on one process, unsharded: the losses of steps 1..`steps`."""
    cfg = O.build(O.parse_argv(ARGS + ["--train.steps", str(steps)])[0])
    t = cfg.train
    torch.manual_seed(t.seed)
    model = GPT(cfg.model.gpt())
    opt = _optimizer(model, t)
    seq = model.cfg.block_size
    text = D.read_corpus(None, cfg.data.max_bytes, cfg.data.seed)
    parts = D.split(text, cfg.data.val_fraction, seq)
    stream = D.BatchStream(parts.train, seq, t.batch_size, 0, 1, cfg.data.seed)
    out = []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = stream.next()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_train_tp_parity_and_resume_without_tp(tmp_path: Path) -> None:
    out = ok(shardwise_train("--name", "tp", "--nproc", "2", "--parallel.tp", "2",
                             "--train.steps", "3", *ARGS, cwd=tmp_path))
    assert "tp=2 (dp=1)" in out, out
    run = tmp_path / "runs" / "tp"
    ok(shardwise_train("--name", "tp", "--resume", "--nproc", "1", "--parallel.tp", "1",
                       "--train.steps", "6",
                       *ARGS, cwd=tmp_path))
    got = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    ref = reference_losses(6)
    assert sorted(got) == list(range(1, 7)), sorted(got)
    for step, want in enumerate(ref, 1):
        assert math.isclose(got[step], want, rel_tol=TOL), (step, got[step], want)
