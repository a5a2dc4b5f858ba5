"""What of `make gpu-check` and `shardwise bench --device cuda` can be checked without a GPU:
the bounds, the plan, the summary, the bad inputs, and the driver end to end with stand-ins
for the GPU-only parts (a fake nvidia-smi, a probe that reports CUDA)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardwise.bench.runner import BenchConfig
from shardwise.commands import bench as B
from tests.gpu import check as G

ROOT = Path(__file__).resolve().parents[2]
CUDA_INFO = {"torch": "2.13.0+cu130", "cuda": True, "gpus": 1, "name": "Stand-in GPU",
             "pytest": True, "pytest_timeout": True}


def _make(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **({"PATH": path} if path is not None else {}))
    return subprocess.run(["make", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=60)


def test_make_gpu_check_bounds_setup_and_checks() -> None:
    r = _make("-n", "gpu-check")
    assert r.returncode == 0, r.stderr
    text = r.stdout.replace("\\\n", " ")
    setup = re.search(r"timeout -k 10 (\d+) \S+ tests/gpu/check.py setup --venv \.venv-gpu", text)
    run = re.search(r"timeout -k 10 (\d+) \S+ tests/gpu/check.py run --venv \.venv-gpu "
                    r"\s*--budget-s \$\(\( (\d+) - 20 \)\)", text)
    assert setup and run, text
    # The checks (everything after the one-off setup) end within 8 minutes.
    assert int(run.group(1)) + 10 <= 480 and int(run.group(2)) == int(run.group(1))


def test_make_gpu_check_without_a_gpu_runs_nothing() -> None:
    # PATH without nvidia-smi (this machine has none anyway; made explicit here).
    r = _make("gpu-check", path="/usr/bin:/bin")
    assert r.returncode == 2
    assert "no nvidia-smi on PATH, so no NVIDIA GPU here: nothing was checked" in r.stdout
    assert "check.py" not in r.stdout  # neither stage started


def test_plan_keeps_both_stages_inside_the_budget(tmp_path: Path) -> None:
    stages = G.plan("py", CUDA_INFO, tmp_path, budget_s=450)
    assert [s.name for s in stages] == ["tests", "bench"]
    assert sum(s.timeout_s + 10 for s in stages) <= 450 + 10  # `timeout -k 10` each
    tests, bench = stages
    assert tests.argv[:5] == ["py", "-m", "pytest", "-q", "-rs"] and "tests/gpu" in tests.argv
    assert f"--timeout={G.CASE_S}" in tests.argv
    assert f"--junitxml={tmp_path / 'tests.xml'}" in tests.argv
    i = bench.argv.index("--device")
    assert bench.argv[i + 1] == "cuda"
    assert bench.argv[bench.argv.index("--systems") + 1] == "shardwise FULL_SHARD,torch FSDP2"
    assert bench.argv[bench.argv.index("--json") + 1] == str(tmp_path / "bench.json")
    # Without pytest-timeout the per-test bound is run_distributed's own (no unknown flag).
    no_plugin = G.plan("py", dict(CUDA_INFO, pytest_timeout=False), tmp_path)[0]
    assert not any(a.startswith("--timeout") for a in no_plugin.argv)


def _stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tests_body: str,
               bench_rows: dict | None) -> tuple[Path, Path]:
    """A fake nvidia-smi, a recorded interpreter, and stages that run quickly on a CPU."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    venv, out = tmp_path / "venv", tmp_path / "out"
    venv.mkdir()
    (venv / "checks-python").write_text(json.dumps({"python": sys.executable, "note": ""}))
    monkeypatch.setattr(G, "probe", lambda python: CUDA_INFO)
    test_file = tmp_path / "test_standin.py"
    test_file.write_text(textwrap.dedent(tests_body))
    bench_json = {"world_size": 1, "systems": bench_rows or {}}
    write = f"import json, pathlib; pathlib.Path({str(out / 'bench.json')!r}).write_text(" \
            f"json.dumps({bench_json!r}))"

    def plan(python: str, info: dict, out_dir: Path, budget_s: int = 450) -> list[G.Stage]:
        return [G.Stage("tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  str(test_file), f"--junitxml={out_dir / 'tests.xml'}"], 60),
                G.Stage("bench", [python, "-c", write if bench_rows else "pass"], 60)]

    monkeypatch.setattr(G, "plan", plan)
    return venv, out


ROWS = {"shardwise FULL_SHARD": {"median_step_s": 0.010},
        "torch FSDP2": {"median_step_s": 0.0125}}


def test_run_summarizes_tests_and_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    venv, out = _stand_ins(tmp_path, monkeypatch, """
        import pytest
        def test_ok(): pass
        @pytest.mark.skip(reason="needs 2 GPUs")
        def test_two(): pass
    """, ROWS)
    assert G.run(venv, out, 450) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tests"] == {"ran": True, "total": 2, "failed": [], "skipped": 1,
                                "passed": 1}
    assert summary["exit"] == {"tests": 0, "bench": 0}
    assert summary["bench"] == ("bench (world 1): shardwise FULL_SHARD 10.00 ms, torch FSDP2 "
                                "12.50 ms; FULL_SHARD / FSDP2 = 0.80")
    printed = capsys.readouterr().out
    assert "tests/gpu: 1 passed, 0 failed, 1 skipped" in printed
    assert {p.name for p in out.iterdir()} == {"tests.log", "tests.xml", "bench.log",
                                               "bench.json", "summary.json"}


def test_run_fails_on_a_failed_test_or_a_missing_bench(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    venv, out = _stand_ins(tmp_path, monkeypatch, """
        def test_parity(): assert 1e-3 < 1e-4
    """, None)
    assert G.run(venv, out, 450) == 1
    printed = capsys.readouterr().out
    assert "0 passed, 1 failed" in printed
    assert re.search(r"FAILED \S*test_standin::test_parity", printed), printed
    assert "bench: no result" in printed


def test_a_stage_past_its_bound_is_killed(tmp_path: Path) -> None:
    stage = G.Stage("tests", [sys.executable, "-c", "import time; time.sleep(30)"], 1)
    assert G.run_stage(stage, tmp_path / "log") == 124  # `timeout`'s status


def test_setup_falls_back_to_python3s_own_cuda_torch(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # No network: the venv gets no torch; python3 (here: this interpreter) has a CUDA one.
    ran: list[list[str]] = []
    monkeypatch.setattr(G, "_run", lambda argv, lines: ran.append(argv))
    monkeypatch.setattr(G, "probe",
                        lambda python: CUDA_INFO if python == sys.executable else None)
    venv = tmp_path / "venv"
    assert G.setup(venv, tmp_path / "setup.log") == 0
    assert ran[0][1:4] == ["-m", "venv", "--system-site-packages"]
    chosen = json.loads((venv / "checks-python").read_text())
    assert chosen["python"] == sys.executable
    assert f"torch=={G.TORCH} could not be installed" in chosen["note"]


def test_setup_refuses_without_any_cuda_torch(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "_run", lambda argv, lines: None)
    monkeypatch.setattr(G, "probe", lambda python: dict(CUDA_INFO, cuda=False))
    assert G.setup(tmp_path / "venv", tmp_path / "setup.log") == 1
    assert not (tmp_path / "venv" / "checks-python").exists()
    assert "no Python here imports a CUDA-enabled torch" in (tmp_path / "setup.log").read_text()


# --- shardwise bench --device ---------------------------------------------------------------

def _bench_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise bench: error: "), err
    return err[0]


def test_bench_device_cuda_without_cuda_is_refused(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = _bench_error(["--device", "cuda"], capsys)
    assert "--device=cuda is not allowed here" in msg and "sees no CUDA GPU" in msg
    msg = _bench_error(["--device", "tpu"], capsys)
    assert "--device='tpu' is not allowed: use cpu or cuda" in msg


def test_bench_ranks_follow_the_gpus(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ap = B.Parser(prog="shardwise bench")
    assert B.check_device(ap, "cuda", None) == 1  # one GPU: world 1
    assert B.check_device(ap, "cuda", 1) == 1
    assert B.check_device(ap, "cpu", None) == 2  # the CPU default is unchanged
    with pytest.raises(SystemExit):
        B.check_device(ap, "cuda", 2)
    msg = capsys.readouterr().err
    assert "--nproc=2 is not allowed with --device cuda: one rank per GPU, and this machine " \
           "has 1" in msg


def _per_rank(device: str) -> tuple[list[dict], BenchConfig]:
    bc = BenchConfig("tiny", 2, 16, 1, 2, ("shardwise FULL_SHARD", "torch FSDP2"), 1, device)
    res = {n: {"median_s": t, "peak_rss": 400 * 2**20, "rss_growth": 2**20,
               "model_state_bytes": 2**20, "params": 10**5, "copied": {}}
           for n, t in (("shardwise FULL_SHARD", 0.01), ("torch FSDP2", 0.02))}
    if device == "cuda":
        res["shardwise FULL_SHARD"]["peak_gpu"] = 100 * 2**20
        res["torch FSDP2"]["peak_gpu"] = 150 * 2**20
    return [{"rank": 0, "world": 1, "results": res}], bc


def test_bench_gpu_table_says_world_1_and_reads_gpu_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    summary = B.summarize(*_per_rank("cuda"))
    summary["gpu_name"] = "Stand-in GPU"
    assert summary["systems"]["torch FSDP2"]["peak_gpu_vs_shardwise"] == 1.5
    B.print_table(summary)
    out = capsys.readouterr().out
    assert "on 1 GPU (Stand-in GPU), NCCL, one rank per GPU" in out
    assert "world size 1 (one GPU): no bytes move between GPUs" in out
    assert "peak GPU MB" in out and "peak RSS MB" not in out
    assert "FULL_SHARD / FSDP2 = 0.50" in out


def test_bench_cpu_table_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    summary = B.summarize(*_per_rank("cpu"))
    assert all("peak_gpu_bytes" not in r for r in summary["systems"].values())
    B.print_table(summary)
    lines = capsys.readouterr().out.splitlines()
    # The header as it was before --device existed, and no GPU lines.
    assert lines[2] == ("system                      step ms    tok/s  peak RSS MB  growth MB"
                        "  state MB  time / sw  RSS / sw")
    assert not any("GPU" in line for line in lines)
