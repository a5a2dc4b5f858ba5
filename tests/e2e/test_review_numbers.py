"""Review: the numbers `shardwise train`, `export` and `generate` show, each held against a
count written out here, independently of the code that prints it.

- metrics.jsonl of a 2-rank FULL_SHARD run with grad_accum 2: bytes sent per step from the
  model's own parameter shapes and the ring formula, the learning rate of every step; the
  event log (`explore --replay`) the same bytes, without the validation pass's gathers;
- the console's tokens/s: the first step (lazy initialization, left out of the summary)
  no longer drags the smoothed rate of the steps after it; with --parallel.tp the summary's
  bytes say they leave tensor parallelism's collectives out (at dp 1 they read "0 B");
- a LoRA run's "training state": frozen base weights have no gradient and no AdamW state
  (it printed 16 bytes for every parameter: about 4x what the run holds);
- `export --hf` then `generate --temperature 0`: the tokens of Hugging Face's greedy
  `generate` on the exported folder (the flags were parsed and dropped, so it sampled at 0.8),
  stopping where `generate` stops (every end id of the generation config).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.commands.train_console import ConsoleReporter
from shardwise.explorer.replay import load_run
from shardwise.train.metrics import read_metrics
from shardwise.train.model import GPT, preset
from tests.e2e.test_train import ok, shardwise_train
from tests.e2e.test_train_hf import shardwise
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, corpus, save_tokenizer

MiB = 2**20


def expected_bytes_per_step(world: int, grad_accum: int) -> int:
    """FULL_SHARD, transformer wrap, fp32: per micro-batch the root is gathered once (it
    stays gathered from forward to backward) and each block twice; one reduce-scatter per
    unit per step, whose buffer row holds the padded gradients and one flag per parameter.
    A rank sends (S-1)/S of each buffer."""
    model = GPT(preset("tiny"))
    units: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        units.setdefault(key, []).append(p)
    sent = 0
    for key, params in units.items():
        padded = sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in params)
        gathers = grad_accum * (1 if key == "" else 2)
        sent += gathers * (world - 1) * (world * padded * 4) // world
        sent += (world - 1) * (world * (padded + len(params)) * 4) // world
    return sent


def test_metrics_bytes_and_lr_of_a_grad_accum_run(tmp_path: Path) -> None:
    out = ok(shardwise_train(
        "--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "1",
        "--train.grad_accum", "2", "--train.steps", "3", "--train.warmup_steps", "1",
        "--train.eval_interval", "2", "--train.eval_batches", "1", "--log.sample_tokens", "4",
        "--log.event_steps", "3", "--name", "ga", "--nproc", "2", cwd=tmp_path))
    rows = read_metrics(tmp_path / "runs" / "ga" / "metrics.jsonl")
    want = expected_bytes_per_step(2, 2)
    assert [r["comm_bytes"] for r in rows] == [want] * 3
    # The event log (the explorer's --replay) holds the same steps: step 2's validation
    # gathers are not step 2's (its replay showed 1.21x the step's bytes).
    summary = load_run(tmp_path / "runs" / "ga").summary()
    assert [[r["bytes"] for r in s["ranks"]] for s in summary["per_step"]] == [[want] * 2] * 3
    # lr 3e-3, warm-up 1 step, cosine to 0.1 x lr at step 3.
    lrs = [3e-3, 3e-4 + 0.5 * 2.7e-3 * (1 + math.cos(math.pi * 0.5)), 3e-4]
    assert all(math.isclose(r["lr"], lr, rel_tol=1e-12) for r, lr in zip(rows, lrs))
    assert "256 tokens per step" in out  # 1 sequence x 64 tokens x 2 micro-batches x 2 ranks
    assert f"{want / MiB:.2f} MiB / {want / MiB:.2f} MiB sent per step" in out


def _console(tp: int = 1) -> ConsoleReporter:
    from shardwise.train.config import Config, ParallelSection

    rep = ConsoleReporter()
    rep.start({"config": Config(parallel=ParallelSection(tp=tp)), "world": 2, "device": "cpu",
               "threads": 1, "params": 1, "local_params": 1, "train_bytes": 1, "val_bytes": 1,
               "tokens_per_step": 1, "start_step": 0, "steps": 4, "run_dir": "x"})
    return rep


def test_console_rate_is_not_seeded_by_the_first_step(capsys: pytest.CaptureFixture[str]) -> None:
    rep = _console()
    for step, rate in enumerate([100.0, 1000.0, 1000.0, 1000.0], start=1):
        rep.step({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                  "tokens_per_s": rate, "memory_mb": [1.0], "time_s": float(step)})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert "| 100 tok/s" in lines[0]
    assert all("| 1,000 tok/s" in ln for ln in lines[1:]), lines  # was 280, 424, 539


def test_tp_summary_says_its_bytes_leave_tp_out(capsys: pytest.CaptureFixture[str]) -> None:
    """At dp 1 x tp 2 the engine moves nothing (one shard rank): "0 B" alone read as a run
    without communication, while every block all-reduces its activations."""
    summary = {"peak_memory_mb": [1.0, 1.0], "state_mb": [0.5, 0.5], "unsharded_state_mb": 1.0,
               "steps": 3, "start_step": 0, "wall_s": 1.0, "world": 2, "final_loss": 1.0,
               "final_loss_avg10": 1.0, "final_val_loss": 1.0, "tokens_per_s": 1.0,
               "device": "cpu", "bytes_per_step": [0, 0], "bytes_per_step_rank0": {},
               "run_dir": "x", "sample": ""}
    for tp in (1, 2):
        _console(tp).end(summary)
        out = capsys.readouterr().out
        assert ("tensor parallelism's (tp=2) are not counted" in out) == (tp == 2), out


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-rank LoRA run of a tiny Llama (weights + tokenizer saved here), then its merged
    export: (work folder, the run's console)."""
    pytest.importorskip("peft")
    ws = tmp_path_factory.mktemp("review_numbers")
    save_tiny("llama", ws / "llama", vocab_size=VOCAB_SIZE, hidden_size=128,
              intermediate_size=256, max_position_embeddings=64)
    save_tokenizer(ws / "llama")
    (ws / "text.txt").write_text(corpus())
    out = ok(shardwise_train(
        "--model.hf", "llama", "--data.path", "text.txt", "--name", "lora", "--lora.rank", "4",
        "--lora.targets", "q_proj,v_proj", "--train.lr", "0.01", "--train.steps", "2",
        "--model.block_size", "16", "--train.batch_size", "2", "--train.eval_interval", "0",
        "--train.eval_batches", "1", "--log.event_steps", "0", "--log.sample_tokens", "4",
        "--train.warmup_steps", "1", "--nproc", "2", cwd=ws))
    exported = shardwise("export", "runs/lora", "out", "--hf", cwd=ws)
    assert exported.returncode == 0, exported.stderr
    return ws, out


def test_lora_training_state_counts_only_trainable_grads_and_moments(
        lora: tuple[Path, str]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ws, out = lora
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ws / "llama"))
    n_base = sum(p.numel() for p in base.parameters())
    # q_proj 128 -> 128 and v_proj 128 -> 64 (2 kv heads x 32) per layer: A r x in, B out x r.
    trainable = 2 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4)
    assert f"{trainable:,} trainable parameters" in out
    unsharded = 4 * (n_base + trainable) + 12 * trainable  # fp32: weights; grad + 2 moments
    line = next(ln for ln in out.splitlines() if "training state" in ln)
    per_rank = [float(v) for v in re.search(r"state\s+([\d./]+) MiB", line).group(1).split("/")]
    assert f"unsharded {unsharded / MiB:.1f} MiB" in line, line  # was 16 B x every parameter
    assert all(abs(v - unsharded / 2 / MiB) <= 0.06 for v in per_rank), line


def _hf_greedy(folder: Path, prompt: str, n: int) -> tuple[str, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                 dtype=torch.float32).eval()
    enc = tok(prompt, return_tensors="pt")
    ids = model.generate(**enc, max_new_tokens=n, do_sample=False)[0]
    new = ids[enc.input_ids.shape[1]:].tolist()
    return tok.decode(ids, skip_special_tokens=True), new


def _generate(ws: Path, path: str, prompt: str, n: int) -> str:
    proc = shardwise("generate", path, "--prompt", prompt, "--max-new-tokens", str(n),
                     "--temperature", "0", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout[:-1]  # print's newline


def test_generate_greedy_equals_hf_generate_on_the_export(lora: tuple[Path, str]) -> None:
    ws, _ = lora
    prompt, n = "def parse(", 12
    want, new = _hf_greedy(ws / "out", prompt, n)
    assert len(new) == n  # no end id met: all 12 tokens compared
    assert _generate(ws, "out", prompt, n) == want
    assert _generate(ws, "runs/lora", prompt, n) == want  # exported on the fly

    # Stop where generate stops: the generation config's end ids, here two (as Llama 3's).
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(ws / "out").eos_token_id
    stop = next(t for t in new[2:] if t != eos)
    shutil.copytree(ws / "out", ws / "out2")
    gc = json.loads((ws / "out2" / "generation_config.json").read_text())
    (ws / "out2" / "generation_config.json").write_text(
        json.dumps({**gc, "eos_token_id": [eos, stop]}))
    want2, new2 = _hf_greedy(ws / "out2", prompt, n)
    assert new2[-1] == stop and len(new2) < n
    assert _generate(ws, "out2", prompt, n) == want2
