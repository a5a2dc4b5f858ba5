"""The typed configuration of `shardwise train`: defaults < TOML file < `--section.key value`.

Each section is a dataclass whose docstring documents every field as `name: text`; those
lines are what `--help` shows (a test checks that no field is undocumented). Validation runs
in `__post_init__`, so a bad value fails before any process starts, naming the field, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import PRESETS, GPTConfig, preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
WRAP_POLICIES = ("transformer", "size", "none")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "linear", "constant")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{section}.{name}={value!r} is not one of: {', '.join(allowed)}")


def _positive(section: str, obj: Any, *names: str, zero_ok: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = v >= 0 if zero_ok else v > 0
        _check(ok, f"{section}.{name}={v!r} must be {'>= 0' if zero_ok else '> 0'}")


@dataclass
class ModelSection:
    """The model: a named preset, optionally reshaped.

    preset: model shape from train/model.py PRESETS (tiny, small, medium, 124m, ..., 7b, 13b).
    n_layer: override the preset's number of blocks (0: keep the preset's).
    d_model: override the preset's width (0: keep).
    n_head: override the preset's attention heads (0: keep).
    block_size: override the preset's context length; training sequences have this length (0: keep).
    """

    preset: str = "small"
    n_layer: int = 0
    d_model: int = 0
    n_head: int = 0
    block_size: int = 0

    def __post_init__(self) -> None:
        _choice("model", "preset", self.preset, tuple(PRESETS))
        _positive("model", self, "n_layer", "d_model", "n_head", "block_size", zero_ok=True)
        self.gpt()  # raises if the overrides make an impossible shape

    def gpt(self) -> GPTConfig:
        overrides = {k: getattr(self, k) for k in ("n_layer", "d_model", "n_head", "block_size")
                     if getattr(self, k)}
        return preset(self.preset, **overrides)


@dataclass
class DataSection:
    """Training text, read as bytes (vocabulary 256).

    path: a text file or a folder of them (read recursively, sorted);
        "" = the Python standard library's .py sources.
    max_bytes: read at most this many bytes of text (a deterministic subset of the files).
    val_fraction: the last part of the (deterministically shuffled) text held out for validation.
    seed: seed of the file order and of each epoch's sequence order.
    """

    path: str = ""
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    seed: int = 1234

    def __post_init__(self) -> None:
        _positive("data", self, "max_bytes")
        _check(0.0 < self.val_fraction < 0.5,
               f"data.val_fraction={self.val_fraction!r} must be in (0, 0.5)")
        if self.path:
            _check(Path(self.path).expanduser().exists(),
                   f"data.path={self.path!r} does not exist (give a text file or a folder)")


@dataclass
class TrainSection:
    """The optimization.

    steps: optimizer steps to train for (the total, including steps before a resume).
    batch_size: sequences per rank per micro-batch.
    grad_accum: micro-batches per optimizer step (gradients accumulate locally,
        without communication).
    lr: peak learning rate (AdamW).
    min_lr: learning rate at the end of the schedule.
    warmup_steps: steps of linear warm-up from 0 to lr.
    schedule: decay after warm-up: cosine, linear or constant.
    weight_decay: AdamW decoupled weight decay on matrices (not on norms).
    beta1: AdamW beta1.
    beta2: AdamW beta2.
    grad_clip: clip the global gradient norm to this (0: no clipping, the norm is still logged).
    seed: seed of the model's initialization.
    eval_interval: steps between validation passes (0: only at the end).
    eval_batches: micro-batches per rank per validation pass.
    """

    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 100
    eval_batches: int = 8

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "batch_size", "grad_accum", "lr", "eval_batches")
        _positive("train", self, "min_lr", "warmup_steps", "weight_decay", "grad_clip",
                  "eval_interval", zero_ok=True)
        _choice("train", "schedule", self.schedule, SCHEDULES)
        _check(self.min_lr <= self.lr, f"train.min_lr={self.min_lr} must be <= train.lr={self.lr}")
        for b in ("beta1", "beta2"):
            v = getattr(self, b)
            _check(0.0 <= v < 1.0, f"train.{b}={v!r} must be in [0, 1)")


@dataclass
class ShardSection:
    """The four FSDP knobs (see DESIGN.md).

    sharding_strategy: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP) or
        HYBRID_SHARD (shard within a node, replicate across nodes).
    auto_wrap_policy: which modules become units: transformer (each Block),
        size (>= 100k parameters) or none (one unit).
    mixed_precision: compute and communication dtype: fp32, bf16 or fp16 (master weights stay fp32).
    cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
    """

    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: str = "transformer"
    mixed_precision: str = "fp32"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        self.sharding_strategy = self.sharding_strategy.upper().replace("-", "_")
        _choice("shard", "sharding_strategy", self.sharding_strategy, STRATEGIES)
        _choice("shard", "auto_wrap_policy", self.auto_wrap_policy, WRAP_POLICIES)
        _choice("shard", "mixed_precision", self.mixed_precision, PRECISIONS)


@dataclass
class CheckpointSection:
    """Sharded checkpoints in the run folder.

    interval: steps between checkpoints (0: only at the end).
    keep: how many of the latest checkpoints to keep.
    """

    interval: int = 250
    keep: int = 2

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "interval", zero_ok=True)
        _positive("checkpoint", self, "keep")


@dataclass
class LogSection:
    """What the run records besides metrics.jsonl.

    event_steps: record the engine's events (events-rank{r}.jsonl) for the first this many
        steps (-1: all, 0: none).
    sample_tokens: bytes of text to sample from the trained model at the end (0: none).
    sample_prompt: the text the sample starts from.
    """

    event_steps: int = 5
    sample_tokens: int = 300
    sample_prompt: str = "def "

    def __post_init__(self) -> None:
        _check(self.event_steps >= -1, f"log.event_steps={self.event_steps!r} must be >= -1")
        _positive("log", self, "sample_tokens", zero_ok=True)
        _check(len(self.sample_prompt.encode()) > 0, "log.sample_prompt must not be empty")


@dataclass
class Config:
    """A training run.

    name: run folder name under out_dir ("" = <preset>-<n>, the next free n;
        with --resume: the latest run).
    out_dir: where run folders live.
    nproc: local worker processes (0 = the GPU count on CUDA, else 2); ignored under torchrun.
    resume: continue the run folder's latest checkpoint (at any nproc).
    overwrite: delete an existing run folder of the same name first.
    threads: torch CPU threads per rank (0 = CPU cores / local ranks, at least 1).
    """

    name: str = ""
    out_dir: str = "runs"
    nproc: int = 0
    resume: bool = False
    overwrite: bool = False
    threads: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    shard: ShardSection = field(default_factory=ShardSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        _positive("", self, "nproc", "threads", zero_ok=True)
        _check(not (self.resume and self.overwrite),
               "--resume and --overwrite contradict each other: pick one")
        _check("/" not in self.name and self.name not in (".", ".."),
               f"name={self.name!r} must be a plain folder name")
        _check(self.model.gpt().vocab_size >= 256,
               f"model.preset={self.model.preset!r} has vocab_size < 256; byte text needs 256")


SECTIONS = ("model", "data", "train", "shard", "checkpoint", "log")


def field_docs(cls: type) -> dict[str, str]:
    """`name: text` lines of a dataclass's docstring (more-indented lines continue them)."""
    docs: dict[str, str] = {}
    last = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        name, sep, text = line.partition(": ")
        if sep and name.isidentifier():
            docs[name] = text.strip()
            last = name
        elif last and line.startswith(" ") and line.strip():
            docs[last] += " " + line.strip()
        else:
            last = None
    return docs


def _section_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(key: str, raw: Any, typ: Any) -> Any:
    """A TOML value or a command-line string -> the field's type, or a clear error."""
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
            return False
    elif typ is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                pass
    elif typ is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(raw, str):
            return raw
    raise ValueError(f"{key}={raw!r} is not a valid {typ.__name__}")


def _unknown(key: str, known: list[str]) -> ValueError:
    near = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else "; see `shardwise train --help`"
    return ValueError(f"unknown option {key!r}{hint}")


def all_keys() -> list[str]:
    keys = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    for s in SECTIONS:
        cls = _section_types(Config)[s]
        keys += [f"{s}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def build(values: dict[str, Any]) -> Config:
    """A validated Config from flat dotted keys (`train.lr`, `name`) -> raw values."""
    known = all_keys()
    top_types = _section_types(Config)
    nested: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    top: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            raise _unknown(key, known)
        section, _, name = key.rpartition(".")
        if section:
            typ = _section_types(top_types[section])[name]
            nested[section][name] = _convert(key, raw, typ)
        else:
            top[key] = _convert(key, raw, top_types[key])
    sections = {s: top_types[s](**nested[s]) for s in SECTIONS}
    return Config(**top, **sections)


def flatten_toml(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_toml(v, f"{key}."))
        else:
            out[key] = v
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """Flat dotted keys from a TOML file (tables are sections)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        with p.open("rb") as f:
            return flatten_toml(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from e


def to_flat(cfg: Config) -> dict[str, Any]:
    return flatten_toml(dataclasses.asdict(cfg))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def dumps_toml(cfg: Config) -> str:
    """The resolved config as TOML (readable back by `--config`)."""
    d = dataclasses.asdict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if k not in SECTIONS]
    for s in SECTIONS:
        lines += ["", f"[{s}]"] + [f"{k} = {_toml_value(v)}" for k, v in d[s].items()]
    return "\n".join(lines) + "\n"


def _is_bool(key: str) -> bool:
    section, _, name = key.rpartition(".")
    top = _section_types(Config)
    typ = _section_types(top[section])[name] if section else top.get(name)
    return typ is bool


def parse_argv(argv: list[str]) -> tuple[dict[str, str], str | None]:
    """`--key value`, `--key=value` and bare boolean `--flag` -> ({key: raw}, --config path)."""
    values: dict[str, str] = {}
    config_path: str | None = None
    known = all_keys() + ["config"]
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ValueError(f"unexpected argument {tok!r}: options look like --train.steps 100")
        key, eq, value = tok[2:].partition("=")
        key = key.replace("-", "_") if "." not in key else key
        if key not in known:
            raise _unknown(key, known)
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if _is_bool(key) if key != "config" else False:
                if nxt is None or nxt.startswith("--"):
                    value = "true"
                else:
                    value, i = nxt, i + 1
            elif nxt is None:
                raise ValueError(f"--{key} needs a value")
            else:
                value, i = nxt, i + 1
        if key == "config":
            config_path = value
        else:
            values[key] = value
        i += 1
    return values, config_path


def help_text() -> str:
    """Every option with its docstring and default, section by section."""
    defaults = to_flat(Config())
    lines = [
        "usage: shardwise train [--config run.toml] [--option value ...]",
        "",
        "Train a GPT with shardwise on local processes (or under torchrun). Options come from",
        "the defaults, then --config FILE (TOML: top-level keys and [section] tables), then the",
        "command line (--section.key value). The resolved config is saved as config.toml in",
        "the run folder.",
        "",
        "  --config FILE\n        a TOML file of options",
    ]

    def block(cls: type, prefix: str, names: list[str]) -> None:
        docs, types = field_docs(cls), _section_types(cls)
        for name in names:
            key = f"{prefix}{name}"
            lines.append(f"  --{key} ({types[name].__name__}, "
                         f"default {_toml_value(defaults[key])})")
            lines.append(textwrap.fill(docs.get(name, "(undocumented)"), width=96,
                                       initial_indent=" " * 8, subsequent_indent=" " * 8))

    block(Config, "", [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS])
    for s in SECTIONS:
        cls = _section_types(Config)[s]
        lines += ["", f"[{s}] {(cls.__doc__ or '').strip().splitlines()[0]}"]
        block(cls, f"{s}.", [f.name for f in dataclasses.fields(cls)])
    return "\n".join(lines)
