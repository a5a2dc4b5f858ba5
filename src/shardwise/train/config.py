"""The typed configuration of `shardwise train`: one dataclass per section.

Each section's docstring documents every field as `name: text` (more-indented lines continue
it); those lines are what `--help` shows (options.py; a test checks that no field is
undocumented). Validation runs in `__post_init__`, so a bad value fails before any process
starts, naming the field, the value and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.core.policies import CONFIG_STRATEGY_NAMES as STRATEGIES
from ..engine.core.policies import DEFAULT_COALESCE_BYTES
from .config_outputs import CheckpointSection, LogSection, LoraSection
from .model import PRESETS, GPTConfig, preset
from .validate import check as _check
from .validate import choice as _choice
from .validate import positive as _positive
from .validate import typed as _typed

WRAP_POLICIES = ("transformer", "size", "none")
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "linear", "constant")
ON_NONFINITE = ("stop", "skip")
QUANTIZE = ("", "nf4")


@dataclass
class ModelSection:
    """The model: a named preset, optionally reshaped, or a Hugging Face folder.

    preset: model shape from train/model.py PRESETS (tiny, small, medium, 124m, ..., 7b, 13b).
    n_layer: override the preset's number of blocks (0: keep the preset's).
    d_model: override the preset's width (0: keep).
    n_head: override the preset's attention heads (0: keep).
    block_size: override the preset's context length; training sequences have this length
        (0: keep; with hf: the smaller of 1024 and the model's max_position_embeddings).
    hf: a local Hugging Face model folder (config.json, safetensors weights, tokenizer files)
        to fine-tune instead of the built-in GPT; each rank reads only its shards of the weights.
    dtype: storage dtype of the weights (and so of the optimizer's master copy): fp32, bf16 or
        fp16. Compute and communication follow shard.mixed_precision.
    quantize: "" or nf4 (QLoRA; needs model.hf and lora.rank): the frozen base's linear
        weights, all but lm_head, held as torchao NF4 (4 bits) quantized from model.dtype,
        each rank quantizing its own rows; embeddings, norms and lm_head stay in model.dtype.
    nf4_block_size: with quantize=nf4: values per NF4 scaler (torchao's block_size; an even
        int, default 64). Each rank's shard of a weight must hold a multiple of
        nf4_block_size x nf4_scaler_block_size values: smaller blocks fit more world sizes.
    nf4_scaler_block_size: with quantize=nf4: scalers per quantization factor (torchao's
        scaler_block_size; an even int, default 256).
    nf4_skip: with quantize=nf4: linear modules kept in model.dtype, comma-separated names
        (a full module name or its last parts: "lm_head,mlp.down_proj").
    """

    preset: str = "small"
    n_layer: int = 0
    d_model: int = 0
    n_head: int = 0
    block_size: int = 0
    hf: str = ""
    dtype: str = "fp32"
    quantize: str = ""
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256
    nf4_skip: str = "lm_head"

    def __post_init__(self) -> None:
        _typed("model", self)
        self.nf4()  # refuses odd or tiny block sizes, naming the option
        bad = [t for t in (n.strip() for n in self.nf4_skip.split(","))
               if t and not all(p.isidentifier() for p in t.split("."))]
        _check(not bad, f"model.nf4_skip={self.nf4_skip!r} is not allowed: give "
               "comma-separated module names such as lm_head,mlp.down_proj")
        _choice("model", "preset", self.preset, tuple(PRESETS))
        _positive("model", self, "n_layer", "d_model", "n_head", "block_size", zero_ok=True)
        _choice("model", "dtype", self.dtype, DTYPES)
        _check(self.quantize in QUANTIZE, f"model.quantize={self.quantize!r} is not allowed: "
               "give nf4 (QLoRA: a 4-bit frozen base) or leave it empty")
        if self.hf:
            from .hf_deps import require
            from .hf_folder import check_folder

            require(f"model.hf={self.hf!r}", "transformers")
            self.hf = str(Path(self.hf).expanduser().resolve())
            check_folder(self.hf)
            for k in ("n_layer", "d_model", "n_head"):
                _check(not getattr(self, k), f"model.{k}={getattr(self, k)} cannot reshape "
                       f"a pretrained model (model.hf={self.hf!r}); leave it 0")
            self.seq_len()  # raises if block_size exceeds the model's positions
        else:
            self.gpt()  # raises if the overrides make an impossible shape

    def nf4(self) -> Any:
        """The NF4 spec of a QLoRA run (checkpoint.quantize.NF4) from the model.nf4_* options."""
        from ..checkpoint.quantize import NF4

        try:
            return NF4(self.nf4_block_size, self.nf4_scaler_block_size,
                       tuple(n.strip() for n in self.nf4_skip.split(",") if n.strip()))
        except ValueError as e:
            raise ValueError(str(e).replace("NF4.", "model.nf4_")) from None

    def seq_len(self) -> int:
        """The length of the training sequences."""
        if not self.hf:
            return self.gpt().block_size
        from .hf_folder import max_positions

        return training_length(self.block_size, max_positions(self.hf), f"model.hf={self.hf!r}")

    def gpt(self) -> GPTConfig:
        overrides = {k: getattr(self, k) for k in ("n_layer", "d_model", "n_head", "block_size")
                     if getattr(self, k)}
        return preset(self.preset, **overrides)


HF_SEQ_LEN = 1024  # a Hugging Face model's training sequences, unless model.block_size says


def training_length(block_size: int, positions: int, source: str) -> int:
    """The training sequence length of a Hugging Face model with `positions` positions:
    model.block_size, or the smaller of HF_SEQ_LEN and the model's positions (a Qwen2's
    131,072-token context is what it can read, not what a fine-tune trains on)."""
    if not block_size:
        return min(HF_SEQ_LEN, positions)
    _check(block_size <= positions, f"model.block_size={block_size} exceeds the "
           f"model's max_position_embeddings={positions} ({source})")
    return block_size


@dataclass
class DataSection:
    """Training data: text read as bytes (vocabulary 256) for the built-in GPT; with model.hf,
    text, prompt/completion or chat records tokenized by the model's own tokenizer.

    path: a text file or a folder of them (read recursively, sorted); with model.hf also
        JSONL records (docs/training.md). Stored absolute in the run's config.toml.
        "" = the Python standard library's .py sources (the built-in GPT only).
    max_bytes: the built-in GPT: read at most this many bytes of text (a deterministic subset
        of the files). Refused with model.hf, which tokenizes all of data.path.
    val_fraction: the last part of the (deterministically shuffled) text held out for validation.
    seed: seed of the file order and of each epoch's sequence order.
    reset: with --resume / --resume-from when the data, tokenizer or model differ from the
        run's: keep the checkpoint's weights but start a fresh data position, learning-rate
        schedule and optimizer state (up to train.steps in all); without it such a resume is
        refused.
    cache_dir: with model.hf: where tokenized data is cached, keyed by (data, tokenizer)
        ("": <out_dir>/token-cache).
    mix: with model.hf, instead of path: several sources drawn by weight,
        "a.parquet:0.7,b.jsonl:0.3" (each a file, folder or saved dataset).
    eval_path: with model.hf: a separate evaluation set (a file, folder or saved dataset);
        "" = hold out val_fraction of every source's documents (seeded by seed).
    packing: with model.hf: pack documents into full sequences, each document attending only
        to itself (true), or one document per row padded per batch (false).
    """

    path: str = ""
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    seed: int = 1234
    reset: bool = False
    cache_dir: str = ""
    mix: str = ""
    eval_path: str = ""
    packing: bool = True

    def __post_init__(self) -> None:
        _typed("data", self)
        _check(not (self.path and self.mix), f"data.path={self.path!r} and data.mix="
               f"{self.mix!r} contradict each other: give one (data.mix lists every source)")
        if self.mix:
            from .hf_inputs import parse_mix

            # Absolute, as data.path below.
            self.mix = ",".join(f"{Path(p).expanduser().resolve()}:{w!r}"
                                for p, w in parse_mix(self.mix))
        _check(not self.eval_path or Path(self.eval_path).expanduser().exists(),
               f"data.eval_path={self.eval_path!r} does not exist (give a file, a folder or "
               "a saved dataset)")
        if self.eval_path:
            self.eval_path = str(Path(self.eval_path).expanduser().resolve())
        _positive("data", self, "max_bytes")
        _check(0.0 < self.val_fraction < 0.5,
               f"data.val_fraction={self.val_fraction!r} must be in (0, 0.5)")
        if self.path:
            _check(Path(self.path).expanduser().exists(),
                   f"data.path={self.path!r} does not exist (give a text file or a folder)")
            # Absolute, so that a --resume from another directory reads the same data.
            self.path = str(Path(self.path).expanduser().resolve())

        c = Path(self.cache_dir).expanduser()
        _check(not self.cache_dir or c.is_dir() or not c.exists(),
               f"data.cache_dir={self.cache_dir!r} is not allowed: it is a file (give a "
               "folder, or a path where one can be made)")
        if self.cache_dir:
            self.cache_dir = str(c.resolve())

    def cache(self, out_dir: str = "runs") -> str:
        return self.cache_dir or str(Path(out_dir).expanduser() / "token-cache")


@dataclass
class TrainSection:
    """The optimization.

    steps: optimizer steps to train for: the run's total, counted from its first step, also
        on --resume and with --data.reset (0: from train.epochs).
    epochs: passes over the training split to train for instead of train.steps (0: use
        train.steps); with --data.reset, passes over the new data after the resumed step.
    batch_size: sequences per rank per micro-batch.
    grad_accum: micro-batches per optimizer step (gradients accumulate locally,
        without communication).
    lr: peak learning rate (AdamW).
    min_lr_ratio: learning rate at the end of the schedule, as a fraction of lr (0.1: decay
        to lr / 10; 0: to zero), so that it follows any --train.lr.
    warmup_steps: steps of linear warm-up from 0 to lr.
    warmup_ratio: warm-up as a fraction of the run's steps, instead of warmup_steps (0: use
        warmup_steps).
    schedule: decay after warm-up: cosine, linear or constant.
    weight_decay: AdamW decoupled weight decay on matrices (not on norms).
    beta1: AdamW beta1.
    beta2: AdamW beta2.
    grad_clip: clip the global gradient norm to this (0: no clipping, the norm is still logged).
    seed: seed of the model's initialization.
    eval_interval: steps between validation passes (0: only at the end).
    eval_batches: N > 0: each validation pass evaluates the first N batches per rank of a
        fixed seeded order (a sample, the same every pass; 8, the built-in GPT's default:
        covering its 3,125 held-out sequences every 100 steps made `make run` 26-30% slower);
        0: the whole evaluation set, every counted token once across ranks (the default with
        model.hf). The run's header says which.
    on_nonfinite: on a non-finite loss or gradient norm: stop (exit 3, naming the step) or
        skip (drop that optimizer step; see docs/training.md).
    max_skipped_steps: with on_nonfinite=skip, stop once more than this many steps in a row
        were skipped.
    activation_checkpointing: recompute each block's activations in backward instead of
        keeping them (less memory, about a third more compute).
    compile: compile each block with torch.compile (the first steps pay for compilation).
    optim_in_backward: step each parameter's AdamW as its reduced gradient lands in backward
        and free that gradient at once (less memory: no rank holds every gradient). Same
        losses as the default; needs grad_clip 0 (the global norm exists only once every
        parameter has stepped) and on_nonfinite stop.
    """

    steps: int = 1000
    epochs: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    warmup_ratio: float = 0.0
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 100
    eval_batches: int = 8
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 10
    activation_checkpointing: bool = False
    compile: bool = False
    optim_in_backward: bool = False

    def __post_init__(self) -> None:
        _typed("train", self)
        if self.optim_in_backward:
            # [Note: optimizer in backward] in optim.py.
            _check(self.grad_clip == 0, f"train.optim_in_backward cannot clip: train.grad_clip="
                   f"{self.grad_clip!r} needs the global gradient norm, which exists only after "
                   "every parameter has stepped; set train.grad_clip 0 (the norm is still "
                   "logged) or leave train.optim_in_backward off")
            _check(self.on_nonfinite == "stop", "train.optim_in_backward cannot skip a step: "
                   f"train.on_nonfinite={self.on_nonfinite!r}, but each parameter has stepped "
                   "before the loss and norm are known; use on_nonfinite stop")
        _positive("train", self, "batch_size", "grad_accum", "lr")
        _positive("train", self, "steps", "epochs", "warmup_steps", "weight_decay", "grad_clip",
                  "eval_interval", "max_skipped_steps", "eval_batches", zero_ok=True)
        _check((self.steps > 0) != (self.epochs > 0),
               f"train.steps={self.steps} and train.epochs={self.epochs}: give one of them "
               "(the run's length in optimizer steps, or in passes over the training data)")
        _check(0.0 <= self.warmup_ratio < 1.0,
               f"train.warmup_ratio={self.warmup_ratio!r} must be in [0, 1)")
        _check(not (self.warmup_steps and self.warmup_ratio),
               f"train.warmup_steps={self.warmup_steps} and train.warmup_ratio="
               f"{self.warmup_ratio}: give one of them")
        _choice("train", "schedule", self.schedule, SCHEDULES)
        _choice("train", "on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"train.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1] (a fraction of lr)")
        for b in ("beta1", "beta2"):
            v = getattr(self, b)
            _check(0.0 <= v < 1.0, f"train.{b}={v!r} must be in [0, 1)")


@dataclass
class ShardSection:
    """The four FSDP knobs (see docs/design.md).

    sharding_strategy: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP),
        HYBRID_SHARD (shard within a node, replicate across nodes) or HYBRID_SHARD_ZERO2
        (FSDP1's _HYBRID_SHARD_ZERO2: HYBRID_SHARD keeping parameters from forward to backward).
    auto_wrap_policy: which modules become units: transformer (each Block),
        size (>= 100k parameters) or none (one unit).
    mixed_precision: compute and communication dtype: fp32, bf16 or fp16 (master weights stay fp32).
    cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
    coalesce_bytes: consecutive units whose all-gathers are this small or smaller share one
        all-gather and one reduce-scatter, up to this many gathered bytes (0: each unit
        alone, as FSDP2; fully_shard's option of the same name).
    """

    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: str = "transformer"
    mixed_precision: str = "fp32"
    cpu_offload: bool = False
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES

    def __post_init__(self) -> None:
        _typed("shard", self)
        self.sharding_strategy = self.sharding_strategy.upper().replace("-", "_")
        if self.sharding_strategy == "_HYBRID_SHARD_ZERO2":  # FSDP1's member name
            self.sharding_strategy = "HYBRID_SHARD_ZERO2"
        _choice("shard", "sharding_strategy", self.sharding_strategy, STRATEGIES)
        _choice("shard", "auto_wrap_policy", self.auto_wrap_policy, WRAP_POLICIES)
        _choice("shard", "mixed_precision", self.mixed_precision, PRECISIONS)
        _check(self.coalesce_bytes >= 0, f"shard.coalesce_bytes={self.coalesce_bytes} must "
               "be >= 0 (0: each unit gathers and reduces alone)")


@dataclass
class ParallelSection:
    """Parallelism beyond data parallel (see docs/parallelism.md).

    tp: tensor-parallel degree: each block's attention heads and MLP hidden units are split
        over tp ranks (Megatron's plan) and FSDP shards over the remaining world / tp ranks;
        the ranks of one TP group train on the same batch. 1: FSDP alone.
    """

    tp: int = 1

    def __post_init__(self) -> None:
        _typed("parallel", self)
        _positive("parallel", self, "tp")


@dataclass
class Config:
    """A training run.

    name: run folder name under out_dir ("" = <preset>-<n>, the next free n;
        with --resume: the latest run).
    out_dir: where run folders live.
    nproc: local worker processes (0 = the GPU count on CUDA, else 2); ignored under torchrun.
    resume: continue the run folder's latest checkpoint (at any nproc).
    resume_from: continue the run folder from this checkpoint (step-N, or N); implies resume.
        Later checkpoints are kept until the run saves over them.
    overwrite: delete an existing run folder of the same name first.
    threads: torch CPU threads per rank (0 = the cores this process may use, less those
        other processes keep busy, divided by the local ranks; at least 1).
    trace: write a Chrome/Perfetto trace of log.trace_steps steps into the run folder's
        trace/ and print the overlap report (exposed communication per step).
    max_restarts: with --nproc, restart all workers up to this many times after one fails;
        each restart resumes from the run's latest checkpoint (under torchrun, pass
        torchrun's own --max-restarts instead).
    """

    name: str = ""
    out_dir: str = "runs"
    nproc: int = 0
    resume: bool = False
    resume_from: str = ""
    overwrite: bool = False
    threads: int = 0
    trace: bool = False
    max_restarts: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    shard: ShardSection = field(default_factory=ShardSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        _typed("", self)
        _positive("", self, "nproc", "threads", "max_restarts", zero_ok=True)
        if self.resume_from:
            m = re.fullmatch(r"(?:step-)?0*(\d+)", self.resume_from)
            _check(m is not None, f"resume_from={self.resume_from!r} is not allowed: give a "
                   "checkpoint as step-N (a folder name under the run's checkpoints/) or N")
            self.resume_from = f"step-{int(m.group(1)):07d}" if m else ""
            self.resume = True
        _check(not (self.resume and self.overwrite),
               "--resume and --overwrite contradict each other: pick one")
        _check("/" not in self.name and self.name not in (".", ".."),
               f"name={self.name!r} must be a plain folder name")
        out = Path(self.out_dir).expanduser()
        _check(bool(self.out_dir) and (out.is_dir() or not out.exists()),
               f"out_dir={self.out_dir!r} is not allowed: must be a folder (or a path where "
               "one can be made), not empty and not a file")
        tp = self.parallel.tp
        if self.model.hf:
            _check(bool(self.data.path or self.data.mix), f"model.hf={self.model.hf!r} needs "
                   "data.path (or data.mix): text, JSON/JSONL, parquet or arrow files, a "
                   "folder, or a saved dataset (text, prompt/completion or chat messages)")
            _check(tp == 1, f"parallel.tp={tp} is not supported with model.hf (the TP plan is "
                   "the built-in GPT's); use tp=1")
            if self.lora.rank:
                from .hf_deps import require

                require(f"lora.rank={self.lora.rank}", "peft")
            if self.model.quantize:
                from .qlora import check_quantize

                check_quantize(self.model.quantize, self.lora.rank,
                               self.shard.sharding_strategy)
        else:
            _check(self.lora.rank == 0, f"lora.rank={self.lora.rank} needs model.hf: LoRA "
                   "adapts a Hugging Face model's linear layers (the built-in GPT has none)")
            _check(not self.model.quantize, f"model.quantize={self.model.quantize!r} needs "
                   "model.hf and lora.rank: QLoRA quantizes a Hugging Face base model's "
                   "linear weights and trains LoRA adapters beside them")
            d = self.data
            for name, bad in (("mix", d.mix), ("eval_path", d.eval_path),
                              ("packing", not d.packing)):
                _check(not bad, f"data.{name}={getattr(d, name)!r} needs model.hf (the "
                       "built-in GPT reads byte text from data.path)")
            _check(bool(self.log.sample_prompt), "log.sample_prompt must not be empty (the "
                   "built-in GPT samples from a prompt)")
        if tp > 1:
            from .tensor_parallel import check_tp

            g = self.model.gpt()
            check_tp(tp, g.n_head, g.d_model, g.ffn_dim)
            _check(self.shard.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"),
                   f"parallel.tp={tp} composes with shard.sharding_strategy FULL_SHARD or "
                   f"SHARD_GRAD_OP, not {self.shard.sharding_strategy} (HSDP x TP and "
                   "DDP x TP are library-only: docs/parallelism.md)")
            _check(not self.shard.cpu_offload,
                   f"parallel.tp={tp} with shard.cpu_offload=true is not supported")
        _check(not (self.train.optim_in_backward and self.shard.mixed_precision == "fp16"),
               "train.optim_in_backward with shard.mixed_precision=fp16 is not supported: "
               "fp16's loss scaling must see every gradient before any step; use bf16 or fp32")
        _check(bool(self.model.hf) or self.model.gpt().vocab_size >= 256,
               f"model.preset={self.model.preset!r} has vocab_size < 256; byte text needs 256")


SECTIONS = ("model", "data", "train", "shard", "parallel", "lora", "checkpoint", "log")
