"""`shardwise generate PATH --prompt TEXT`: sample text from a trained model, in one process.

PATH is a run folder (runs/NAME: its latest checkpoint, or --checkpoint step-N) or an export
folder: a Hugging Face one (config.json: `shardwise export --hf`, or any save_pretrained
folder) or the built-in GPT's (shardwise_gpt.json). A run is exported to a temporary folder
first (a LoRA run's adapters merged), then loaded like an export.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ._args import Parser, at_least, finite, report

PROG = "shardwise generate"


def _load(folder: str):  # -> (logits fn, codec, block size)
    import torch

    from shardwise.train.hf_export import GPT_SHAPE, load_gpt
    from shardwise.train.sampling import ByteCodec, HFCodec

    if os.path.isfile(os.path.join(folder, GPT_SHAPE)):
        gpt = load_gpt(folder)
        return (lambda x: gpt(x)), ByteCodec(), gpt.cfg.block_size
    from shardwise.train.hf_deps import require

    require(f"a Hugging Face folder ({folder!r})", "transformers")
    from transformers import AutoModelForCausalLM

    from shardwise.train.hf_folder import has_tokenizer, max_positions

    if not has_tokenizer(folder):
        raise ValueError(f"{folder!r} has no tokenizer files (tokenizer.json, or vocab.json "
                         "and merges.txt)")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                 dtype=torch.float32).eval()
    codec = HFCodec(folder)
    # Stop where `model.generate` stops: at the generation config's end ids (Llama 3 lists
    # several), not only at the tokenizer's one.
    stop = getattr(model.generation_config, "eos_token_id", None)
    if stop is not None:
        codec.eos = stop
    return (lambda x: model(input_ids=x).logits), codec, max_positions(folder)


def _chat(logits, codec, args: argparse.Namespace, block: int) -> str:  # noqa: ANN001
    """The model's reply to the prompt as a user message (the reply's text only)."""
    import torch

    from shardwise.train.sampling import HFCodec, sample_ids

    if not isinstance(codec, HFCodec):
        raise ValueError("--chat needs a Hugging Face model with a tokenizer; the built-in GPT "
                         "reads bytes")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = torch.tensor([codec.encode_chat(messages)], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    out = sample_ids(logits, ids, args.max_new_tokens, block, temperature=args.temperature,
                     top_k=args.top_k, generator=gen, eos=codec.eos)
    return codec.decode(out[0, ids.shape[1]:].tolist())


def main(argv: list[str]) -> int:
    ap = Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a run folder (runs/NAME) or an export folder")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=100, metavar="N",
                    help="tokens to sample at most (default 100; stops early at EOS)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="default 0.8; 0: greedy (the most likely token)")
    ap.add_argument("--top-k", type=int, default=40, help="default 40")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--checkpoint", default="", metavar="step-N",
                    help="with a run folder: this checkpoint instead of the latest (best: the "
                         "lowest validation loss, checkpoints/best)")
    ap.add_argument("--chat", action="store_true",
                    help="the prompt is a user message: render it with the tokenizer's chat "
                         "template (as training rendered chat data) and print the reply only")
    ap.add_argument("--system", default="", metavar="TEXT",
                    help="with --chat: a system message before the user's")
    args = ap.parse_args(argv)
    at_least(ap, "max-new-tokens", args.max_new_tokens, 1)
    at_least(ap, "top-k", args.top_k, 1)
    finite(ap, "temperature", args.temperature, 0.0)
    if args.system and not args.chat:
        ap.error("--system needs --chat")
    if not args.prompt:
        ap.error("--prompt='' is not allowed: give some text to continue")
    if not os.path.isdir(args.path):
        ap.error(f"path={args.path!r} is not allowed: no such folder (give a run folder or an "
                 "export folder)")
    import torch

    from shardwise.checkpoint.manifest import CheckpointError
    from shardwise.train import rundir
    from shardwise.train.hf_export import export_run
    from shardwise.train.sampling import sample_text

    try:
        run = os.path.abspath(args.path)
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.path
            if os.path.isfile(os.path.join(run, "config.toml")):
                from pathlib import Path

                found = rundir.checkpoints(Path(run))
                if not found:
                    raise ValueError(f"run folder {args.path!r} holds no checkpoint yet")
                if args.checkpoint == "best":
                    ckpt = Path(run) / rundir.CKPT_DIR / "best"
                    if not (ckpt / "manifest.json").is_file():
                        raise ValueError(f"run folder {args.path!r} has no best checkpoint "
                                         "(checkpoints/best: written at evaluations when "
                                         "checkpoint.best is on)")
                else:
                    step, ckpt = rundir.chosen(Path(run), args.checkpoint) if args.checkpoint \
                        else found[-1]
                folder = os.path.join(tmp, "export")
                export_run(str(ckpt), folder)
                print(f"{PROG}: {ckpt.name} of {args.path}", file=sys.stderr)
            elif args.checkpoint:
                raise ValueError("--checkpoint needs a run folder, not an export folder")
            elif not os.path.isfile(os.path.join(folder, "config.json")) and not \
                    os.path.isfile(os.path.join(folder, "shardwise_gpt.json")):
                raise ValueError(f"path={args.path!r} is neither a run folder (config.toml) "
                                 "nor an export folder (config.json or shardwise_gpt.json)")
            torch.manual_seed(args.seed)
            logits, codec, block = _load(folder)
            # The sampling flags reach the sampler (they were parsed and then dropped, so
            # --temperature 0 still sampled at 0.8 among the top 40).
            if args.chat:
                text = _chat(logits, codec, args, block)
            else:
                text = sample_text(logits, codec, args.prompt, args.max_new_tokens, block,
                                   args.seed, torch.device("cpu"),
                                   temperature=args.temperature, top_k=args.top_k)
    except (CheckpointError, ValueError, OSError) as e:
        return report(PROG, e)
    print(text)
    return 0
