"""`shardwise train --model.hf` and `export --hf` options end to end, on a tiny Llama saved
with save_pretrained and a BPE tokenizer trained here (nothing downloaded): export sharding
and --force, relative paths and --resume from elsewhere, epochs, the fine-tuning defaults.
Two training launches build the module's runs (a full fine-tune and a LoRA one, 1 rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train import ok, shardwise_train
from tests.e2e.test_train_hf import shardwise
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, corpus, save_tokenizer

pytest.importorskip("peft")

SEQ = 16
COMMON = ["--model.block_size", str(SEQ), "--train.batch_size", "2", "--train.eval_interval",
          "0", "--train.eval_batches", "1", "--log.event_steps", "0", "--log.sample_tokens",
          "0", "--nproc", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama/ (weights + tokenizer), text.txt, and two runs started from this folder with
    relative paths: runs/full (2 steps) and runs/lora (q_proj, v_proj; 1 step)."""
    cwd = tmp_path_factory.mktemp("hfopt")
    save_tiny("llama", cwd / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(cwd / "llama")
    (cwd / "text.txt").write_text(corpus())
    ok(shardwise_train("--model.hf", "llama", "--data.path", "text.txt", "--name", "full",
                       "--train.steps", "2", *COMMON, cwd=cwd))
    ok(shardwise_train("--model.hf", "llama", "--data.path", "text.txt", "--name", "lora",
                       "--train.steps", "1", "--lora.rank", "4", "--lora.targets",
                       "q_proj,v_proj", *COMMON, cwd=cwd))
    return cwd


def _params(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("run", ["full", "lora"])
def test_export_hf_splits_at_max_shard_size(ws: Path, run: str) -> None:
    one, split = f"{run}-one", f"{run}-split"
    for out, extra in ((one, []), (split, ["--max-shard-size", "4KB"])):
        proc = shardwise("export", f"runs/{run}", out, "--hf", *extra, cwd=ws)
        assert proc.returncode == 0, proc.stderr
    shards = sorted(p.name for p in (ws / split).glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (ws / split / "model.safetensors").exists(), shards
    index = json.loads((ws / split / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    # Each file within the limit (plus its header), or one tensor larger than the limit alone.
    per_file = {s: [k for k, f in index["weight_map"].items() if f == s] for s in shards}
    assert all((ws / split / s).stat().st_size <= 4000 + 1024 or len(per_file[s]) == 1
               for s in shards), per_file
    a, b = _params(ws / one), _params(ws / split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_hf_force_replaces_the_export_and_keeps_other_files(ws: Path) -> None:
    out = ws / "forced"
    ok_first = shardwise("export", "runs/full", "forced", "--hf", "--max-shard-size", "4KB",
                         cwd=ws)
    assert ok_first.returncode == 0, ok_first.stderr
    before = _params(out)
    (out / "notes.txt").write_text("mine")
    refused = shardwise("export", "runs/full", "forced", "--hf", cwd=ws)
    assert refused.returncode == 2 and "--force" in refused.stderr, refused.stderr
    again = shardwise("export", "runs/full", "forced", "--hf", "--force", cwd=ws)
    assert again.returncode == 0, again.stderr
    # One file now: the earlier shards and index are gone (they would make the folder
    # ambiguous), the user's own file is kept.
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    after = _params(out)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)


def test_export_adapter_refuses_max_shard_size(ws: Path) -> None:
    proc = shardwise("export", "runs/lora", "ad", "--adapter", "--max-shard-size", "4KB", cwd=ws)
    assert proc.returncode == 2 and "--max-shard-size does not apply" in proc.stderr
    assert not (ws / "ad").exists()


def test_resume_works_from_another_directory(ws: Path) -> None:
    """The run started in ws/ with relative paths (llama, text.txt); its config.toml holds
    them absolute, so a resume from elsewhere reads the same model and data."""
    from shardwise.train import options as O

    saved = O.read_toml(ws / "runs" / "full" / "config.toml")
    assert saved["model.hf"] == str(ws / "llama") and saved["data.path"] == str(ws / "text.txt")
    elsewhere = ws / "elsewhere"
    elsewhere.mkdir()
    out = ok(shardwise_train("--out_dir", str(ws / "runs"), "--name", "full", "--resume",
                             "--train.steps", "3", "--nproc", "1", "--threads", "1",
                             cwd=elsewhere))
    assert "resumed at step 2" in out, out
    assert not (elsewhere / "runs").exists()  # the token cache stayed where it was


def test_default_fine_tune_is_one_epoch_and_says_so(ws: Path) -> None:
    from shardwise.train import options as O
    from shardwise.train.metrics import read_metrics

    (ws / "small.txt").write_text(corpus()[:6000])
    out = ok(shardwise_train("--model.hf", "llama", "--data.path", "small.txt", "--name",
                             "epoch", *COMMON, cwd=ws))
    rows = read_metrics(ws / "runs" / "epoch" / "metrics.jsonl")
    assert len(rows) > 3 and f"done: step {len(rows)} " in out, out
    assert "1.00 epochs of the training data" in out, out
    t = O.build(O.read_toml(ws / "runs" / "epoch" / "config.toml")).train
    assert (t.lr, t.weight_decay, t.epochs, t.steps) == (2e-5, 0.0, 1.0, 0)
    # Warm-up is 3% of the run, then the decay: the peak is lr, reached at step 1.
    assert max(r["lr"] for r in rows) == pytest.approx(2e-5)
