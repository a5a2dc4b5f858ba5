"""hpZ's all-gather bytes: one training step of the built-in GPT at 4 ranks, every all-gather
recorded at the dispatcher (group size = output / input, bytes sent by this rank), for
shardwise and PyTorch's FSDP2 side by side, with the blocks at reshard_after_forward=True
(the whole shard group of 4) and at 2 (hpZ: blocks of 2 ranks after forward).

gloo's native all-gather is used (SHARDWISE_GLOO_NATIVE=1, FSDP2's own op), so both systems'
collectives are the same op. Bytes are counts, not timings: they do not depend on the
machine's load.

    .venv/bin/python benchmarks/hpz_bytes.py [--layers 4] [--d-model 96]
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.testing import run_distributed
from shardwise.train.model import GPT, GPTConfig


class _Gathers(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and func._schema.name.startswith("c10d::_allgather_base"):
            out, inp = args[0], args[1]
            group = out.numel() // inp.numel()
            self.seen[f"n/{group}"] += 1
            self.seen[f"sent/{group}"] += inp.numel() * inp.element_size()
            # Received from the other ranks of the group: the output less this rank's part.
            self.seen[f"recv/{group}"] += (out.numel() - inp.numel()) * out.element_size()
        return func(*args, **(kwargs or {}))


def _step(rank: int, world: int, layers: int, d_model: int) -> dict[str, dict[str, Any]]:
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=4, d_model=d_model)
    out: dict[str, dict[str, Any]] = {}
    for system in ("shardwise", "fsdp2"):
        shard = sw.fully_shard if system == "shardwise" else torch_fully_shard
        for k in (True, 2):
            torch.manual_seed(0)
            model = GPT(cfg)
            for b in model.blocks:
                shard(b, reshard_after_forward=k)
            shard(model)
            x = torch.randint(0, 256, (2, 32))
            for _ in range(2):  # the second step is recorded (lazy init done)
                fwd, bwd = _Gathers(), _Gathers()
                with fwd:
                    loss = model(x, x)
                with bwd:
                    loss.backward()
                model.zero_grad()
            out[f"{system} k={k}"] = {"forward": dict(fwd.seen), "backward": dict(bwd.seen)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=96)
    a = ap.parse_args()
    os.environ["SHARDWISE_GLOO_NATIVE"] = "1"
    res = run_distributed(_step, 4, a.layers, a.d_model, timeout_s=600,
                          env={"SHARDWISE_GLOO_NATIVE": "1"})[0]
    print(f"GPT n_layer={a.layers} d_model={a.d_model}, 4 ranks, rank 0, one step's all-gathers")
    print(f"{'run':<20} {'phase':<9} {'group':>5} {'count':>5} {'sent B':>10} {'recv B':>10}")
    for run, phases in res.items():
        for phase, seen in phases.items():
            for group in sorted({int(key.split('/')[1]) for key in seen}):
                print(f"{run:<20} {phase:<9} {group:>5} {seen[f'n/{group}']:>5} "
                      f"{seen[f'sent/{group}']:>10} {seen[f'recv/{group}']:>10}")
    full = res["shardwise k=True"]["backward"]
    hpz = res["shardwise k=2"]["backward"]
    print(f"backward all-gather, hpZ k=2 / k=True: sent {hpz['sent/2'] / full['sent/4']:.2f}x, "
          f"received {hpz['recv/2'] / full['recv/4']:.2f}x, group 2 of 4 ranks")
    same = all(res[f"shardwise k={k}"] == res[f"fsdp2 k={k}"] for k in (True, 2))
    print(f"shardwise's all-gathers equal FSDP2's (count, group, bytes): {same}")


if __name__ == "__main__":
    main()
