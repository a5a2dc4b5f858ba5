"""Peak memory of `sw.load_pretrained` per rank, as the kernel counts it, for three readers.

    .venv/bin/python benchmarks/load_pretrained_memory.py [--world 2] [--layers 3]
        [--max-shard-size 45MB] [--folder DIR] [--repeat 2]
        [--out benchmarks/results/load-pretrained-memory.json]

Issue 37: a 415 MB Llama saved in 10 safetensors files, loaded at 2 ranks, peaked at
465-500 MiB per rank (its ~208 MB of shards plus 249-284 MiB of mapped file pages): the
reader unmapped a file only after 64 MiB had been read through it, and no file got there.

The folder is built here from a Llama config (vocab 32000, hidden 1024, MLP 2816, untied
head; 3 layers: 104M parameters, 416 MB fp32) with `save_pretrained(max_shard_size=...)`
into a temporary folder, and read from a warm page cache. Each reader loads the same
meta-built model, sharded FULL_SHARD, in fresh ranks; each rank records VmRSS before the
load (after `clear_refs` resets VmHWM to it) and VmHWM after it, from /proc/self/status:
the resident high-water mark, file pages included (RssFile is mapped file pages).

- `pread` (the reader now): blocks read with pread into the shard, or through one staging
  buffer of at most 64 MiB; nothing mapped;
- `mmap per file` (the reader before): safetensors' memory map, a file unmapped after 64 MiB
  read through it;
- `mmap, one budget`: the same maps, but every open file unmapped once 64 MiB have been read
  through all of them together (the alternative fix);
- `pread, no NaN check`: `allow_nonfinite=True`, what the finite check costs in time.

Ratios are printed side by side; times are noisy on a shared machine, the memory is not.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
from safetensors import safe_open

import shardwise as sw
from shardwise.checkpoint import block_reader, pretrained
from shardwise.checkpoint.finite import count_nonfinite
from shardwise.engine.comm import collectives as C
from shardwise.testing import run_distributed

BUDGET = block_reader.DEFAULT_BUFFER_BYTES


class MmapReader:
    """The reader before issue 37, kept here to measure against: copies from safetensors'
    memory maps; `per_file`: a file is unmapped after `budget` bytes read through it;
    otherwise all open files are unmapped once `budget` bytes went through them together."""

    def __init__(self, budget: int = BUDGET, per_file: bool = True) -> None:
        self.buffer_bytes, self.per_file = budget, per_file
        self.bytes_read, self.nonfinite = 0, {}  # type: ignore[var-annotated]
        self._open: dict[str, list[Any]] = {}  # file -> [handle, bytes read through it]

    def _handle(self, path: str) -> Any:
        if path not in self._open:
            self._open[path] = [safe_open(path, framework="pt"), 0]
        return self._open[path][0]

    def _count(self, path: str, n: int) -> None:
        self.bytes_read += n
        self._open[path][1] += n
        if self.per_file:
            if self._open[path][1] >= self.buffer_bytes:
                del self._open[path]
        elif sum(v[1] for v in self._open.values()) >= self.buffer_bytes:
            self._open.clear()

    def read_into(self, st: Any, block: tuple[slice, ...], out: torch.Tensor) -> None:
        if not st.shape:
            if block and block[0].stop > block[0].start:
                out.copy_(self._handle(st.file).get_tensor(st.key).reshape(out.shape))
                self._count(st.file, st.dtype.itemsize)
            return
        rows = block[0].stop - block[0].start
        row_bytes = max(1, out[0].numel() * st.dtype.itemsize) if rows else 1
        step = max(1, self.buffer_bytes // row_bytes)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            a = block[0].start
            sl = self._handle(st.file).get_slice(st.key)
            view = sl[(slice(a + lo, a + hi), *block[1:])]
            out[lo:hi].copy_(view.reshape(out[lo:hi].shape))
            del sl, view
            bad = count_nonfinite(out[lo:hi])
            if bad:
                self.nonfinite[(st.file, st.key, ())] = bad
            self._count(st.file, (hi - lo) * row_bytes)

    def close(self) -> None:
        self._open.clear()


READERS = {
    "pread": (block_reader.BlockReader, False),
    "mmap per file": (lambda b: MmapReader(b, per_file=True), False),
    "mmap, one budget": (lambda b: MmapReader(b, per_file=False), False),
    "pread, no NaN check": (block_reader.BlockReader, True),
}


def build_folder(folder: str, layers: int, max_shard_size: str) -> tuple[int, int]:
    """save_pretrained a Llama of `layers` layers; (bytes of weights, number of files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                          num_hidden_layers=layers, num_attention_heads=16,
                          num_key_value_heads=16, tie_word_embeddings=False,
                          max_position_embeddings=2048)
        LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size=max_shard_size)
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(folder, f)) for f in files), len(files)


def warm(folder: str) -> None:
    for f in sorted(os.listdir(folder)):
        with open(os.path.join(folder, f), "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssFile", "RssAnon"):
                out[key] = int(line.split()[1]) * 1024
    return out


def worker(rank: int, world: int, reader: str, folder: str) -> dict[str, Any]:
    import transformers  # noqa: F401  (imported before the baseline)
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.engine.core.context import sharded_params

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    sw.shard_model(model, auto_wrap_policy="transformer")
    make, allow = READERS[reader]
    pretrained.BlockReader = make  # type: ignore[assignment]
    C.barrier()
    before = _status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    sw.load_pretrained(model, folder, allow_nonfinite=allow)
    seconds = time.perf_counter() - t0
    after = _status()
    C.barrier()
    shards = sum(sp.local.numel() * sp.local.element_size() for sp in sharded_params(model))
    return {"seconds": seconds, "rss_before": before["VmRSS"], "hwm_after": after["VmHWM"],
            "rss_file_after": after["RssFile"], "shard_bytes": shards}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--max-shard-size", default="45MB")
    ap.add_argument("--folder", default=None, help="reuse/keep the model folder here")
    ap.add_argument("--repeat", type=int, default=2, help="runs per reader (worst memory, "
                    "best time kept)")
    ap.add_argument("--readers", nargs="+", default=list(READERS), choices=list(READERS))
    ap.add_argument("--out", default="benchmarks/results/load-pretrained-memory.json")
    args = ap.parse_args()
    tmp = None if args.folder else tempfile.TemporaryDirectory(prefix="sw-load-mem-")
    folder = args.folder or tmp.name  # type: ignore[union-attr]
    model_bytes, n_files = build_folder(folder, args.layers, args.max_shard_size)
    mib = 2**20
    print(f"model: {model_bytes / 1e6:.0f} MB ({model_bytes / mib:.0f} MiB) in {n_files} "
          f"files; {args.world} ranks; buffer {BUDGET // mib} MiB")
    rows: dict[str, Any] = {}
    for name in args.readers:
        runs = []
        for _ in range(args.repeat):
            warm(folder)
            runs.append(run_distributed(worker, args.world, name, folder, timeout_s=1800,
                                        collective_timeout_s=900))
        ranks = [max((run[r] for run in runs), key=lambda x: x["hwm_after"] - x["rss_before"])
                 for r in range(args.world)]
        rows[name] = {"ranks": ranks,
                      "seconds": min(max(r["seconds"] for r in run) for run in runs)}
    base = rows[args.readers[0]]["seconds"]
    print(f"\n{'reader':22s} {'rank':>4s} {'RSS before':>11s} {'VmHWM after':>12s} "
          f"{'growth':>8s} {'shards':>8s} {'growth-shards':>14s} {'growth/model':>13s} "
          f"{'time s':>7s} {'x first':>7s}")
    for name, row in rows.items():
        for r, x in enumerate(row["ranks"]):
            growth = x["hwm_after"] - x["rss_before"]
            t = f"{row['seconds']:7.2f} {row['seconds'] / base:7.2f}" if r == 0 else ""
            print(f"{name:22s} {r:4d} {x['rss_before'] / mib:8.0f} MiB "
                  f"{x['hwm_after'] / mib:8.0f} MiB {growth / mib:4.0f} MiB "
                  f"{x['shard_bytes'] / mib:4.0f} MiB {(growth - x['shard_bytes']) / mib:10.0f} "
                  f"MiB {growth / model_bytes:13.2f} {t}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model_bytes": model_bytes, "files": n_files, "world": args.world,
                   "buffer_bytes": BUDGET, "cpus": os.cpu_count(),
                   "load_average": os.getloadavg()[0], "readers": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
