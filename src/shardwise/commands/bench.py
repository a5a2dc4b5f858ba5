"""`shardwise bench`: shardwise vs PyTorch FSDP2, DDP and the no-communication bound.

One launch runs every system on the same model and data in alternating rounds and prints
median step time, tokens/s, peak RSS per rank, model-state bytes per rank, and each ratio
to shardwise FULL_SHARD. `--scaling` measures shardwise at world sizes 1, 2 and 4.
`--device cuda` runs on GPUs instead: NCCL, one rank per GPU, the model and data on the
GPU, and peak GPU memory in place of peak RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from shardwise.bench.runner import BenchConfig, bench_worker, memory_worker
from shardwise.bench.systems import REFERENCE, SYSTEMS
from shardwise.train.model import PRESETS

from ._args import Parser, at_least

MB = 2**20


def summarize(per_rank: list[dict], bc: BenchConfig) -> dict:
    world = per_rank[0]["world"]
    rows = {}
    for name in bc.systems:
        rs = [r["results"][name] for r in per_rank]
        step = max(r["median_s"] for r in rs)  # the slowest rank sets the pace
        rows[name] = {
            "median_step_s": step,
            "tokens_per_s": world * bc.batch_size * bc.seq_len / step,
            "peak_rss_bytes": max(r["peak_rss"] for r in rs),
            "rss_growth_bytes": max(r["rss_growth"] for r in rs),
            "model_state_bytes_per_rank": max(r["model_state_bytes"] for r in rs),
            "params": rs[0]["params"],
            "copied_bytes_per_step": rs[0].get("copied", {}),
            "optimizer": rs[0].get("optimizer", "?"),
        }
        if "peak_gpu" in rs[0]:
            rows[name]["peak_gpu_bytes"] = max(r["peak_gpu"] for r in rs)
    ref = rows.get(REFERENCE)
    if ref:
        for row in rows.values():
            row["step_time_vs_shardwise"] = row["median_step_s"] / ref["median_step_s"]
            row["peak_rss_vs_shardwise"] = row["peak_rss_bytes"] / ref["peak_rss_bytes"]
            if "peak_gpu_bytes" in row:
                row["peak_gpu_vs_shardwise"] = row["peak_gpu_bytes"] / ref["peak_gpu_bytes"]
    # [Note: same-bytes bound] FULL_SHARD moves 1.5x DDP's bytes (all-gather in forward and
    # backward, reduce-scatter: 3 x (S-1)/S of the model, against DDP's all-reduce 2 x
    # (S-1)/S): no-comm compute plus 1.5x DDP's communication time at DDP's cost per byte.
    dd, nc = rows.get("torch DDP"), rows.get("no-comm bound")
    bound = None
    if dd and nc:
        bound = nc["median_step_s"] + 1.5 * (dd["median_step_s"] - nc["median_step_s"])
        for row in rows.values():
            row["step_time_vs_same_bytes_bound"] = row["median_step_s"] / bound
    return {"world_size": world, "same_bytes_bound_s": bound,
            "config": bc.__dict__ | {"systems": list(bc.systems)}, "systems": rows}


def print_table(summary: dict) -> None:
    rows = summary["systems"]
    params = next(iter(rows.values()))["params"]
    cfg = summary["config"]
    print(f"\n{params / 1e6:.1f}M parameters, {summary['world_size']} ranks, batch "
          f"{cfg['batch_size']} x {cfg['seq_len']} per rank, {cfg['rounds']} rounds x "
          f"{cfg['steps']} steps")
    if cfg.get("device") == "cuda":
        _print_gpu_rows(summary)
    else:
        head = (f"{'system':<26}{'step ms':>9}{'tok/s':>9}{'peak RSS MB':>13}"
                f"{'growth MB':>11}{'state MB':>10}{'time / sw':>11}{'RSS / sw':>10}")
        print(head)
        print("-" * len(head))
        for name, r in rows.items():
            print(f"{name:<26}{1e3 * r['median_step_s']:>9.1f}{r['tokens_per_s']:>9.0f}"
                  f"{r['peak_rss_bytes'] / MB:>13.0f}{r['rss_growth_bytes'] / MB:>11.0f}"
                  f"{r['model_state_bytes_per_rank'] / MB:>10.1f}"
                  f"{r.get('step_time_vs_shardwise', float('nan')):>11.2f}"
                  f"{r.get('peak_rss_vs_shardwise', float('nan')):>10.2f}")
    impls: dict[str, list[str]] = {}
    for name, r in rows.items():
        impls.setdefault(r.get("optimizer", "?"), []).append(name)
    print("optimizer: torch.optim.AdamW, " + "; ".join(
        f"{impl}" + ("" if len(impls) == 1 else f" ({', '.join(names)})")
        for impl, names in impls.items()) + (" for every system" if len(impls) == 1 else ""))
    bound = summary.get("same_bytes_bound_s")
    ref, fsdp2 = rows.get(REFERENCE), rows.get("torch FSDP2")
    if bound and ref:
        print(f"\nsame-bytes bound (no-comm + 1.5 x (DDP - no-comm)): {1e3 * bound:.1f} ms; "
              f"FULL_SHARD / bound = {ref['median_step_s'] / bound:.2f}")
    if ref and fsdp2:
        print(f"FULL_SHARD / FSDP2 = {ref['median_step_s'] / fsdp2['median_step_s']:.2f}")
    for name, r in rows.items():
        c = r.get("copied_bytes_per_step")
        if c:
            parts = ", ".join(f"{k} {v / MB:.0f}" for k, v in c.items())
            print(f"{name}: MB copied per step: {sum(c.values()) / MB:.0f} ({parts})")


def _print_gpu_rows(summary: dict) -> None:
    """The GPU table: peak GPU memory (the allocator's high-water mark) in place of RSS."""
    rows = summary["systems"]
    world = summary["world_size"]
    print(f"on {world} GPU{'s' if world > 1 else ''} ({summary.get('gpu_name', 'cuda')}), "
          "NCCL, one rank per GPU")
    if world == 1:
        print("world size 1 (one GPU): no bytes move between GPUs, so this compares the "
              "per-step work and overheads, not communication")
    head = (f"{'system':<26}{'step ms':>9}{'tok/s':>10}{'peak GPU MB':>13}{'state MB':>10}"
            f"{'time / sw':>11}{'GPU / sw':>10}")
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        print(f"{name:<26}{1e3 * r['median_step_s']:>9.2f}{r['tokens_per_s']:>10.0f}"
              f"{r.get('peak_gpu_bytes', 0) / MB:>13.0f}"
              f"{r['model_state_bytes_per_rank'] / MB:>10.1f}"
              f"{r.get('step_time_vs_shardwise', float('nan')):>11.2f}"
              f"{r.get('peak_gpu_vs_shardwise', float('nan')):>10.2f}")


def check_device(ap: argparse.ArgumentParser, device: str, nproc: int | None) -> int:
    """The number of ranks for `device`, refusing what cannot run before anything starts:
    CUDA where torch has none, more ranks than GPUs (NCCL takes one GPU per rank)."""
    if device not in ("cpu", "cuda"):
        ap.error(f"--device={device!r} is not allowed: use cpu or cuda")
    if device == "cpu":
        return 2 if nproc is None else nproc
    if not torch.cuda.is_available():
        ap.error(f"--device=cuda is not allowed here: torch {torch.__version__} sees no CUDA "
                 "GPU; use --device cpu")
    gpus = torch.cuda.device_count()
    if nproc is None:
        return min(2, gpus)
    if nproc > gpus:
        ap.error(f"--nproc={nproc} is not allowed with --device cuda: one rank per GPU, and "
                 f"this machine has {gpus}")
    return nproc


def main(argv: list[str]) -> int:
    ap = Parser(prog="shardwise bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench30m",
                    help="model: 'bench30m' (~30M-param GPT) or a train preset (tiny, small...)")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks (default 2; with --device cuda, 2 or the GPU count if less)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    ap.add_argument("--scaling", action="store_true",
                    help="shardwise FULL_SHARD at world sizes 1, 2 and 4 instead")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the per-system fresh-process peak-memory pass (CPU only: on "
                         "a GPU each system's peak is read in place)")
    ap.add_argument("--json", type=Path, default=None, help="write results to this file")
    ap.add_argument("--device", default="cpu",
                    help="cpu (gloo; default) or cuda (NCCL, one rank per GPU, the model and "
                         "data on the GPU, peak GPU memory instead of peak RSS)")
    args = ap.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        ap.error(f"--systems={args.systems!r} is not allowed: give a comma-separated subset "
                 f"of: {', '.join(SYSTEMS)}")
    for flag in ("batch_size", "seq_len", "nproc", "rounds", "steps", "threads"):
        at_least(ap, flag.replace("_", "-"), getattr(args, flag), 1)
    if args.preset != "bench30m" and args.preset not in PRESETS:
        ap.error(f"--preset={args.preset!r} is not allowed: use bench30m or one of "
                 f"{', '.join(PRESETS)}")
    if args.json is not None and not args.json.expanduser().absolute().parent.is_dir():
        ap.error(f"--json={str(args.json)!r} is not allowed: its folder does not exist")
    args.nproc = check_device(ap, args.device, args.nproc)
    from shardwise.launch import launch

    started = time.time()
    if args.scaling:
        out = {"mode": "scaling", "runs": []}
        # On GPUs only the world sizes that have a GPU per rank.
        worlds = [w for w in (1, 2, 4) if args.device == "cpu" or w <= _gpus()]
        for world in worlds:
            bc = BenchConfig(args.preset, args.batch_size, args.seq_len, args.rounds,
                             args.steps, (REFERENCE,), args.threads, args.device)
            print(f"world size {world} ...", file=sys.stderr, flush=True)
            summary = summarize(launch(bench_worker, world, bc), bc)
            out["runs"].append(summary)
        print(f"\nscaling: shardwise FULL_SHARD, {args.preset}, batch {args.batch_size} x "
              f"{args.seq_len} per rank")
        # On a GPU the memory that matters is the device's, not the host's.
        mem, key = (("peak GPU MB", "peak_gpu_bytes") if args.device == "cuda"
                    else ("peak RSS MB", "peak_rss_bytes"))
        print(f"{'ranks':>6}{'step ms':>10}{'tok/s':>10}{mem:>13}{'state MB/rank':>15}")
        for s in out["runs"]:
            r = s["systems"][REFERENCE]
            print(f"{s['world_size']:>6}{1e3 * r['median_step_s']:>10.1f}"
                  f"{r['tokens_per_s']:>10.0f}{r[key] / MB:>13.0f}"
                  f"{r['model_state_bytes_per_rank'] / MB:>15.1f}")
    else:
        bc = BenchConfig(args.preset, args.batch_size, args.seq_len, args.rounds, args.steps,
                         systems, args.threads, args.device)
        where = " (one per GPU)" if args.device == "cuda" else ""
        print(f"benchmarking {len(systems)} systems on {args.nproc} ranks{where} ...",
              file=sys.stderr, flush=True)
        out = summarize(launch(bench_worker, args.nproc, bc), bc)
        if args.device == "cuda":
            out["gpu_name"] = _gpu_name()
        # On a GPU the allocator's high-water mark is reset per system in the same process,
        # so the fresh-process pass (host RSS) has nothing to add there.
        if not args.no_memory and args.device == "cpu":
            print("measuring peak memory, each system in fresh processes ...", file=sys.stderr,
                  flush=True)
            for name in systems:
                mem = launch(memory_worker, args.nproc, bc, name, fresh=True)
                row = out["systems"][name]
                row["peak_rss_bytes"] = max(m["peak_rss"] for m in mem)
                row["rss_growth_bytes"] = max(m["rss_growth"] for m in mem)
            ref = out["systems"].get(REFERENCE)
            for row in out["systems"].values():
                if ref:
                    row["peak_rss_vs_shardwise"] = row["peak_rss_bytes"] / ref["peak_rss_bytes"]
        print_table(out)
    out["command"] = "shardwise bench " + " ".join(argv)
    out["wall_s"] = round(time.time() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _gpus() -> int:
    return torch.cuda.device_count()


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0)
