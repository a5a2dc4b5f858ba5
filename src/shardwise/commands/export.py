"""`shardwise export CHECKPOINT OUT`: a sharded checkpoint -> consolidated safetensors, offline.

Runs in one process without a process group; memory stays bounded by the largest tensor
(tensors are copied piece by piece from the per-rank files into the output).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from ._args import Parser

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with one of "
            f"{', '.join(u.upper() for u in _UNITS if u)}")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return value


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def main(argv: list[str]) -> int:
    from shardwise.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, ExportProgress

    ap = Parser(
        prog="shardwise export", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint directory written by sw.save_checkpoint")
    ap.add_argument("out", help="output directory (model.safetensors, or shards + index)")
    ap.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                    metavar="SIZE", help="split files past this size, e.g. 5GB, 500MiB "
                                         "(default 5GB)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip checking each checkpoint file's SHA-256 first")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        ap.error(f"checkpoint={args.checkpoint!r} is not allowed: no such directory (give a "
                 "checkpoint folder written by sw.save_checkpoint)")
    if not args.out or (os.path.exists(args.out) and not os.path.isdir(args.out)):
        ap.error(f"out={args.out!r} is not allowed: give an output folder")

    from shardwise.checkpoint.export import export_checkpoint
    from shardwise.checkpoint.manifest import CheckpointError

    t0 = time.monotonic()
    total = 0

    def progress(p: ExportProgress) -> None:
        nonlocal total
        if p.phase == "verify":
            print(f"verify [{p.index}/{p.count}] {p.name} ({_human(p.nbytes)})", flush=True)
        else:
            total += p.nbytes
            print(f"write  [{p.index}/{p.count}] {p.name} ({_human(p.nbytes)})", flush=True)

    try:
        files = export_checkpoint(args.checkpoint, args.out,
                                  max_shard_bytes=args.max_shard_size,
                                  verify=not args.no_verify, progress=progress)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"shardwise export: {e}", file=sys.stderr)
        return 1
    dt = time.monotonic() - t0
    print(f"wrote {len(files)} file{'s' if len(files) != 1 else ''}, {_human(total)} of "
          f"tensors in {dt:.1f}s:")
    for f in files:
        print(f"  {f}")
    return 0
