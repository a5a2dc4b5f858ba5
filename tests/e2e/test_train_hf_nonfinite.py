"""Issue 37: `shardwise train --model.hf` on a folder whose weights hold NaN (1000 bytes of
0xff in the data region) stopped at step 1 with "non-finite loss ... set
train.on_nonfinite=skip", blaming training and leaving a run folder behind. It now stops at
load with one line naming the file, the key and the count, and leaves no run folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.test_pretrained import _corrupt
from tests.e2e.test_train import shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, corpus, save_tokenizer

pytest.importorskip("peft")


ARGS = ["--model.hf", "llama", "--data.path", "text.txt", "--name", "nan",
        "--train.steps", "2", "--model.block_size", "16", "--train.batch_size", "2",
        "--train.eval_interval", "0"]


def _nan_folder(tmp_path: Path) -> Path:
    save_tiny("llama", tmp_path / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(tmp_path / "llama")
    (tmp_path / "text.txt").write_text(corpus())
    weights = tmp_path / "llama" / "model.safetensors"
    _corrupt(weights, "model.layers.0.mlp.down_proj.weight", 0, 1000)
    return weights


def test_nan_weights_stop_at_load_naming_the_tensor(tmp_path: Path) -> None:
    weights = _nan_folder(tmp_path)
    out = shardwise_train(*ARGS, "--nproc", "2", cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    assert (f"{weights}: model.layers.0.mlp.down_proj.weight has 250 NaN/inf values"
            in errors[0]), errors
    assert "on_nonfinite" not in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs" / "nan").exists(), "a run folder was left behind"


def test_under_torchrun_too_no_run_folder_is_left(tmp_path: Path) -> None:
    """The same under torchrun (and srun), where the command runs on its rank: the run
    folder rank 0 created before loading is removed again."""
    weights = _nan_folder(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "shardwise.cli", "train", *ARGS], cwd=tmp_path, text=True,
        capture_output=True, timeout=600)
    assert out.returncode != 0, (out.stdout, out.stderr)
    assert (f"{weights}: model.layers.0.mlp.down_proj.weight has 250 NaN/inf values"
            in out.stderr), out.stderr
    assert not (tmp_path / "runs" / "nan").exists(), "a run folder was left behind"
