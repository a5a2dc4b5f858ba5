"""`make gpu-check`: every GPU check, then `shardwise bench --device cuda` beside FSDP2.

    python3 tests/gpu/check.py setup     # once: the Python that runs the checks
    python3 tests/gpu/check.py run       # tests/gpu, the bench, a summary (bounded)

`setup` makes `.venv-gpu` (seeing python3's own packages) and installs torch==2.13.0 there
from the default index (the CUDA build on Linux). Where that cannot be had (a machine with no
network), the checks run on the CUDA torch that python3 already imports, and every summary
says which torch ran. It records the interpreter it chose in `.venv-gpu/checks-python`.

`run` bounds each stage with `timeout` (the tests, then the bench), so the whole run ends
within its budget (450 s by default) even if a collective hangs, and prints one summary. With
$OUT set (or --out), it writes there: setup.log, tests.log, tests.xml (JUnit), bench.log,
bench.json and summary.json. No GPU (no nvidia-smi): exit status 2, nothing run.

The library is used from the working tree (PYTHONPATH=src): nothing needs installing but
torch, pytest (and pytest-timeout, for a per-test bound) and shardwise's small dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "2.13.0"
# What the checks import besides torch (pyproject's dependencies that the tests reach, and
# the test runner with its per-test timeout).
DEPS = ["numpy", "safetensors>=0.4", "tqdm>=4.60", "pytest>=8", "pytest-timeout"]
BUDGET_S = 450  # under 8 minutes with the probe and start-up, `make` bounding it at 470
BENCH_S = 150  # kept for the bench out of the budget; the tests get the rest
CASE_S = 150  # one test (pytest-timeout); run_distributed bounds each case below that too
BENCH_SYSTEMS = "shardwise FULL_SHARD,torch FSDP2"
# ~30M parameters, batch 8 x 256 per rank: seconds per system on one GPU.
BENCH_ARGS = ["--preset", "bench30m", "--batch-size", "8", "--seq-len", "256",
              "--rounds", "3", "--steps", "10"]
PROBE = ("import json, importlib.util as u, torch; c = torch.cuda.is_available(); "
         "print(json.dumps({'torch': torch.__version__, 'cuda': c, "
         "'gpus': torch.cuda.device_count() if c else 0, "
         "'name': torch.cuda.get_device_name(0) if c else '', "
         "'pytest': u.find_spec('pytest') is not None, "
         "'pytest_timeout': u.find_spec('pytest_timeout') is not None}))")


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)


def probe(python: str) -> dict | None:
    """What `python` has: torch's version, CUDA, GPUs, pytest (None: no torch at all)."""
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def usable(info: dict | None) -> bool:
    return bool(info and info["cuda"] and info["pytest"])


def setup(venv: Path, log: Path) -> int:
    """Choose the interpreter for the checks; record it in `venv/checks-python`."""
    py = venv / "bin" / "python"
    lines: list[str] = []
    info = probe(str(py)) if py.exists() else None
    if not (usable(info) and info["torch"].startswith(TORCH)):  # type: ignore[index]
        if not py.exists():
            _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], lines)
        if py.exists():
            _run([str(py), "-m", "pip", "install", "-q", "--retries", "0", "--timeout", "15",
                  f"torch=={TORCH}", *DEPS], lines)
            info = probe(str(py))
    chosen, note = str(py), ""
    if not usable(info):
        # No network, or no venv module: python3's own CUDA torch, if it has one.
        chosen, info = sys.executable, probe(sys.executable)
        note = f"torch=={TORCH} could not be installed in {venv}; using {chosen}'s own torch"
    if not usable(info):
        lines.append(f"no Python here imports a CUDA-enabled torch and pytest ({info})")
        _write(log, lines)
        print("\n".join(lines[-3:]), file=sys.stderr)
        return 1
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "checks-python").write_text(json.dumps({"python": chosen, "note": note}))
    lines.append(f"checks run on {chosen}: torch {info['torch']}, {info['gpus']} GPU(s) "  # type: ignore[index]
                 f"{info['name']}{'; ' + note if note else ''}")  # type: ignore[index]
    _write(log, lines)
    print(lines[-1])
    return 0


def plan(python: str, info: dict, out: Path, budget_s: int = BUDGET_S) -> list[Stage]:
    """The stages of `run`: every GPU test, then the bench, each under its own timeout."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
           "PYTHONUNBUFFERED": "1"}
    tests = [python, "-m", "pytest", "-q", "-rs", "tests/gpu", f"--junitxml={out / 'tests.xml'}"]
    if info.get("pytest_timeout"):
        tests.append(f"--timeout={CASE_S}")
    bench = [python, "-m", "shardwise.cli", "bench", "--device", "cuda", *BENCH_ARGS,
             "--systems", BENCH_SYSTEMS, "--json", str(out / "bench.json")]
    return [Stage("tests", tests, budget_s - BENCH_S, env),
            Stage("bench", bench, BENCH_S - 10, env)]


def run_stage(stage: Stage, log: Path) -> int:
    """Run under `timeout` (exit 124 when it ran out), echoing and logging its output."""
    argv = ["timeout", "-k", "10", str(stage.timeout_s), *stage.argv]
    print(f"\n== {stage.name} (at most {stage.timeout_s} s): {' '.join(stage.argv[1:])}",
          flush=True)
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **stage.env}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert p.stdout is not None
        for line in p.stdout:
            sys.stdout.write(line)
            f.write(line)
        return p.wait()


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped and the failing tests' names from pytest's JUnit XML."""
    if not path.exists():
        return {"ran": False}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failed, skipped, total = [], 0, 0
    for s in suites:
        for case in s.iter("testcase"):
            total += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(name)
            elif case.find("skipped") is not None:
                skipped += 1
    return {"ran": True, "total": total, "failed": failed, "skipped": skipped,
            "passed": total - len(failed) - skipped}


def bench_line(path: Path) -> str:
    """One line from bench.json: each system's step time and FULL_SHARD / FSDP2."""
    if not path.exists():
        return "bench: no result"
    s = json.loads(path.read_text())
    rows = s["systems"]
    parts = [f"{name} {1e3 * r['median_step_s']:.2f} ms" for name, r in rows.items()]
    line = f"bench (world {s['world_size']}): " + ", ".join(parts)
    ref, fsdp2 = rows.get("shardwise FULL_SHARD"), rows.get("torch FSDP2")
    if ref and fsdp2:
        line += f"; FULL_SHARD / FSDP2 = {ref['median_step_s'] / fsdp2['median_step_s']:.2f}"
    return line


def run(venv: Path, out: Path, budget_s: int) -> int:
    if shutil.which("nvidia-smi") is None:
        print("gpu-check: no nvidia-smi on PATH, so no NVIDIA GPU here: nothing was checked",
              file=sys.stderr)
        return 2
    choice = venv / "checks-python"
    if not choice.exists():
        print(f"gpu-check: {choice} is missing: run `tests/gpu/check.py setup` first",
              file=sys.stderr)
        return 1
    chosen = json.loads(choice.read_text())
    info = probe(chosen["python"])
    if not usable(info):
        print(f"gpu-check: {chosen['python']} no longer imports a CUDA torch ({info})",
              file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    status = {st.name: run_stage(st, out / f"{st.name}.log")
              for st in plan(chosen["python"], info, out, budget_s)}  # type: ignore[arg-type]
    tests = junit_counts(out / "tests.xml")
    summary = {"torch": info["torch"], "gpus": info["gpus"], "gpu": info["name"],  # type: ignore[index]
               "note": chosen["note"], "exit": status, "tests": tests,
               "bench": bench_line(out / "bench.json"),
               "wall_s": round(time.monotonic() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary, out))
    ok = all(code == 0 for code in status.values()) and tests.get("ran") and not tests["failed"]
    return 0 if ok else 1


def format_summary(s: dict, out: Path) -> str:
    t = s["tests"]
    lines = [f"\ngpu-check: {s['gpus']} x {s['gpu']}, torch {s['torch']}, {s['wall_s']} s"]
    if s["note"]:
        lines.append(f"  note: {s['note']}")
    if t.get("ran"):
        lines.append(f"  tests/gpu: {t['passed']} passed, {len(t['failed'])} failed, "
                     f"{t['skipped']} skipped (exit {s['exit']['tests']})")
        lines += [f"    FAILED {name}" for name in t["failed"]]
    else:
        lines.append(f"  tests/gpu: no result (exit {s['exit']['tests']}; 124: timed out)")
    lines.append(f"  {s['bench']} (exit {s['exit']['bench']})")
    lines.append(f"  results in {out}")
    return "\n".join(lines)


def _run(argv: list[str], lines: list[str]) -> None:
    lines.append("$ " + " ".join(argv))
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    except OSError as e:
        lines.append(f"  failed: {e}")
        return
    lines += [f"  {x}" for x in (r.stdout + r.stderr).strip().splitlines()[-20:]]
    lines.append(f"  exit {r.returncode}")


def _write(log: Path, lines: list[str]) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/gpu/check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("setup", "run"))
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                    else ROOT / "runs" / "gpu-check",
                    help="where results go (default $OUT, else runs/gpu-check)")
    ap.add_argument("--budget-s", type=int, default=BUDGET_S,
                    help=f"the run's bound in seconds (default {BUDGET_S})")
    args = ap.parse_args(argv)
    if args.budget_s <= BENCH_S + 60:
        ap.error(f"--budget-s={args.budget_s} is not allowed: must be > {BENCH_S + 60} "
                 f"({BENCH_S} s are the bench's)")
    if args.stage == "setup":
        if shutil.which("nvidia-smi") is None:
            print("gpu-check: no nvidia-smi on PATH, so no NVIDIA GPU here: nothing to set up",
                  file=sys.stderr)
            return 2
        return setup(args.venv, args.out / "setup.log")
    return run(args.venv, args.out, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
