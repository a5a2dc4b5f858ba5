"""Loading a >= 1 GB Llama-shaped Hugging Face folder into a sharded model, three ways.

    .venv/bin/python benchmarks/load_pretrained.py [--worlds 2 4] [--layers 16]
        [--folder DIR] [--out benchmarks/results/load-pretrained.json]

The folder (fp32, split into several files with an index) is built once from a config and
`save_pretrained`; it is then read from the page cache, as on a machine that just copied it.
At each world size, each method starts from the same meta-device model already sharded by
`shard_model` (FULL_SHARD, transformer policy), and measures on every rank the wall time of
the load (barrier to barrier; the slowest rank, best of --repeat runs) and the peak RSS
growth over the rank's RSS before it (VmHWM after `clear_refs`), against the rank's own
shard bytes:

- `load_pretrained`: sw.load_pretrained(model, folder), each rank reading its own rows;
- (a) `from_pretrained`: AutoModelForCausalLM.from_pretrained on every rank, then shard
  (the meta model is not used: the full model is what gets sharded);
- (b) `rank0 + load_full_state_dict`: rank 0 reads every tensor (safetensors load_file),
  sw.load_full_state_dict(model, sd, from_rank0=True) broadcasts them one at a time;
- (b') `rank0 + set_model_state_dict`: the same through torch's
  set_model_state_dict(..., StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True)), on the model materialized first (torch's path assigns
  into existing DTensors).

Ratios are printed side by side (a loaded machine shifts absolute times, not the order).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

import shardwise as sw
from shardwise.engine.comm import collectives as C
from shardwise.testing import run_distributed

METHODS = ("load_pretrained", "from_pretrained", "rank0_load_full_state_dict",
           "rank0_set_model_state_dict")


def _config(layers: int) -> Any:
    from transformers import LlamaConfig

    # ~13M parameters per layer plus 2 x 32.8M for embedding and head (fp32: 4 bytes each).
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=16, tie_word_embeddings=False,
                       max_position_embeddings=2048)


def build_folder(folder: str, layers: int) -> int:
    """Write the model with save_pretrained (several files + index); return its bytes."""
    from transformers import LlamaForCausalLM

    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(layers))
        model.save_pretrained(folder, max_shard_size="300MB")
        del model
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith(".safetensors"))


def warm(folder: str) -> None:
    """Read every file once so that each method starts from the same warm page cache."""
    for f in sorted(os.listdir(folder)):
        with open(os.path.join(folder, f), "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _meta_sharded(folder: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sw.shard_model(model, auto_wrap_policy="transformer")


def _shard_bytes(model: torch.nn.Module) -> int:
    from shardwise.engine.core.context import sharded_params

    return sum(sp.local.numel() * sp.local.element_size() for sp in sharded_params(model))


def worker(rank: int, world: int, method: str, folder: str) -> dict[str, Any]:
    import transformers  # noqa: F401  (imported before the baseline)
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = None if method == "from_pretrained" else _meta_sharded(folder)
    if method == "rank0_set_model_state_dict":
        sw.materialize(model, init_fn=model._init_weights)  # type: ignore[union-attr]
    C.barrier()
    base, _ = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    if method == "load_pretrained":
        sw.load_pretrained(model, folder)
    elif method == "from_pretrained":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        sw.shard_model(model, auto_wrap_policy="transformer")
    else:
        sd: dict[str, torch.Tensor] = {}
        if rank == 0:
            for f in sorted(os.listdir(folder)):
                if f.endswith(".safetensors"):
                    sd.update(load_file(os.path.join(folder, f)))
        if method == "rank0_load_full_state_dict":
            sw.load_full_state_dict(model, sd if rank == 0 else None, from_rank0=True)
        else:
            set_model_state_dict(model, sd, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
        del sd
    C.barrier()
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return {"seconds": seconds, "peak_growth": peak - base,
            "shard_bytes": _shard_bytes(model)}  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--folder", default=None, help="reuse/keep the model folder here")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per method (best time, worst memory are kept)")
    ap.add_argument("--out", default="benchmarks/results/load-pretrained.json")
    args = ap.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="shardwise-bench-load-")
    nbytes = build_folder(folder, args.layers)
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    print(f"model folder {folder}: {nbytes / 1e9:.2f} GB in {len(files)} files")
    buffer = 64 * 2**20
    report: dict[str, Any] = {"model_bytes": nbytes, "files": len(files),
                              "read_buffer_bytes": buffer, "repeat": args.repeat,
                              "load_average_at_start": os.getloadavg()[0],
                              "cpus": os.cpu_count(), "worlds": {}}
    for world in args.worlds:
        rows = {}
        for method in args.methods:
            runs = []
            for _ in range(args.repeat):
                warm(folder)
                runs.append(run_distributed(worker, world, method, folder, timeout_s=1800,
                                            collective_timeout_s=900))
            out = [r for run in runs for r in run]
            worst = max(out, key=lambda r: r["peak_growth"])
            rows[method] = {
                "seconds": min(max(r["seconds"] for r in run) for run in runs),
                "peak_growth_max_rank": worst["peak_growth"],
                "shard_bytes_that_rank": worst["shard_bytes"],
                "growth_over_shard_plus_buffer": worst["peak_growth"] / (
                    worst["shard_bytes"] + buffer),
                "ranks": out,
            }
        ours = rows.get("load_pretrained")
        print(f"\n{world} ranks  (shard per rank ~{nbytes / world / 1e9:.2f} GB; read buffer "
              f"{buffer / 2**20:.0f} MiB)")
        print(f"  {'method':30s} {'time s':>8s} {'x ours':>7s} {'peak growth GB':>15s} "
              f"{'/ (shard+buf)':>14s}")
        for method, r in rows.items():
            ratio = r["seconds"] / ours["seconds"] if ours else float("nan")
            print(f"  {method:30s} {r['seconds']:8.2f} {ratio:7.2f} "
                  f"{r['peak_growth_max_rank'] / 1e9:15.3f} "
                  f"{r['growth_over_shard_plus_buffer']:14.2f}")
        report["worlds"][str(world)] = rows
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
