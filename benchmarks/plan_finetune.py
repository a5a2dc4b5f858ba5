"""`shardwise plan` of a LoRA / QLoRA fine-tune beside the same run measured (2 gloo ranks).

    .venv/bin/python benchmarks/plan_finetune.py [--world 2] [--layers 4] [--hidden 1024]
        [--mlp 2048] [--positions 128] [--steps 2] [--out benchmarks/results/plan-finetune.json]

The folder is a Llama config (vocab 512, untied head) saved with `save_pretrained` (fp32)
into a temporary folder, with a tokenizer trained here. Each row is one `shardwise train
--model.hf DIR ...` configuration:

- planned: `shardwise plan --model.hf DIR <the same options> --world-size 2 --json` (rank 0;
  batch 1 x the run's training length unless the row names a batch);
- measured: the run built as `shardwise train` builds it (build_hf on its Config, the
  trainer's AdamW and loss, gradients clipped) for `--steps` steps on random tokens, in
  fresh ranks (tests/dist/plan_workers.py `finetune_case`): the bytes held after a step
  (params: an NF4 shard's inner tensors; gradients and AdamW state: their storages) and the
  peak RSS growth over the steps above RSS before building (after a warm-up run of the
  same configuration; glibc serves allocations above 64 KiB with mmap so RSS follows live
  bytes), the larger of the two ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests package

from shardwise.testing import run_distributed  # noqa: E402
from tests.dist.plan_workers import finetune_case  # noqa: E402

MB = 2**20
# (label, train options, batch: None = the plan's default, 1)
ROWS = (
    ("QLoRA nf4, fp32, batch 1", {"lora.rank": "8", "model.quantize": "nf4"}, None),
    ("QLoRA nf4, fp32, batch 8", {"lora.rank": "8", "model.quantize": "nf4"}, 8),
    ("QLoRA nf4, bf16, batch 1", {"lora.rank": "8", "model.quantize": "nf4",
                                  "model.dtype": "bf16"}, None),
    ("LoRA, fp32, batch 1", {"lora.rank": "8"}, None),
)


def planned(folder: str, options: dict[str, str], world: int, batch: int | None) -> dict:
    from shardwise.commands.plan import main

    argv = ["--model.hf", folder, "--world-size", str(world), "--json"]
    for k, v in options.items():
        argv += [f"--{k}", v]
    if batch is not None:
        argv += ["--batch-size", str(batch)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, argv
    return json.loads(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=128,
                    help="max_position_embeddings: the run's training length (<= 1024)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.hf_tokenizer import save_tokenizer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "llama")
        cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden,
                          intermediate_size=args.mlp, num_hidden_layers=args.layers,
                          num_attention_heads=8, num_key_value_heads=8,
                          max_position_embeddings=args.positions, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        save_tokenizer(folder)
        for label, options, batch in ROWS:
            p = planned(folder, options, args.world, batch)
            b, seq = p["batch_size"], p["seq_len"]
            runs = run_distributed(finetune_case, args.world, folder, options, b, seq,
                                   args.steps, timeout_s=1800, collective_timeout_s=900)
            results.append({"row": label, "options": options, "batch": b, "seq": seq,
                            "plan": p["per_rank"], "measured": runs})
    print(f"Llama {args.layers} layers, hidden {args.hidden}, MLP {args.mlp}, vocab 512: "
          f"{n / 1e6:.1f}M parameters; {args.world} ranks; MiB per rank (measured: the larger "
          "rank)")
    head = (f"{'':28}{'params':>17}{'grads':>15}{'optimizer':>15}{'dequant':>8}"
            f"{'peak':>21}{'ratio':>7}")
    print(head)
    print(f"{'':28}{'plan / run':>17}{'plan / run':>15}{'plan / run':>15}{'plan':>8}"
          f"{'plan / run (RSS)':>21}{'':>7}")
    for r in results:
        pr, runs = r["plan"], r["measured"]
        held = {k: max(x["held"][k] for x in runs) for k in ("params", "grads", "optimizer")}
        peak = max(x["rss_growth"] for x in runs)
        cells = [f"{pr[k + '_bytes'] / MB:7.2f} / {held[k] / MB:7.2f}"
                 for k in ("params", "grads", "optimizer")]
        name = f"{r['row']} ({r['batch']}x{r['seq']})"
        print(f"{name:28}{cells[0]:>17}{cells[1]:>15}"
              f"{cells[2]:>15}{pr['dequant_bytes'] / MB:8.2f}"
              f"{pr['total_bytes'] / MB:10.2f} / {peak / MB:8.2f}"
              f"{peak / pr['total_bytes']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": n, "rows": results}, f, indent=2,
                      default=str)


if __name__ == "__main__":
    main()
