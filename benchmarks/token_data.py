"""Token data for `--model.hf`: tokenizing once, the cache hit, and the per-step cost of
reading a batch, against the training step it feeds (all side by side, in one run).

Data: the standard library's .py sources as JSONL, once as {"text"} and once as
{"prompt": first 30% of a file, "completion": the rest}; the tests' BPE tokenizer
(tests/hf_tokenizer.py). The step: a small Llama (transformers, random weights) forward,
backward and AdamW step on the same batch shape, on this machine's CPU.

    .venv/bin/python benchmarks/token_data.py [--mb 8] [--batch 8] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests package

import torch  # noqa: E402

from shardwise.train import data as D  # noqa: E402
from shardwise.train import token_cache as TC  # noqa: E402
from shardwise.train import token_parts as P  # noqa: E402
from tests.hf_tokenizer import VOCAB_SIZE, save_tokenizer  # noqa: E402


def _write(root: Path, mb: float) -> dict[str, Path]:
    texts, total = [], 0
    for f in D.stdlib_files():
        t = f.read_text(errors="replace")
        texts.append(t)
        total += len(t)
        if total >= mb * 1e6:
            break
    paths = {"text": root / "text.jsonl", "prompt/completion": root / "pc.jsonl"}
    paths["text"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    paths["prompt/completion"].write_text("".join(
        json.dumps({"prompt": t[: len(t) * 3 // 10], "completion": t[len(t) * 3 // 10 :]})
        + "\n" for t in texts))
    return paths


def _timed(fn, n: int) -> tuple[float, float]:  # noqa: ANN001
    """(wall, CPU) seconds per call: on a shared machine the wall time includes waiting
    for a core; the CPU time is what the work costs."""
    fn()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n, (time.process_time() - c) / n


def _step_s(batch: int, seq: int, steps: int) -> tuple[float, float]:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=seq)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB_SIZE, (batch, seq))
    y = torch.randint(0, VOCAB_SIZE, (batch, seq))

    def step() -> None:
        logits = model(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="MB of text per format")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=500, help="batches timed per stream")
    ap.add_argument("--steps", type=int, default=3, help="training steps timed")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardwise-token-bench-"))
    folder = save_tokenizer(root / "model")
    paths = _write(root, a.mb)
    step = _step_s(a.batch, a.seq, a.steps)
    print(f"training step (Llama 4x256, batch {a.batch} x {a.seq}, CPU, "
          f"{torch.get_num_threads()} threads): {step[0] * 1e3:.0f} ms wall, "
          f"{step[1] * 1e3:.0f} ms CPU")
    for fmt, path in paths.items():
        mb = path.stat().st_size / 1e6
        t, c = time.perf_counter(), time.process_time()
        built = TC.prepare(path, folder, root / "cache")
        tok_s, tok_cpu = time.perf_counter() - t, time.process_time() - c
        t = time.perf_counter()
        hit = TC.prepare(path, folder, root / "cache")
        hit_s = time.perf_counter() - t
        assert built.built and not hit.built
        t = time.perf_counter()
        pieces = P.pieces(hit, a.seq + 1)
        held = P.held_out(pieces, 0.05, seed=0)
        train = P.Mixture([P.TokenPart(hit, pieces, ~held, a.seq, packed=True)], [1.0])
        split_s = time.perf_counter() - t
        stream = P.TokenBatchStream(train, a.seq, a.batch, 0, 1, seed=0)
        load = _timed(stream.next, a.batches)
        n = int(built.meta["tokens"])
        print(f"{fmt}: {mb:.1f} MB -> {n / 1e6:.2f} M tokens "
              f"({100 * int(built.meta['counted']) / n:.0f}% counted)")
        print(f"  tokenize + write once: {tok_s:.2f} s wall, {tok_cpu:.2f} s CPU "
              f"({mb / tok_cpu:.1f} MB and {n / tok_cpu / 1e6:.2f} M tokens per CPU second)")
        print(f"  second run (hash data + tokenizer, map the cache): {hit_s * 1e3:.0f} ms "
              f"({tok_s / hit_s:.0f}x faster than tokenizing)")
        print(f"  held-out split and packed windows (each run's start): {split_s * 1e3:.0f} ms")
        print(f"  one batch from the map: {load[0] * 1e6:.0f} us wall, {load[1] * 1e6:.0f} us "
              f"CPU = {100 * load[1] / step[1]:.4f}% of the step's CPU time")


if __name__ == "__main__":
    main()
