"""Each command's fixed cost: what a user waits for besides the work itself.

- `train`: seconds from the command's start to its first step's console line (a tiny run:
  the built-in GPT 'tiny', and a tiny Llama with --model.hf), at --nproc 1;
- `export` and `generate`: the whole command, on a tiny run's checkpoint / export.

Every command runs as a user runs it (a fresh `python -m shardwise.cli` process). With
`--before SRC` each measurement alternates between that source tree (PYTHONPATH=SRC, e.g. a
`git archive` of an older commit's src/) and this checkout, round by round, and prints the
medians side by side with their ratio: the machine is shared and noisy, the ratio less so.

    .venv/bin/python benchmarks/fixed_cost.py [--rounds 3] [--before /tmp/base/src]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["--train.steps", "1", "--nproc", "1", "--threads", "1", "--log.sample_tokens", "0",
         "--train.eval_batches", "1", "--log.event_steps", "0", "--overwrite"]


def _env(src: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT)])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return env


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cli(args: list[str], cwd: Path, src: str | None,
         until: str | None = None) -> tuple[float, float]:
    """(seconds until the command ends, or until a stdout line starts with `until`; CPU
    seconds of the whole command and the processes it waited for). On a busy machine the
    CPU seconds move far less than the wall clock."""
    c0 = _cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", *args], cwd=cwd,
                            env=_env(src), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if until and seen is None and line.lstrip().startswith(until):
            seen = time.perf_counter() - t0
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0:
        raise RuntimeError(f"{args} failed ({proc.returncode}):\n{err}")
    wall = seen if seen is not None else time.perf_counter() - t0
    return wall, _cpu() - c0


def _workspace(tmp: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.hf_models import save_tiny
    from tests.hf_tokenizer import VOCAB_SIZE, corpus, save_tokenizer

    save_tiny("llama", tmp / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(tmp / "llama")
    (tmp / "text.txt").write_text(corpus()[:20000])


def _cases(tmp: Path) -> dict[str, tuple[list[str], str | None]]:
    hf = ["--model.hf", "llama", "--data.path", "text.txt", "--model.block_size", "16",
          "--train.batch_size", "2"]
    return {
        "train (GPT tiny), to step 1": (
            ["train", "--name", "gpt", "--model.preset", "tiny", "--data.max_bytes", "200000",
             *TRAIN], "step     1"),
        "train (--model.hf), to step 1": (["train", "--name", "hf", *hf, *TRAIN], "step     1"),
        "export (GPT tiny)": (["export", "runs/gpt", "gpt-out", "--force"], None),
        "export --hf": (["export", "runs/hf", "hf-out", "--hf", "--force"], None),
        "generate (GPT export)": (["generate", "gpt-out", "--prompt", "def ",
                                   "--max-new-tokens", "8"], None),
        "generate (HF export)": (["generate", "hf-out", "--prompt", "def ",
                                  "--max-new-tokens", "8"], None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default="", help="another src/ tree to compare with")
    ap.add_argument("--only", default="", help="run the cases whose name has this text")
    a = ap.parse_args()
    trees = {"before": a.before, "after": None} if a.before else {"this": None}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _workspace(tmp)
        for tree in trees:  # each version reads only the runs it wrote (config keys differ)
            (tmp / tree).mkdir()
            for name in ("llama", "text.txt"):
                (tmp / tree / name).symlink_to(tmp / name)
        times: dict[str, dict[str, list[float]]] = {}
        cpus: dict[str, dict[str, list[float]]] = {}
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name, (args, until) in _cases(tmp).items():
                if a.only and a.only not in name and not name.startswith("train (GPT"):
                    continue  # the GPT run is what export and generate read
                for tree in order:
                    run = args
                    if tree == "before" and "--hf" in args:
                        # an older export --hf refuses --force: start from a clean folder
                        shutil.rmtree(tmp / tree / args[2], ignore_errors=True)
                        run = [x for x in args if x != "--force"]
                    t, cpu = _cli(run, tmp / tree, trees[tree], until)
                    times.setdefault(name, {}).setdefault(tree, []).append(t)
                    cpus.setdefault(name, {}).setdefault(tree, []).append(cpu)
                    print(f"round {r + 1}: {name} [{tree}] {t:.1f} s, {cpu:.1f} CPU s",
                          file=sys.stderr, flush=True)
    cols = list(trees)
    for what, table in (("wall-clock", times), ("CPU (whole command)", cpus)):
        _print(what, table, cols, a)


def _print(what: str, table: dict[str, dict[str, list[float]]], cols: list[str],
           a: argparse.Namespace) -> None:
    times = table
    print(f"\nfixed cost per command, {what} seconds (median of {a.rounds} alternating rounds; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end):")
    head = f"  {'command':<32}" + "".join(f"{c:>10}" for c in cols)
    print(head + (f"{'after / before':>16}" if a.before else ""))
    for name, per in times.items():
        med = {c: statistics.median(per[c]) for c in cols}
        line = f"  {name:<32}" + "".join(f"{med[c]:>10.1f}" for c in cols)
        if a.before:
            line += f"{med['after'] / med['before']:>16.2f}"
        print(line)


if __name__ == "__main__":
    main()
