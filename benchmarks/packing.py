"""What isolating packed documents costs, and what packing saves: one training step
(forward, backward) of a small Llama on the same documents, side by side in one run:

- packed, positions restart per document (block-diagonal causal mask: shardwise's default);
- packed, one causal mask over the whole row (documents see each other: what shardwise did
  before position restarts);
- unpacked: one document per row, padded to the longest row of the batch.

Documents have lengths drawn log-uniformly between --min-len and --max-len tokens (random
ids). Rows are built by shardwise.train.token_parts, as training builds them. Printed: step
time per row layout, counted targets per step, and counted targets per second, with ratios
against the packed default.

    .venv/bin/python benchmarks/packing.py [--seq 512] [--batch 4] [--steps 6] [--attn sdpa]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from shardwise.train import token_parts as P
from shardwise.train.token_cache import TokenData


def _docs(n: int, lo: int, hi: int, vocab: int, seed: int) -> TokenData:
    g = np.random.default_rng(seed)
    lens = np.exp(g.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)
    tokens = g.integers(2, vocab, int(lens.sum())).astype(np.uint16)
    docs = np.cumsum(np.append(0, lens[:-1]))
    meta = {"eos_id": 1, "tokens": len(tokens), "documents": n}
    return TokenData(tokens, np.ones(len(tokens), np.uint8), docs, "bench", meta, Path("."),
                     False)


def _model(attn: str, vocab: int, seq: int) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(seq, 1024), use_cache=False,
                         attn_implementation=attn)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
          pos: torch.Tensor | None) -> float:
    t = time.perf_counter()
    logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout (median)")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    vocab = 2000
    data = _docs(4000, a.min_len, a.max_len, vocab, seed=0)
    pieces = P.pieces(data, a.seq + 1)
    every = np.ones(len(pieces.start), dtype=bool)
    packed = P.TokenPart(data, pieces, every, a.seq, packed=True)
    padded = P.TokenPart(data, pieces, every, a.seq, packed=False)
    model = _model(a.attn, vocab, a.seq)
    g = np.random.default_rng(1)
    layouts = {"packed, isolated": lambda i: packed.rows(i),
               "packed, one causal mask": lambda i: (*packed.rows(i)[:2], None),
               "unpacked (padded)": lambda i: padded.rows(i)}
    sizes = {"packed, isolated": len(packed), "packed, one causal mask": len(packed),
             "unpacked (padded)": len(padded)}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    counted: dict[str, list[int]] = {k: [] for k in layouts}
    for rep in range(a.steps + 1):  # interleaved: machine noise hits every layout alike
        for name, rows in layouts.items():
            x, y, pos = rows(g.integers(0, sizes[name], a.batch))
            dt = _step(model, x, y, pos)
            if rep:  # the first round warms up
                times[name].append(dt)
                counted[name].append(int((y != -100).sum()))
    base = "packed, isolated"
    med = {k: float(np.median(v)) for k, v in times.items()}
    rate = {k: float(np.sum(counted[k]) / np.sum(times[k])) for k in times}
    print(f"Llama 4x256, seq {a.seq}, batch {a.batch}, {a.attn} attention, "
          f"{torch.get_num_threads()} threads; documents {a.min_len}-{a.max_len} tokens "
          f"(log-uniform), {a.steps} steps each, interleaved")
    print(f"{'layout':26} {'step ms':>8} {'vs isolated':>11} {'targets/step':>13} "
          f"{'targets/s':>10} {'vs isolated':>11}")
    for k in layouts:
        print(f"{k:26} {med[k] * 1e3:8.1f} {med[k] / med[base]:10.2f}x "
              f"{np.mean(counted[k]):13.0f} {rate[k]:10.0f} {rate[k] / rate[base]:10.2f}x")


if __name__ == "__main__":
    main()
