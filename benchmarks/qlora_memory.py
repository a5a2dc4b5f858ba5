"""Per-rank memory of a QLoRA run (`--model.quantize nf4`) against the same bf16 LoRA run.

    .venv/bin/python benchmarks/qlora_memory.py [--world 2] [--layers 8] [--hidden 1024]
        [--mlp 2048] [--rank 8] [--steps 3] [--out benchmarks/results/qlora-memory.json]

Both runs build their model as `shardwise train --model.hf` does (`build_hf` on the run's
Config: meta model, peft LoRA on the default targets, FULL_SHARD per decoder layer,
materialize, `sw.load_pretrained`; with model.quantize nf4 the base linears load as NF4),
with model.dtype bf16, then take a few AdamW steps on random tokens (batch 2 x 64). Each
configuration runs in fresh ranks, so the kernel's counters are its own. Per rank:

- params / grads / optimizer: bytes held by the local shards (an NF4 shard's inner tensors),
  the local gradients after the last backward, and AdamW's state;
- RSS after load: VmRSS once the model is built and loaded;
- peak RSS (steps): VmHWM over the training steps (`clear_refs` resets it after loading);
- peak RSS (all): the process's high-water mark, loading included.

The folder is a Llama config saved with `save_pretrained` in bf16 into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from typing import Any

import torch

from shardwise.testing import run_distributed

MB = 2**20


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run(rank: int, world: int, folder: str, quantize: str, lora_rank: int,
         steps: int) -> dict[str, Any]:
    from shardwise.engine.core.dtensor import local_of
    from shardwise.train import options as O
    from shardwise.train.hf_model import build_hf, loss
    from shardwise.train.metrics import stored_bytes

    torch.set_num_threads(1)
    cfg = O.build({"model.hf": folder, "data.path": folder, "lora.rank": str(lora_rank),
                   "model.dtype": "bf16", "model.quantize": quantize})
    model = build_hf(cfg)
    after_load = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the steps' peak from here
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    grads = 0
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 65), generator=g)
        loss(model, x[:, :-1], x[:, 1:]).backward()
        grads = sum(stored_bytes(local_of(p.grad)) for p in trainable if p.grad is not None)
        opt.step()
        opt.zero_grad()
    optim = sum(stored_bytes(local_of(t)) for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return {"params": sum(stored_bytes(local_of(p)) for p in model.parameters()) / MB,
            "grads": grads / MB, "optimizer": optim / MB, "rss_after_load": after_load,
            "peak_rss_steps": _status("VmHWM"),
            "peak_rss_all": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.hf_tokenizer import save_tokenizer  # a tokenizer trained here, offline

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "llama")
        cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden,
                          intermediate_size=args.mlp, num_hidden_layers=args.layers,
                          num_attention_heads=8, num_key_value_heads=8,
                          max_position_embeddings=128, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        save_tokenizer(folder)
        res = {kind: run_distributed(_run, args.world, folder, q, args.rank, args.steps,
                                     timeout_s=1200, collective_timeout_s=600)
               for kind, q in (("bf16 LoRA", ""), ("QLoRA nf4", "nf4"))}
    print(f"Llama {args.layers} layers, hidden {args.hidden}, MLP {args.mlp}: {n / 1e6:.1f}M "
          f"parameters, bf16; LoRA rank {args.rank}; {args.world} ranks; MiB per rank "
          "(max over ranks)")
    print(f"{'':22}{'bf16 LoRA':>12}{'QLoRA nf4':>12}{'ratio':>9}")
    rows: dict[str, list[float]] = {}
    for key, label in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                       (None, "params+grads+optim"), ("rss_after_load", "RSS after load"),
                       ("peak_rss_steps", "peak RSS (steps)"),
                       ("peak_rss_all", "peak RSS (all)")):
        vals = []
        for kind in res:
            per = [(sum(r[k] for k in ("params", "grads", "optimizer")) if key is None
                    else r[key]) for r in res[kind]]
            vals.append(max(per))
        rows[label] = vals
        print(f"{label:22}{vals[0]:12.1f}{vals[1]:12.1f}{vals[1] / vals[0]:9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": n, "rows": rows, "raw": res}, f, indent=2)


if __name__ == "__main__":
    main()
