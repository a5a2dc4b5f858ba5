"""What the CLI's error lines say, beyond the bad-input table (issue 25's CLI items)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.commands._args import report
from tests.unit.test_bad_input import run_cli


def test_top_level_keys_have_no_stray_dot(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = run_cli(("train", "--nproc", "-1"), capsys, monkeypatch)
    assert code == 2 and "error: nproc=-1 must be >= 0" in err, err


def test_tp_suggestions_pass_every_check(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 ranks of a 4-head model: 3 divides the world but not the heads, so only 1 is allowed.
    code, err = run_cli(("train", "--nproc", "3", "--parallel.tp", "2"), capsys, monkeypatch)
    assert code == 2 and "allowed here: [1]" in err and "[1, 3]" not in err, err


def test_help_pointer_only_for_what_was_typed(capsys: pytest.CaptureFixture[str]) -> None:
    report("shardwise train", ValueError("train.lr=inf is not allowed"))
    report("shardwise train", CheckpointError("step-0000020/shard-00000.safetensors: checksum"))
    report("shardwise export", "bad option")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("(see `shardwise train --help`)")
    assert "--help" not in lines[1], lines[1]
    assert lines[2].endswith("(see `shardwise export --help`)")


def test_export_of_a_run_without_checkpoints_says_so(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "runs" / "early"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("")
    code, err = run_cli(("export", str(run), str(tmp_path / "out")), capsys, monkeypatch)
    assert code == 2 and "no checkpoint yet" in err and "manifest.json" not in err, err
    assert not (tmp_path / "out").exists()


def test_cpu_offload_without_a_gpu_says_it_does_nothing() -> None:
    from shardwise.commands.train import load_config, offload_note

    cfg = load_config(["--shard.cpu_offload", "true"])
    assert "no effect without a GPU" in (offload_note(cfg, cuda=False) or "")
    assert offload_note(cfg, cuda=True) is None
    assert offload_note(load_config([]), cuda=False) is None


def _run_folder(tmp_path: Path, saved_steps: int, with_ckpt: bool) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(f"name = \"r\"\n[train]\nsteps = {saved_steps}\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    if with_ckpt:
        ckpt = run / "checkpoints" / "step-0000010"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text("{}")
    return run


def test_interrupted_resume_keeps_the_new_step_count(tmp_path: Path) -> None:
    from shardwise.commands.train import load_config, stopped_line

    run = _run_folder(tmp_path, saved_steps=10, with_ckpt=True)
    cfg = dataclasses.replace(load_config(["--name", "new", "--out_dir", str(run.parent),
                                           "--train.steps", "20"]), name="r")
    line = stopped_line(cfg, run)
    # The saved config still says 10 steps: `--resume` alone would leave nothing to do.
    assert line.endswith("--name r --resume --train.steps 20`"), line


def test_make_run_is_told_the_real_command(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.commands.train import load_config, stopped_line

    run = _run_folder(tmp_path, saved_steps=10, with_ckpt=False)
    cfg = dataclasses.replace(load_config(["--name", "new", "--out_dir", str(run.parent)]),
                              name="r")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MAKELEVEL", "1")
    monkeypatch.setattr("sys.argv", [str(tmp_path / ".venv" / "bin" / "shardwise"), "train"])
    line = stopped_line(cfg, run, [])
    # `make run` takes no options: name the venv's own command.
    assert "`.venv/bin/shardwise train --overwrite`" in line, line
    assert "make" not in line
