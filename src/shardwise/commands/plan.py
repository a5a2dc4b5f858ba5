"""`shardwise plan`: will it fit, and how fast, before anyone rents a cluster.

    shardwise plan --model 7b --world-size 8 --mixed-precision bf16 --device h100-80gb \\
        --batch-size 1 --seq-len 4096
    shardwise plan --params 7.5e9 --world-size 64 --device h100-80gb --interconnect ib-400g
    shardwise plan --config llama3-70b --world-size 64 --tp 8 --device h100-80gb \
        --mixed-precision bf16 --activation-checkpointing    # or --config path/to/config.json
    shardwise plan --calibrate            # measure this machine, predict `shardwise train`
    shardwise plan --model.hf DIR --lora.rank 8 --model.quantize nf4 --world-size 2
        # QLoRA as `shardwise train` runs it: NF4 base, adapters, their gradients and AdamW
        # state, the dequantization peak; batch 1 x the run's sequence length by default

Prints the chosen strategy's per-rank table, then every strategy side by side, marking the
one that fits and runs fastest. `--json` prints `Plan.to_dict()` instead.
"""

from __future__ import annotations

import argparse
import json

from ..engine.core.policies import STRATEGY_NAMES as STRATEGIES
from ..planner import report as R
from ..train.config import Config as TrainConfig
from ..train.options import field_docs
from ._args import Parser, at_least, finite, report


def _parser() -> argparse.ArgumentParser:
    from ..planner.hf_config import ARCHITECTURES, PRESETS
    from ..planner.memory import OPTIMIZERS
    from ..planner.profiles import DEVICES, INTERCONNECTS

    ap = Parser(prog="shardwise plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--params", type=float, help="a bare parameter count, e.g. 7.5e9")
    what.add_argument("--model", help="a GPT preset from shardwise.train.model (tiny ... 13b) "
                      f"or a Hugging Face preset ({', '.join(PRESETS)})")
    what.add_argument("--config", help="a Hugging Face config.json (or its folder) of a "
                      f"{', '.join(sorted(ARCHITECTURES))} model, or a preset: "
                      f"{', '.join(PRESETS)}")
    ap.add_argument("--world-size", type=int, help="ranks (default 8; --calibrate: --nproc)")
    ap.add_argument("--strategy", default="FULL_SHARD", type=str.upper,
                    help=f"{', '.join(STRATEGIES)} (default FULL_SHARD); all are compared")
    ap.add_argument("--mixed-precision", default="fp32", help="fp32 (default), bf16 or fp16")
    ap.add_argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZERS)}")
    ap.add_argument("--device", help=f"{', '.join(DEVICES)} or cpu")
    ap.add_argument("--interconnect", help=f"between nodes: {', '.join(INTERCONNECTS)}")
    ap.add_argument("--ranks-per-node", type=int, help="default: the device's (8)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: Megatron plan per block, FSDP over "
                         "world-size / tp ranks (default 1: FSDP alone)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp: split the residual stream by sequence across the TP "
                         "group (reduce-scatter + all-gather instead of all-reduce)")
    ap.add_argument("--tp-embeddings", default="split", choices=("split", "replicate"),
                    help="with --tp: the embedding and output head split across the TP group "
                         "by vocabulary rows (split, the default: torchtitan's plan, loss "
                         "parallel) or whole on every TP rank (replicate: as shardwise train "
                         "--parallel.tp runs its GPT)")
    ap.add_argument("--batch-size", type=int, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int,
                    help="tokens per sequence (default: the model's context length, with batch "
                         "1 unless --batch-size is given)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="keep only each block's input; recompute the block in backward")
    ap.add_argument("--cpu-offload", action="store_true",
                    help="model states in host memory; the optimizer steps on the host")
    ap.add_argument("--coalesce-bytes", type=int, default=None, metavar="N",
                    help="units whose all-gathers fit N bytes together share collectives "
                         "(fully_shard's coalesce_bytes; default 4 MiB, 0: each alone)")
    ap.add_argument("--wrap", default="transformer", choices=("transformer", "none"),
                    help="one unit per block (default) or the root only")
    shape = ap.add_argument_group("shape of a bare count (else guessed)")
    for flag in ("layers", "hidden", "heads", "vocab"):
        shape.add_argument(f"--{flag}", type=int)
    shape.add_argument("--ffn", type=int, help="MLP hidden width (default 4 x --hidden)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this machine (gloo, local ranks) and predict a local run")
    ap.add_argument("--nproc", type=int, default=2, help="ranks for --calibrate (default 2)")
    ap.add_argument("--json", action="store_true", help="print Plan.to_dict() as JSON")
    ft = ap.add_argument_group(
        "fine-tuning, as `shardwise train` takes it (same names, values and checks; the model "
        "from --model.hf DIR or --config; batch 1 x the run's training length by default)")
    docs = {s: field_docs(type(getattr(TrainConfig(), s))) for s in ("model", "lora")}
    for key in FINETUNE_KEYS:
        section, _, name = key.partition(".")
        ft.add_argument(f"--{key}", dest=key, metavar="VALUE", help=docs[section][name])
    return ap


# `shardwise train`'s options that change what a fine-tune holds.
FINETUNE_KEYS = ("model.hf", "model.dtype", "model.block_size", "model.quantize",
                 "model.nf4_block_size", "model.nf4_scaler_block_size", "model.nf4_skip",
                 "lora.rank", "lora.targets")


def _finetune(args: argparse.Namespace) -> tuple[object, object] | None:
    """(train's model section, its lora section) from the fine-tuning options, converted and
    checked as `shardwise train` does; None when none is given."""
    given = {k: getattr(args, k) for k in FINETUNE_KEYS if getattr(args, k) is not None}
    if not given:
        return None
    from ..train import options as O
    from ..train.hf_deps import require
    from ..train.qlora import check_quantize

    model = O.build_section("model", {k: v for k, v in given.items() if k.startswith("model.")})
    lora = O.build_section("lora", {k: v for k, v in given.items() if k.startswith("lora.")})
    named = ", ".join(f"--{k}" for k in given)
    if model.hf and (args.config or args.model or args.params):
        raise ValueError(f"--model.hf={model.hf!r} names the model, and so does "
                         f"{'--config' if args.config else '--model' if args.model else '--params'}"
                         ": give one")
    if not model.hf and not args.config:
        raise ValueError(f"{named} plan a fine-tune of a Hugging Face model: give --model.hf "
                         "DIR (the folder `shardwise train` reads) or --config (its "
                         "config.json, or a preset)")
    if lora.rank:
        require(f"lora.rank={lora.rank}", "peft")
    if model.quantize:
        check_quantize(model.quantize, lora.rank, args.strategy)
    return model, lora


def _finetune_model(args: argparse.Namespace, model: object,
                    lora: object) -> tuple[object, int, str]:
    """The fine-tune's meta model (train's own builder), its training length and a label."""
    from ..planner.hf_config import read_config
    from ..train.config import training_length
    from ..train.hf_deps import require
    from ..train.hf_folder import config as folder_config
    from ..train.hf_folder import positions_of
    from ..train.hf_model import meta_model

    if model.hf:  # type: ignore[attr-defined]
        d, where = folder_config(model.hf), f"model.hf={model.hf!r}"  # type: ignore[attr-defined]
        hf_config = None
    else:
        require(f"--config={args.config} with fine-tuning options", "transformers")
        import transformers as tf

        try:
            d, where = read_config(args.config)
        except ValueError as e:
            raise ValueError(f"--config={args.config}: {e}") from None
        hf_config = tf.AutoConfig.for_model(**d)
    seq = training_length(model.block_size, positions_of(d), where)  # type: ignore[attr-defined]
    meta = meta_model(model, lora, hf_config)  # type: ignore[arg-type]
    trained = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    label = f"{d.get('model_type', 'model')} ({where}, {model.dtype})"  # type: ignore[attr-defined]
    if lora.rank:  # type: ignore[attr-defined]
        targets = sorted(meta.peft_config["default"].target_modules)
        label += (f", LoRA rank {lora.rank} on {','.join(targets)} "  # type: ignore[attr-defined]
                  f"({R.count(trained)} trained)")
    else:
        label += ", full fine-tune"
    if model.quantize:  # type: ignore[attr-defined]
        spec = model.nf4()  # type: ignore[attr-defined]
        label += f", NF4 base (blocks {spec.block_size} x {spec.scaler_block_size})"
    return meta, seq, label


def _model_and_shape(args: argparse.Namespace) -> tuple[object, dict | None, str]:
    from ..planner.hf_config import PRESETS, load_shape

    config = args.config or (args.model if args.model and args.model.lower() in PRESETS
                             else None)
    if config:
        given = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "ffn")
                 if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{' '.join(given)}: a config ({config}) carries its own shape; "
                             "the shape options are only for --params")
        try:
            shape, label = load_shape(config)
        except ValueError as e:
            raise ValueError(f"--config={config}: {e}") from None
        return shape, None, f"config {label}"
    if args.model:
        import torch

        from ..train.model import GPT, preset

        args.model = args.model.lower()  # `7B` names the preset `7b`
        try:
            cfg = preset(args.model)
        except ValueError as e:  # the GPT presets' names, then the Hugging Face ones
            raise ValueError(f"{e}; or a Hugging Face preset: {', '.join(PRESETS)}") from None
        with torch.device("meta"):
            model = GPT(cfg)
        return model, None, f"GPT '{args.model}'"
    shape = None
    given = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    if any(v is not None for v in given.values()):
        missing = [f"--{k}" for k, v in given.items() if v is None and k != "vocab"]
        if missing:
            raise ValueError(f"a shape needs --layers, --hidden and --heads; missing {missing}")
        shape = {"n_layers": given["layers"], "d_model": given["hidden"],
                 "n_heads": given["heads"],
                 "vocab_size": 32000 if given["vocab"] is None else given["vocab"],
                 "ffn_dim": args.ffn or 0}
    return args.params, shape, f"{R.count(args.params)} parameters"


def _plan_all(args: argparse.Namespace, what: object, shape: dict | None,
              device: object, interconnect: object) -> dict[str, object]:
    from ..planner import plan
    from ..planner.plan import plan_one

    out = {}
    for s in STRATEGIES:
        try:  # alternatives only for the chosen strategy: the others are one row each
            fn = plan if s == args.strategy else plan_one
            kw = {"quantize": args.quantize} if args.quantize is not None else {}
            out[s] = fn(what, world_size=args.world_size, sharding_strategy=s, rank=0,
                          auto_wrap_policy=None if args.wrap == "none" else "transformer",
                          mixed_precision=args.mixed_precision, optimizer=args.optimizer,
                          cpu_offload=args.cpu_offload, batch_size=args.batch_size,
                          seq_len=args.seq_len,
                          activation_checkpointing=args.activation_checkpointing,
                          device=device, interconnect=interconnect, shape=shape,
                          ranks_per_node=args.ranks_per_node, tensor_parallel=args.tp,
                          sequence_parallel=args.sequence_parallel,
                          tp_embeddings=args.tp_embeddings,
                          coalesce_bytes=args.coalesce_bytes, **kw)
        except ValueError as e:  # e.g. HYBRID_SHARD when the node size does not divide
            if s == args.strategy:
                raise
            out[s] = e
    return out


def _best(plans: dict[str, object]) -> str | None:
    """The strategy that fits and runs fastest; steps within 2% of the fastest count as a
    tie (the model is not that precise), broken by the smaller memory peak. Without times:
    the smallest memory peak."""
    ok = {s: p for s, p in plans.items() if not isinstance(p, Exception) and p.fits is not False}
    if not ok:
        return None
    if all(p.time is not None for p in ok.values()):
        fastest = min(p.time.step_s for p in ok.values())
        ok = {s: p for s, p in ok.items() if p.time.step_s <= 1.02 * fastest}
    return min(ok, key=lambda s: ok[s].per_rank.total_bytes)


def _compare(plans: dict[str, object], best: str | None) -> list[str]:
    head = (f"  {'strategy':<15} {'states':>10} {'total':>10} {'fits':>5} {'max b':>6} "
            f"{'sent/rank':>10} {'step':>9} {'MFU':>5}")
    out = ["every strategy, side by side (* fits and runs fastest; steps within 2% of the "
           "fastest tie, and the one needing less memory wins; fits ?: model states fit, "
           "activations unknown):", head]
    for s, p in plans.items():
        if isinstance(p, Exception):
            out.append(f"  {s:<15} n/a: {p}")
            continue
        fits = ("-" if p.verdict is None else "?") if p.fits is None else (
            "yes" if p.fits else "no")
        mb = "-" if p.max_batch_size is None else str(p.max_batch_size)
        step = R.secs(p.time.step_s) if p.time else "-"
        mfu = f"{100 * p.time.mfu:.0f}%" if p.time else "-"
        mark = "*" if s == best else " "
        out.append(f"{mark} {s:<15} {R.size(p.per_rank.model_states_bytes):>10} "
                   f"{R.size(p.per_rank.total_bytes):>10} {fits:>5} {mb:>6} "
                   f"{R.size(p.comm.sent_bytes):>10} {step:>9} {mfu:>5}")
    return out


def _calibrate(args: argparse.Namespace, what: object,
               shape: dict | None) -> tuple[object, object, str]:
    """Measure this machine with the model's own matmul and attention shapes."""
    from ..planner.calibrate import calibrate
    from ..planner.shape import TransformerShape, coerce_shape, shape_of_model
    from ..planner.units import synthetic_shape

    if isinstance(what, TransformerShape):  # from a config
        s: TransformerShape | None = what
    else:
        s = (shape_of_model(what) if not isinstance(what, (int, float)) else  # type: ignore[arg-type]
             coerce_shape(shape) or synthetic_shape(int(what)))
    b, t = args.batch_size or 1, args.seq_len or 128
    d, h = (s.d_model, s.n_heads) if s else (1024, 8)
    ffn = s.ffn_dim if s else 4 * d
    head_dim = s.head_dim if s else d // h
    cal = calibrate(args.nproc, matmul=(b * t, d, ffn), attention=(b, h, t, head_dim))
    bw = ", ".join(f"{k} {v / 2**30:.2f} GiB/s" for k, v in cal.collective_bandwidth.items())
    line = (f"calibrated {args.nproc} local ranks x {cal.threads} threads (wall clock, the "
            f"machine's load included): {cal.flops['fp32'] / 1e9:.1f} GFLOP/s fp32 matmul "
            f"per rank, attention at {100 * cal.attention_efficiency:.0f}% of it, memory "
            f"{cal.memory_bandwidth / 2**30:.1f} GiB/s, gloo {bw}, latency "
            f"{cal.latency_s * 1e6:.0f} us")
    return cal.device(), cal.interconnect(), line


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.strategy not in STRATEGIES:
        ap.error(f"--strategy={args.strategy!r} is not one of: {', '.join(STRATEGIES)}")
    finite(ap, "params", args.params, 1.0)
    # 0 must not quietly mean "the default": only an absent option does.
    for flag in ("world_size", "ranks_per_node", "batch_size", "seq_len", "nproc", "layers",
                 "hidden", "heads", "vocab", "tp", "ffn"):
        at_least(ap, flag.replace("_", "-"), getattr(args, flag), 1)
    device: object = args.device
    interconnect: object = args.interconnect
    header = []
    try:
        if args.calibrate and not (args.params or args.model or args.config
                                   or getattr(args, "model.hf")):
            args.model, args.batch_size = "small", args.batch_size or 8  # train's defaults
        ft = _finetune(args)
        if ft is None and args.params is None and args.model is None and args.config is None:
            ap.error("give --params N, --model PRESET, --config PATH or --model.hf DIR (or "
                     "--calibrate)")
        args.world_size = args.world_size or (args.nproc if args.calibrate else 8)
        args.quantize = None
        if ft is not None:
            what, seq, label = _finetune_model(args, *ft)
            shape = None
            if args.seq_len is None:
                args.seq_len = seq  # as `shardwise train` trains it, not the context length
            if ft[0].quantize:  # type: ignore[attr-defined]
                args.quantize = ft[0].nf4()  # type: ignore[attr-defined]
        else:
            what, shape, label = _model_and_shape(args)
        if args.calibrate:
            device, interconnect, line = _calibrate(args, what, shape)
            header.append(line)
        plans = _plan_all(args, what, shape, device, interconnect)
    except ValueError as e:
        return report("shardwise plan", e)
    chosen = plans[args.strategy]
    if args.json:
        print(json.dumps(chosen.to_dict(), indent=2))
        return 0
    p = chosen
    print(f"shardwise plan: {R.headline(p, label)}")
    for line in header:
        print(line)
    print()
    for line in R.table(p):  # what `print(sw.plan(...))` shows too
        print(line)
    print()
    for line in _compare(plans, _best(plans)):
        print(line)
    return 0
