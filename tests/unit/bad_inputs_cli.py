"""Every CLI option given a bad value: exit status 2 and `shardwise <cmd>: error: <message>`.

Rows of the same table as bad_inputs.py (docs/errors.md is generated from both).
"""

from __future__ import annotations

from pathlib import Path

from .bad_inputs import NO_SUCH, Case

NOT_TOML = str(Path(__file__).resolve().parents[2] / "src" / "shardwise" / "__init__.py")
A_FILE = NOT_TOML
CONFIGS = str(Path(__file__).resolve().parent / "configs")  # configs plan must refuse


def cli(argv: str | list[str], bad: str, expect: str, knob: str | None = None) -> Case:
    args = tuple(argv.split()) if isinstance(argv, str) else tuple(argv)
    if knob is None:
        # The option under test is the last one given (earlier ones only make a valid call).
        opt = next((a.split("=")[0] for a in reversed(args[1:]) if a.startswith("--")), "")
        knob = f"shardwise {args[0]} {opt}".strip()
    return Case(knob, bad, expect, argv=args)


def train(key: str, bad: str, expect: str) -> Case:
    return cli(["train", f"--{key}", bad], bad, expect)


NA = "is not allowed"
TRAIN_CASES = [
    train("name", "a/b", "name='a/b' must be a plain folder name"),
    train("out_dir", A_FILE, f"out_dir='{A_FILE}' {NA}: must be a folder"),
    train("nproc", "-1", "nproc=-1 must be >= 0"),
    train("resume", "maybe", "resume='maybe' is not a valid bool"),
    train("overwrite", "2", "overwrite='2' is not a valid bool"),
    train("threads", "-1", "threads=-1 must be >= 0"),
    train("trace", "maybe", "trace='maybe' is not a valid bool"),
    train("max_restarts", "-1", "max_restarts=-1 must be >= 0"),
    train("model.preset", "huge", "model.preset='huge' is not one of: tiny"),
    train("model.n_layer", "-1", "model.n_layer=-1 must be >= 0"),
    train("model.d_model", "abc", "model.d_model='abc' is not a valid int"),
    train("model.n_head", "7", "n_head=7 must divide d_model"),
    train("model.block_size", "-1", "model.block_size=-1 must be >= 0"),
    train("data.path", NO_SUCH, f"data.path='{NO_SUCH}' does not exist"),
    train("data.max_bytes", "0", "data.max_bytes=0 must be > 0"),
    train("data.val_fraction", "0.9", "data.val_fraction=0.9 must be in (0, 0.5)"),
    train("data.val_fraction", "nan", f"data.val_fraction=nan {NA}: must be a finite float"),
    train("data.seed", "x", "data.seed='x' is not a valid int"),
    train("train.steps", "0", "train.steps=0 and train.epochs=0.0: give one of them"),
    train("train.epochs", "-1", "train.epochs=-1.0 must be >= 0"),
    train("train.warmup_ratio", "1", "train.warmup_ratio=1.0 must be in [0, 1)"),
    train("train.steps", "1.5", "train.steps='1.5' is not a valid int"),
    train("train.batch_size", "0", "train.batch_size=0 must be > 0"),
    train("train.optim_in_backward", "true",
          "train.optim_in_backward cannot clip: train.grad_clip=1.0 needs the global"),
    train("train.grad_accum", "0", "train.grad_accum=0 must be > 0"),
    train("train.lr", "inf", f"train.lr=inf {NA}: must be a finite float"),
    train("train.lr", "0", "train.lr=0.0 must be > 0"),
    train("train.min_lr_ratio", "1.5", "train.min_lr_ratio=1.5 must be in [0, 1]"),
    train("train.warmup_steps", "-1", "train.warmup_steps=-1 must be >= 0"),
    train("train.schedule", "step", "train.schedule='step' is not one of: cosine, linear, "
          "constant"),
    train("train.weight_decay", "-0.1", "train.weight_decay=-0.1 must be >= 0"),
    train("train.beta1", "1", "train.beta1=1.0 must be in [0, 1)"),
    train("train.beta2", "nan", f"train.beta2=nan {NA}: must be a finite float"),
    train("train.grad_clip", "-1", "train.grad_clip=-1.0 must be >= 0"),
    train("train.seed", "x", "train.seed='x' is not a valid int"),
    train("train.eval_interval", "-1", "train.eval_interval=-1 must be >= 0"),
    train("train.eval_batches", "-1", "train.eval_batches=-1 must be >= 0"),
    train("train.on_nonfinite", "ignore", "train.on_nonfinite='ignore' is not one of: stop, skip"),
    train("train.max_skipped_steps", "-1", "train.max_skipped_steps=-1 must be >= 0"),
    train("shard.sharding_strategy", "ZERO3", "shard.sharding_strategy='ZERO3' is not one of: "
          "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"),
    train("shard.auto_wrap_policy", "blocks", "shard.auto_wrap_policy='blocks' is not one of: "
          "transformer, size, none"),
    train("shard.mixed_precision", "int8", "shard.mixed_precision='int8' is not one of: fp32, "
          "bf16, fp16"),
    train("shard.cpu_offload", "maybe", "shard.cpu_offload='maybe' is not a valid bool"),
    train("shard.coalesce_bytes", "-5", "shard.coalesce_bytes=-5 must be >= 0"),
    train("parallel.tp", "0", "parallel.tp=0 must be > 0"),
    train("parallel.tp", "3", "parallel.tp=3 must divide model.n_head=4"),
    cli("train --parallel.tp 2 --shard.sharding_strategy HYBRID_SHARD", "HYBRID_SHARD",
        "parallel.tp=2 composes with shard.sharding_strategy FULL_SHARD or SHARD_GRAD_OP",
        knob="shardwise train --parallel.tp (strategy)"),
    cli("train --nproc 3 --parallel.tp 2", "3 ranks", "parallel.tp=2 must divide the world "
        "size 3 (ranks are dp x tp); allowed here: [1]",
        knob="shardwise train --parallel.tp (world size)"),
    train("model.hf", NO_SUCH, f"model.hf='{NO_SUCH}' is not a folder"),
    train("model.hf", str(Path(NOT_TOML).parent), f"model.hf='{Path(NOT_TOML).parent}' has "
          "no config.json"),
    train("model.dtype", "int8", "model.dtype='int8' is not one of: fp32, bf16, fp16"),
    train("data.cache_dir", A_FILE, f"data.cache_dir='{A_FILE}' {NA}: it is a file"),
    train("data.reset", "maybe", "data.reset='maybe' is not a valid bool"),
    train("data.mix", f"{NO_SUCH}:1", f"data.mix='{NO_SUCH}:1': '{NO_SUCH}' does not exist"),
    train("data.mix", A_FILE, f"data.mix='{A_FILE}': '{A_FILE}' {NA}: give PATH:WEIGHT"),
    train("data.eval_path", NO_SUCH, f"data.eval_path='{NO_SUCH}' does not exist"),
    train("data.packing", "maybe", "data.packing='maybe' is not a valid bool"),
    train("checkpoint.best", "2", "checkpoint.best='2' is not a valid bool"),
    train("train.activation_checkpointing", "maybe",
          "train.activation_checkpointing='maybe' is not a valid bool"),
    train("train.compile", "2", "train.compile='2' is not a valid bool"),
    train("lora.rank", "-1", "lora.rank=-1 must be >= 0"),
    train("lora.rank", "4", "lora.rank=4 needs model.hf"),
    train("model.quantize", "int4", f"model.quantize='int4' {NA}: give nf4"),
    train("model.quantize", "nf4", "model.quantize='nf4' needs model.hf and lora.rank"),
    train("model.nf4_block_size", "3", "model.nf4_block_size=3 is not allowed: an even int"),
    train("model.nf4_scaler_block_size", "0", "model.nf4_scaler_block_size=0 is not allowed"),
    train("model.nf4_skip", "lm head", "model.nf4_skip='lm head' is not allowed: give "
          "comma-separated module names"),
    train("lora.alpha", "-1", "lora.alpha=-1.0 must be >= 0"),
    train("lora.targets", "q_proj,,v_proj", f"lora.targets='q_proj,,v_proj' {NA}"),
    train("lora.dropout", "1", "lora.dropout=1.0 must be in [0, 1)"),
    train("resume_from", "latest", f"resume_from='latest' {NA}: give a checkpoint as step-N"),
    train("checkpoint.interval", "-1", "checkpoint.interval=-1 must be >= 0"),
    train("checkpoint.keep", "0", "checkpoint.keep=0 must be > 0"),
    train("checkpoint.stop_signal", "KILL", "checkpoint.stop_signal='KILL' is not one of: "
          "SIGUSR1, SIGUSR2, SIGHUP, SIGALRM"),
    train("log.event_steps", "-2", "log.event_steps=-2 must be >= -1"),
    train("log.sample_tokens", "-1", "log.sample_tokens=-1 must be >= 0"),
    train("log.sample_prompt", "", "log.sample_prompt must not be empty"),
    train("log.trace_steps", "0", "log.trace_steps=0 must be > 0"),
    train("log.trace_after", "-1", "log.trace_after=-1 must be >= 0"),
    train("log.to", "nope", "log.to='nope' is not allowed: unknown sink 'nope'"),
    train("log.peak_tflops", "-1", "log.peak_tflops=-1.0 must be >= 0"),
    cli(["train", "--config", NO_SUCH], "(no such file)", f"config file '{NO_SUCH}' does not "
        "exist"),
    cli(["train", "--config", NOT_TOML], "(not TOML)", "is not valid TOML"),
    cli("train --train.lrr 1", "--train.lrr", "unknown option 'train.lrr'; did you mean train.lr",
        knob="shardwise train (unknown option)"),
    cli("train steps", "steps", "unexpected argument 'steps'",
        knob="shardwise train (positional)"),
    cli("train --train.steps", "(no value)", "--train.steps needs a value",
        knob="shardwise train --train.steps"),
    cli("train --resume --overwrite", "both", "--resume and --overwrite contradict each other",
        knob="shardwise train --resume --overwrite"),
]

IGNORED = "ignored explicit argument 'yes'"
PLAN_CASES = [
    cli("plan --params -5", "-5", f"--params=-5.0 {NA}: must be a finite number >= 1"),
    cli("plan --params inf", "inf", "--params=inf"),
    cli("plan --params 7b", "7b", "argument --params: invalid float value: '7b'"),
    cli("plan --model huge", "huge", "model preset 'huge' is not one of: tiny"),
    cli("plan --model tiny --params 1e9", "both", "not allowed with argument",
        knob="shardwise plan --model --params"),
    cli("plan", "(neither)", "give --params N, --model PRESET, --config PATH or --model.hf DIR",
        knob="shardwise plan (no model)"),
    cli("plan --config llama9", "llama9", "--config=llama9: 'llama9' is neither a preset "
        "(llama3-8b, llama3-70b, llama3-405b, qwen2-7b, mixtral-8x7b)"),
    cli(["plan", "--config", f"{CONFIGS}/bert"], "a BERT config.json", "model_type='bert' is "
        "not supported; supported: gemma, gpt2, llama, mistral, mixtral, qwen2",
        knob="shardwise plan --config (architecture)"),
    cli(["plan", "--config", f"{CONFIGS}/llama-no-layers"], "a config without a field",
        "the field 'num_hidden_layers' is missing", knob="shardwise plan --config (field)"),
    cli(["plan", "--config", A_FILE], "not JSON", "not a readable JSON file",
        knob="shardwise plan --config (not JSON)"),
    cli("plan --config llama3-8b --layers 4", "--layers with --config", "a config "
        "(llama3-8b) carries its own shape", knob="shardwise plan --config --layers"),
    cli("plan --model llama3-8b --ffn 64", "--ffn with a preset", "carries its own shape",
        knob="shardwise plan --model --ffn"),
    cli("plan --params 1e9 --tp-embeddings yes", "yes",
        "argument --tp-embeddings: invalid choice: 'yes'"),
    cli("plan --params 1e9 --world-size 0", "0", f"--world-size=0 {NA}: must be >= 1"),
    cli("plan --params 1e9 --strategy ZERO3", "ZERO3", "--strategy='ZERO3' is not one of: "
        "FULL_SHARD"),
    cli("plan --params 1e9 --mixed-precision int8", "int8", "mixed_precision='int8' is not "
        "allowed"),
    cli("plan --params 1e9 --optimizer lion", "lion", "optimizer='lion' is not one of"),
    cli("plan --params 1e9 --device tpu", "tpu", "device='tpu' is not one of"),
    cli("plan --params 1e9 --interconnect wifi", "wifi", "interconnect='wifi' is not one of"),
    cli("plan --params 1e9 --ranks-per-node 0", "0", "--ranks-per-node=0"),
    cli("plan --params 1e9 --batch-size 0", "0", "--batch-size=0"),
    cli("plan --params 1e9 --seq-len -1", "-1", "--seq-len=-1"),
    cli("plan --params 1e9 --coalesce-bytes -3", "-3", "coalesce_bytes=-3 must be None"),
    cli("plan --params 1e9 --activation-checkpointing=yes", "yes", IGNORED),
    cli("plan --params 1e9 --cpu-offload=yes", "yes", IGNORED),
    cli("plan --params 1e9 --wrap size", "size", "argument --wrap: invalid choice: 'size'"),
    cli("plan --params 1e9 --layers 0", "0", "--layers=0"),
    cli("plan --params 1e9 --hidden -1", "-1", "--hidden=-1"),
    cli("plan --params 1e9 --heads x", "x", "argument --heads: invalid int value: 'x'"),
    cli("plan --params 1e9 --vocab 0", "0", "--vocab=0"),
    cli("plan --params 1e9 --layers 2", "(no --hidden/--heads)", "a shape needs --layers, "
        "--hidden and --heads", knob="shardwise plan --layers (alone)"),
    cli("plan --params 1e9 --tp 0", "0", "--tp=0"),
    cli(["plan", "--model.hf", A_FILE], "a file", f"model.hf='{A_FILE}' is not a folder"),
    cli("plan --config llama3-8b --model.dtype fp8", "fp8", "model.dtype='fp8' is not one of"),
    cli("plan --config llama3-8b --model.block_size -1", "-1", "model.block_size=-1"),
    cli("plan --config llama3-8b --model.quantize int4", "int4",
        "model.quantize='int4' is not allowed"),
    cli("plan --config llama3-8b --model.nf4_block_size 3", "3",
        "model.nf4_block_size=3 is not allowed: an even int >= 2"),
    cli("plan --config llama3-8b --model.nf4_scaler_block_size x", "x",
        "model.nf4_scaler_block_size='x' is not a valid int"),
    cli("plan --config llama3-8b --lora.rank 8 --model.quantize nf4 --model.nf4_skip "
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head", "every linear",
        "quantize=nf4 finds no frozen nn.Linear weight to quantize",
        knob="shardwise plan --model.nf4_skip"),
    cli("plan --config llama3-8b --lora.rank -1", "-1", "lora.rank=-1"),
    cli(["plan", "--config", "llama3-8b", "--lora.targets", "q proj"], "'q proj'",
        "lora.targets='q proj' is not allowed"),
    cli("plan --lora.rank 8", "(no model)", "plan a fine-tune of a Hugging Face model: give "
        "--model.hf DIR", knob="shardwise plan --lora.rank (no model)"),
    cli("plan --config llama3-8b --model.quantize nf4", "(no --lora.rank)",
        "model.quantize='nf4' needs lora.rank > 0", knob="shardwise plan --model.quantize "
        "(no LoRA)"),
    cli("plan --config llama3-8b --lora.rank 8 --model.quantize nf4 --world-size 3", "3",
        "quantize=nf4 cannot shard", knob="shardwise plan --model.quantize --world-size"),
    cli("plan --params 1e9 --world-size 8 --tp 3", "3", "tensor_parallel=3 must divide "
        "world_size=8"),
    cli("plan --params 1e9 --layers 2 --hidden 64 --heads 2 --tp 4", "4", "tensor_parallel=4 "
        "must divide the model's n_heads=2", knob="shardwise plan --tp (heads)"),
    cli("plan --params 1e9 --sequence-parallel=yes", "yes", IGNORED),
    cli("plan --params 1e9 --ffn 0", "0", "--ffn=0"),
    cli("plan --params 1e9 --calibrate=yes", "yes", IGNORED),
    cli("plan --calibrate --nproc 0", "0", "--nproc=0"),
    cli("plan --params 1e9 --json=yes", "yes", IGNORED),
    cli("plan --params 1e9 --world-sise 8", "--world-sise", "unrecognized arguments",
        knob="shardwise plan (unknown option)"),
]

BENCH_CASES = [
    cli("bench --preset huge", "huge", f"--preset='huge' {NA}: use bench30m or one of"),
    *[cli(f"bench --{f} 0", "0", f"--{f}=0 {NA}: must be >= 1")
      for f in ("batch-size", "seq-len", "nproc", "rounds", "steps", "threads")],
    cli("bench --systems deepspeed", "deepspeed", f"--systems='deepspeed' {NA}: give a "
        "comma-separated subset of"),
    cli(["bench", "--systems", ""], "''", f"--systems='' {NA}"),
    cli("bench --scaling=yes", "yes", IGNORED),
    cli("bench --no-memory=yes", "yes", IGNORED),
    cli(["bench", "--json", f"{NO_SUCH}/out.json"], "(folder missing)", f"{NA}: its folder "
        "does not exist"),
    cli("bench --device tpu", "tpu", f"--device='tpu' {NA}: use cpu or cuda"),
]

EXPLORE_CASES = [
    cli("explore --host no.such.host.invalid", "no.such.host.invalid",
        f"--host='no.such.host.invalid' {NA}"),
    cli("explore --port 70000", "70000", f"--port=70000 {NA}: must be in [0, 65535]"),
    cli("explore --port -1", "-1", f"--port=-1 {NA}: must be >= 0"),
    cli("explore --no-browser=yes", "yes", IGNORED),
    cli(["explore", "--replay", NO_SUCH], "(no such folder)", "no such run folder"),
    cli("explore --seed x", "x", "argument --seed: invalid int value: 'x'"),
    cli("explore --step-interval nan", "nan", f"--step-interval=nan {NA}: must be a finite "
        "number >= 0"),
    cli("explore --step-interval -1", "-1", "--step-interval=-1.0"),
    cli("explore --world-size 5", "5", f"--world-size=5 {NA}: must be in [1, 4]"),
]

EXPORT_CASES = [
    cli(["export", NO_SUCH, "out"], "(no such folder)", f"checkpoint='{NO_SUCH}' {NA}: no "
        "such directory", knob="shardwise export CHECKPOINT"),
    cli(["export", str(Path(NOT_TOML).parent), ""], "''", f"out='' {NA}",
        knob="shardwise export OUT"),
    cli(["export", str(Path(NOT_TOML).parent), NOT_TOML], "(a file)", f"out='{NOT_TOML}' {NA}: "
        "it is a file", knob="shardwise export OUT"),
    cli("export", "(missing)", "the following arguments are required: checkpoint, out",
        knob="shardwise export (no arguments)"),
    cli("export ckpt out --max-shard-size 0", "0", "'0' must be at least 1 byte"),
    cli("export ckpt out --max-shard-size 5XB", "5XB", "'5XB' is not a size"),
    cli("export ckpt out --no-verify=yes", "yes", IGNORED),
    cli("export ckpt out --force=yes", "yes", IGNORED),
    cli("export ckpt out --verbose=yes", "yes", IGNORED),
    cli("export ckpt out --hf --adapter", "both", "argument --adapter: not allowed with "
        "argument --hf", knob="shardwise export --hf --adapter"),
]

GENERATE_CASES = [
    cli(["generate", NO_SUCH, "--prompt", "x"], "(no such folder)", f"path='{NO_SUCH}' {NA}: "
        "no such folder", knob="shardwise generate PATH"),
    cli(["generate", str(Path(NOT_TOML).parent), "--prompt", "x"], "(not a run or export)",
        "is neither a run folder (config.toml) nor an export folder",
        knob="shardwise generate PATH (other folder)"),
    cli("generate runs/x", "(no --prompt)", "the following arguments are required: --prompt",
        knob="shardwise generate --prompt"),
    cli(["generate", "runs/x", "--prompt", ""], "''", f"--prompt='' {NA}",
        knob="shardwise generate --prompt (empty)"),
    cli("generate runs/x --prompt x --max-new-tokens 0", "0",
        f"--max-new-tokens=0 {NA}: must be >= 1"),
    cli("generate runs/x --prompt x --temperature nan", "nan", "--temperature=nan"),
    cli("generate runs/x --prompt x --top-k 0", "0", f"--top-k=0 {NA}: must be >= 1"),
    cli("generate runs/x --prompt x --system hi", "(without --chat)",
        "--system needs --chat"),
]

DEMO_CASES = [
    cli("demo --nproc 0", "0", f"--nproc=0 {NA}: must be >= 1"),
    cli("demo --steps 0", "0", f"--steps=0 {NA}: must be >= 1"),
    cli("demo --steps x", "x", "argument --steps: invalid int value: 'x'"),
]

TOP_CASES = [
    Case("shardwise COMMAND", "fit", "unknown command 'fit'; choose one of: train, plan",
         argv=("fit",)),
]

CLI_CASES = (TRAIN_CASES + PLAN_CASES + BENCH_CASES + EXPLORE_CASES + EXPORT_CASES
             + GENERATE_CASES + DEMO_CASES + TOP_CASES)
