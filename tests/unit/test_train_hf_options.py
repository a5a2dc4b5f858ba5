"""`shardwise train --model.hf` options in one process: LoRA targets, options that do not
apply to a Hugging Face run, the fine-tuning defaults, relative paths, the `hf` extra."""

from __future__ import annotations

import pytest

from shardwise.train import options as O
from tests.hf_models import save_tiny

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny("llama", tmp_path_factory.mktemp("hfopt") / "llama")


def _lora(llama: str, targets: str):  # noqa: ANN202 - a Config
    return O.build({"model.hf": llama, "data.path": llama, "lora.rank": 2,
                    "lora.targets": targets})


def test_a_lora_target_that_matches_nothing_is_refused_by_name(llama: str) -> None:
    from shardwise.train.hf_model import _meta_model

    # peft alone adapts q_proj and drops `nonexistent` without a word.
    with pytest.raises(ValueError) as e:
        _meta_model(_lora(llama, "q_proj,nonexistent"))
    msg = str(e.value)
    assert "'nonexistent' matches no module" in msg and "q_proj" not in msg.split(":")[1]
    for layer in ("q_proj", "v_proj", "gate_proj", "lm_head"):
        assert layer in msg.split("adaptable layers are:")[1], msg


def test_lora_targets_match_a_tail_or_a_full_name(llama: str) -> None:
    from shardwise.train.hf_model import _meta_model

    model = _meta_model(_lora(llama, "self_attn.q_proj,v_proj"))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_modules()
               if n.endswith("lora_A")}
    assert adapted == {"q_proj", "v_proj"}


def test_data_max_bytes_is_refused_with_model_hf(llama: str, tmp_path) -> None:
    from shardwise.commands.train import load_config

    argv = ["--model.hf", llama, "--data.path", llama, "--out_dir", str(tmp_path)]
    assert load_config(argv).model.hf == llama  # without it: fine
    # It used to be accepted and ignored: the HF path tokenizes all of data.path.
    with pytest.raises(ValueError, match=r"data.max_bytes=.1000.* does not apply with model.hf"):
        load_config([*argv, "--data.max_bytes", "1000"])
    data_help = O.help_text().split("[data] ")[1].splitlines()[0]
    assert "model.hf" in data_help, data_help


def test_model_hf_takes_fine_tuning_defaults_and_explicit_values_win(llama: str) -> None:
    base = {"model.hf": llama, "data.path": llama}
    t = O.build(base).train
    assert (t.lr, t.weight_decay, t.beta2) == (2e-5, 0.0, 0.999)
    assert (t.steps, t.epochs, t.warmup_steps, t.warmup_ratio) == (0, 1.0, 0, 0.03)
    assert O.build(base).log.sample_prompt == ""
    assert O.build({**base, "lora.rank": "4"}).train.lr == 2e-4
    mine = O.build({**base, "train.lr": "1e-3", "train.steps": "50", "train.weight_decay": "0.1",
                    "train.warmup_steps": "5"}).train
    assert (mine.lr, mine.steps, mine.epochs, mine.weight_decay) == (1e-3, 50, 0.0, 0.1)
    assert (mine.warmup_steps, mine.warmup_ratio) == (5, 0.0)
    gpt = O.build({}).train  # the built-in GPT keeps its pretraining defaults
    assert (gpt.lr, gpt.steps, gpt.epochs, gpt.weight_decay) == (3e-3, 1000, 0.0, 0.1)
    # Evaluation: a fine-tune covers its whole eval set; `make run`'s GPT samples 8 batches
    # per rank (its 3,125 held-out sequences every 100 steps made the run 26-30% slower).
    assert (t.eval_batches, gpt.eval_batches) == (0, 8)
    assert O.build({**base, "train.eval_batches": "3"}).train.eval_batches == 3
    assert O.build({"train.eval_batches": "0"}).train.eval_batches == 0
    assert O.build({"train.epochs": "2"}).train.steps == 0
    with pytest.raises(ValueError, match="give one of them"):
        O.build({"train.epochs": "2", "train.steps": "10"})


def test_a_resume_that_gives_the_other_length_drops_the_saved_one(llama: str) -> None:
    from shardwise.train.finetune import resumed_values

    saved = O.to_flat(O.build({"model.hf": llama, "data.path": llama}))
    cfg = O.build({**resumed_values(saved, {"train.steps": "7"}), "train.steps": "7"})
    assert (cfg.train.steps, cfg.train.epochs) == (7, 0.0)


def test_relative_paths_are_stored_absolute(llama: str, tmp_path, monkeypatch) -> None:
    import shutil

    shutil.copytree(llama, tmp_path / "m")
    (tmp_path / "d.txt").write_text("hello")
    monkeypatch.chdir(tmp_path)
    cfg = O.build({"model.hf": "m", "data.path": "d.txt", "data.cache_dir": "cache"})
    assert cfg.model.hf == str(tmp_path / "m") and cfg.data.path == str(tmp_path / "d.txt")
    assert cfg.data.cache_dir == str(tmp_path / "cache")
    assert f'path = "{tmp_path / "d.txt"}"' in O.dumps_toml(cfg)


def test_without_transformers_the_user_gets_one_line_with_the_install_command(
        llama: str, tmp_path) -> None:
    import os
    import subprocess
    import sys

    # A sitecustomize on PYTHONPATH blocks the imports in this process and any it starts.
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\nsys.modules['transformers'] = None\nsys.modules['peft'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(block), *filter(None, [os.environ.get("PYTHONPATH")])])}
    (tmp_path / "d.txt").write_text("hello world " * 200)
    for args in (["train", "--model.hf", llama, "--data.path", "d.txt", "--nproc", "1",
                  "--train.steps", "1"],
                 ["generate", llama, "--prompt", "hi"]):
        proc = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
        assert len(errors) == 1 and "pip install 'shardwise[hf]'" in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
