"""Bad input fails fast and clearly: ValueError naming the value (API), exit 2 (CLI).

The rows live in bad_inputs.py / bad_inputs_cli.py; docs/errors.md is generated from them.
API rows run in this process with no process group (world size 1): the checks must come
before anything distributed. A few rows run on 2 real ranks to show that every rank raises
and none is left waiting in a collective. CLI rows call `shardwise.cli.main` in-process
(fast) with the launchers disabled; one real subprocess per command proves exit status 2.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardwise as sw
from shardwise import cli
from shardwise.testing import run_distributed
from shardwise.train import options

from . import bad_inputs as B
from . import bad_inputs_dist as BD
from .bad_inputs_cli import CLI_CASES

ROOT = Path(__file__).resolve().parents[2]
API = [c for c in B.api_cases() if c.call is not None]


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in B.all_cases()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("case", API, ids=[c.id for c in API])
def test_api_rejects(case: B.Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a check that let a bad path through would write here
    before = dict(__import__("os").environ)
    with pytest.raises(ValueError) as info:
        case.call()  # type: ignore[misc]
    assert case.expect in str(info.value)
    assert not list(tmp_path.iterdir()), "a rejected call wrote files"
    assert dict(__import__("os").environ) == before, "a rejected call changed the environment"
    assert not Path(B.NO_SUCH).parent.exists()


def test_bad_timeout_env_fails_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_TIMEOUT", "soon")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="SHARDWISE_TIMEOUT='soon' is not allowed"):
        sw.init_distributed(backend="gloo")
    assert "RANK" not in __import__("os").environ


# Every parameter of the public functions has at least one row: adding a parameter
# without deciding what a bad value does fails here.
PUBLIC = [sw.shard_model, sw.fully_shard, sw.MixedPrecisionPolicy, sw.CPUOffloadPolicy,
          sw.size_policy, sw.transformer_policy, sw.init_distributed, sw.clip_grad_norm_,
          sw.full_state_dict, sw.load_full_state_dict, sw.save_checkpoint, sw.load_checkpoint,
          sw.export_safetensors, sw.save_adapter, sw.plan, sw.ShardedGradScaler, sw.no_sync,
          sw.materialize,
          sw.precision_plan]


def test_every_public_parameter_has_a_row() -> None:
    knobs = {c.knob for c in B.api_cases()}
    missing = []
    for fn in PUBLIC:
        name = fn.__name__
        for p in inspect.signature(fn).parameters:
            if p != "self" and f"{name}({p})" not in knobs:
                missing.append(f"{name}({p})")
    assert not missing, f"no bad-input row for: {missing}"


def test_every_train_option_has_a_row() -> None:
    knobs = {c.knob for c in CLI_CASES}
    missing = [k for k in options.all_keys() if f"shardwise train --{k}" not in knobs]
    assert not missing, f"no bad-input row for: {missing}"


class _Parsed(Exception):
    def __init__(self, parser: Any) -> None:
        self.parser = parser


@pytest.mark.parametrize("cmd", ["plan", "bench", "explore", "export", "demo"])
def test_every_cli_option_has_a_row(cmd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.commands import _args

    def grab(self: Any, *a: Any, **k: Any) -> None:
        raise _Parsed(self)

    monkeypatch.setattr(_args.Parser, "parse_args", grab)
    module = __import__(f"shardwise.commands.{cmd}", fromlist=["main"])
    with pytest.raises(_Parsed) as got:
        module.main([])
    text = " ".join(" ".join(c.argv) + " " + c.knob for c in CLI_CASES if c.argv[:1] == (cmd,))
    missing = []
    for action in got.value.parser._actions:
        names = action.option_strings or [action.dest.upper()]
        if "--help" in names:
            continue
        if not any(n in text for n in names):
            missing.append(names[0])
    assert not missing, f"shardwise {cmd}: no bad-input row for {missing}"


def _no_launch(*a: Any, **k: Any) -> None:
    raise AssertionError("a bad option got as far as starting the job")


def run_cli(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str],
            monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    import uvicorn

    import shardwise.launch

    # A check that let the value through must not start ranks or a server in the test.
    monkeypatch.setattr(shardwise.launch, "launch", _no_launch)
    monkeypatch.setattr(uvicorn, "Config", _no_launch)
    for var in ("RANK", "WORLD_SIZE"):  # not "under torchrun", whatever ran before
        monkeypatch.delenv(var, raising=False)
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _prog(argv: tuple[str, ...]) -> str:
    return f"shardwise {argv[0]}" if argv[0] in cli.COMMANDS else "shardwise"


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_rejects(case: B.Case, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = run_cli(case.argv, capsys, monkeypatch)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{_prog(case.argv)}: error: "), err
    assert case.expect in lines[0], err


# One real process per command: the status and the stderr line a shell sees.
SUBPROCESS = [("train", "--train.lr", "inf"), ("plan", "--params", "1e9", "--world-size", "0"),
              ("bench", "--nproc", "0"), ("explore", "--port", "70000"),
              ("export", B.NO_SUCH, "out"), ("demo", "--steps", "0"), ("fit",)]


@pytest.fixture(scope="module")
def subprocess_results() -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    procs = {argv: subprocess.Popen([sys.executable, "-m", "shardwise.cli", *argv], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in SUBPROCESS}
    out = {}
    for argv, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[argv] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("argv", SUBPROCESS, ids=[a[0] for a in SUBPROCESS])
def test_cli_subprocess_exit_2(argv: tuple[str, ...],
                               subprocess_results: dict[tuple[str, ...], Any]) -> None:
    r = subprocess_results[argv]
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{_prog(argv)}: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_two_ranks_all_raise_before_any_collective(tmp_path: Path) -> None:
    results = run_distributed(BD.dist_worker, 2, str(tmp_path), timeout_s=120,
                              collective_timeout_s=30)
    for rank, got in enumerate(results):
        assert [name for name, _, _ in got] == list(BD.DIST_EXPECT), rank
        for name, kind, msg in got:
            assert kind == "ValueError" and BD.DIST_EXPECT[name] in msg, (rank, name, kind, msg)


def test_docs_table_matches_the_cases() -> None:
    doc = (ROOT / "docs" / "errors.md").read_text()
    table = B.markdown(B.all_cases())
    assert table in doc, ("docs/errors.md is out of date: regenerate the table with "
                          "`python -m tests.unit.bad_inputs --markdown`")
