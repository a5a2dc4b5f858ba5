"""`shardwise export CHECKPOINT OUT`: a sharded checkpoint -> consolidated safetensors, offline.

Runs in one process without a process group; memory stays bounded by the largest tensor
(tensors are copied piece by piece from the per-rank files into the output). CHECKPOINT may
be a run folder (runs/NAME): its latest checkpoint is exported, and the summary says which.
An existing output file, or a folder that already holds an export, is never overwritten
without --force. One summary line; --verbose adds a line per file and tensor.

A run of the built-in GPT also gets shardwise_gpt.json (its shape) beside the weights, so
`shardwise generate OUT` rebuilds it. `--hf` writes a Hugging Face folder (config.json,
weights, tokenizer files; a LoRA run's adapters merged) and `--adapter` a LoRA run's peft
adapter folder alone: both into a new folder (or, with --force, over an earlier export's files),
written whole or not at all, --hf's weights split at --max-shard-size (train/hf_export.py).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from ._args import Parser, report

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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


# What an export writes into a folder: --force replaces these and nothing else.
_EXPORTED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """A checkpoint folder, or a run folder (runs/NAME) or its checkpoints/ -> (the
    checkpoint to export, how it was chosen: "" when given directly)."""
    from shardwise.checkpoint.atomic import is_complete, previous_path
    from shardwise.train import rundir

    if is_complete(path) or is_complete(previous_path(path)):
        return path, ""
    p = os.path.abspath(path)
    run = p if os.path.isdir(os.path.join(p, rundir.CKPT_DIR)) else os.path.dirname(p)
    found = rundir.checkpoints(Path(run))
    if os.path.basename(p) in (os.path.basename(run), rundir.CKPT_DIR) and found:
        return str(found[-1][1]), "the run's latest checkpoint"
    if os.path.isfile(os.path.join(p, "config.toml")) and not found:
        # A run folder whose training saved nothing yet: say that, not "manifest.json is
        # missing" about the run folder itself.
        raise ValueError(f"{path} is a run folder with no checkpoint yet: training saves one "
                         "every checkpoint.interval steps and at the end; export after one "
                         "exists, or give a checkpoint folder")
    return path, ""


def check_out(out: str, force: bool) -> list[str]:
    """Refuse to overwrite without --force (a file, or a folder holding an export); return
    the existing export files that --force replaces."""
    if out.endswith(".safetensors"):
        if os.path.isdir(out):
            raise ValueError(f"out={out!r} is not allowed: it is a folder named like a file")
        if os.path.exists(out) and not force:
            raise ValueError(f"out={out!r} already exists; pass --force to overwrite it")
        return []
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out={out!r} is not allowed: it is a file; give a folder or a file "
                         "name ending in .safetensors")
    old = sorted(n for n in os.listdir(out) if _EXPORTED.match(n)) if os.path.isdir(out) else []
    if old and not force:
        raise ValueError(f"out={out!r} already holds an export ({', '.join(old[:3])}"
                         f"{', ...' if len(old) > 3 else ''}); pass --force to overwrite it")
    return [os.path.join(out, n) for n in old]


def main(argv: list[str]) -> int:
    from shardwise.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, ExportProgress

    ap = Parser(
        prog="shardwise export", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint folder written by sw.save_checkpoint, or "
                                       "a run folder (runs/NAME): its latest checkpoint")
    ap.add_argument("out", help="an output folder (model.safetensors, or shards + index) or "
                                "a file name ending in .safetensors (exactly that one file)")
    ap.add_argument("--max-shard-size", type=parse_size, default=None,
                    metavar="SIZE", help="split the weights into files of at most this size, "
                                         "e.g. 5GB, 500MiB (default 5GB; also with --hf)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip checking each checkpoint file's SHA-256 first")
    ap.add_argument("--force", action="store_true",
                    help="overwrite an existing output file, or the export files in the "
                         "folder (with --hf / --adapter too; other files are kept)")
    ap.add_argument("--verbose", action="store_true", help="one line per file and tensor")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--hf", action="store_true",
                      help="a Hugging Face folder from a --model.hf run: config.json, "
                           "safetensors, tokenizer files (LoRA merged into the weights)")
    kind.add_argument("--adapter", action="store_true",
                      help="a LoRA run's peft adapter folder alone (PeftModel.from_pretrained)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        ap.error(f"checkpoint={args.checkpoint!r} is not allowed: no such directory (give a "
                 "checkpoint folder written by sw.save_checkpoint, or a run folder)")
    if not args.out:
        ap.error(f"out={args.out!r} is not allowed: give an output folder or a .safetensors "
                 "file name")
    if args.hf or args.adapter:
        return _export_folder(args.checkpoint, args.out, args.adapter, not args.no_verify,
                              args.max_shard_size, args.force)
    max_shard = DEFAULT_MAX_SHARD_BYTES if args.max_shard_size is None else args.max_shard_size
    try:
        replaced = check_out(args.out, args.force)
    except ValueError as e:
        ap.error(str(e))
    try:
        ckpt, chosen = resolve_checkpoint(args.checkpoint)
    except ValueError as e:
        return report("shardwise export", e)

    from shardwise.checkpoint.export import export_checkpoint
    from shardwise.checkpoint.manifest import CheckpointError

    t0 = time.monotonic()
    total = count = 0

    def progress(p: ExportProgress) -> None:
        nonlocal total, count
        if p.phase != "verify":
            total, count = total + p.nbytes, count + 1
        if args.verbose:
            what = "verify" if p.phase == "verify" else "write "
            print(f"{what} [{p.index}/{p.count}] {p.name} ({_human(p.nbytes)})", flush=True)

    try:
        for f in replaced:  # refused above unless --force
            os.remove(f)
        files = export_checkpoint(ckpt, args.out, max_shard_bytes=max_shard,
                                  verify=not args.no_verify, progress=progress)
    except (CheckpointError, ValueError, OSError) as e:
        return report("shardwise export", e)
    _record_gpt_shape(ckpt, args.out)
    dt = time.monotonic() - t0
    where = files[0] if len(files) == 1 else f"{os.path.dirname(files[0])} ({len(files)} files)"
    source = f"{ckpt} ({chosen})" if chosen else ckpt
    print(f"exported {source} -> {where}: {count} tensors, {_human(total)}, {dt:.1f} s"
          + (f" (replaced {len(replaced)} file{'s' if len(replaced) != 1 else ''})"
             if replaced else ""))
    return 0


def _record_gpt_shape(ckpt: str, out: str) -> None:
    """A built-in GPT run's export folder records the model's shape (shardwise_gpt.json)."""
    import dataclasses
    import json

    from shardwise.train.hf_export import GPT_SHAPE, run_config

    if out.endswith(".safetensors"):
        return
    try:
        cfg = run_config(ckpt)
    except ValueError:
        return  # a checkpoint outside a run folder: the weights alone
    if not cfg.model.hf:
        shape = {"model_type": "shardwise-gpt", **dataclasses.asdict(cfg.model.gpt())}
        Path(out, GPT_SHAPE).write_text(json.dumps(shape, indent=2) + "\n")


def _export_folder(checkpoint: str, out: str, adapter: bool, verify: bool,
                   max_shard_bytes: int | None, force: bool) -> int:
    from shardwise.checkpoint.manifest import CheckpointError
    from shardwise.train.hf_export import export_run, run_config

    prog = "shardwise export"
    ckpt, chosen = resolve_checkpoint(checkpoint)
    try:
        if not adapter and not run_config(ckpt).model.hf:
            raise ValueError(f"--hf: {checkpoint!r} is a run of the built-in GPT, which has no "
                             "Hugging Face class; export it without --hf (the folder records "
                             "its shape, and `shardwise generate OUT` samples from it)")
        t0 = time.monotonic()
        cfg = export_run(ckpt, out, adapter=adapter, verify=verify,
                         max_shard_bytes=max_shard_bytes, force=force)
    except (CheckpointError, ValueError, OSError) as e:
        return report(prog, e)
    what = ("peft adapter folder" if adapter else
            "Hugging Face folder" + (" (LoRA merged)" if cfg.lora.rank else ""))
    source = f"{ckpt} ({chosen})" if chosen else ckpt
    print(f"exported {source} -> {out}: {what}, {time.monotonic() - t0:.1f} s")
    return 0
