"""Launch a minimal user script with no teardown many times; count the launches that fail.

    python benchmarks/exit_stress.py --runs 200 --nproc 2
    python benchmarks/exit_stress.py --runs 100 --nproc 3
    python benchmarks/exit_stress.py --runs 40 --nproc 2 --src /path/to/old/checkout/src
    python benchmarks/exit_stress.py --runs 100 --nproc 4 --tp 2      # dp 2 x tp 2
    python benchmarks/exit_stress.py --runs 100 --nproc 2 --script meta
    python benchmarks/exit_stress.py --runs 100 --nproc 2 --script allreduce

Each launch is `torchrun --standalone --nproc-per-node N benchmarks/exit_user_script.py`:
shard, 3 steps, one save_checkpoint, one full_state_dict, then the script simply ends
(see [Note: gloo teardown] in shardwise/engine/comm/process_group.py). Every non-zero exit is
counted and its signal named (-6 / SIGABRT is the gloo exit race). `--tp N` trains the
trainer's GPT with its tensor-parallel plan on a (nproc/N, N) mesh instead. `--src` puts another
checkout's sources first on the path, to measure the rate before a fix side by side.
`--jobs` runs launches concurrently (more load per core makes the race more likely).
`--script meta|allreduce` launches benchmarks/exit_user_collectives.py instead, whose last
collectives are the user's own (DTensor's `full_tensor()` after meta init and `materialize`;
a plain `dist.all_reduce`), so none of them passes through shardwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "exit_user_script.py"
COLLECTIVES = HERE / "exit_user_collectives.py"
SCRIPTS = ("train", "meta", "allreduce")


def launch(nproc: int, src: str | None, timeout_s: float, tp: int = 1,
           script: str = "train") -> tuple[int, str]:
    """(torchrun's exit status, the reason a worker failed, if any)."""
    env = dict(os.environ)
    env["SW_EXIT_TP"] = str(tp)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="sw-exit-") as tmp:
        args = [str(SCRIPT), str(Path(tmp) / "ckpt")] if script == "train" \
            else [str(COLLECTIVES), script]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *args]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return -1, f"hung past {timeout_s:.0f}s"
    out = p.stdout + p.stderr
    if p.returncode == 0:
        return 0, ""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    why = "terminate called" if "terminate called" in out else \
        next((ln.strip()[:160] for ln in out.splitlines() if "Error:" in ln), "")
    return p.returncode, f"worker exitcode {','.join(sorted(set(codes)))} {why}".strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--src", default=None, help="another checkout's src/ to test instead")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    ap.add_argument("--json", default=None, help="write the counts to this file")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1: FSDP alone)")
    ap.add_argument("--script", choices=SCRIPTS, default="train",
                    help="train: exit_user_script.py; meta, allreduce: exit_user_collectives.py")
    args = ap.parse_args()
    t0 = time.perf_counter()
    failures: list[str] = []
    done = 0
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(launch, args.nproc, args.src, args.timeout, args.tp, args.script)
                for _ in range(args.runs)]
        for f in cf.as_completed(futs):
            rc, why = f.result()
            done += 1
            if rc != 0:
                failures.append(why)
                print(f"launch {done}: exit {rc}: {why}", flush=True)
            if done % 10 == 0:
                print(f"{done}/{args.runs} launches, {len(failures)} non-zero "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
    result = {"runs": args.runs, "nproc": args.nproc, "tp": args.tp, "jobs": args.jobs,
              "script": args.script,
              "src": args.src or "this checkout", "nonzero": len(failures),
              "reasons": failures, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{args.runs} launches of {args.script} at {args.nproc} ranks (tp {args.tp}): "
          f"{len(failures)} "
          "non-zero exits")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
