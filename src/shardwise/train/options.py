"""Where a `shardwise train` config comes from: defaults < TOML file < `--section.key value`.

Flat dotted keys (`train.lr`, `name`) are the common currency: TOML tables flatten to them,
the command line is parsed into them, and `build` turns them into a validated `Config`.
`--help` is generated from the sections' field docs.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from .config import SECTIONS, Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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
    """A validated Config from flat dotted keys (`train.lr`, `name`) -> raw values. Keys not
    given take the dataclass defaults, or those that what was given implies (a `model.hf`
    run's fine-tuning defaults: [Note: fine-tuning defaults] in finetune.py)."""
    from .finetune import implied_defaults

    values = {**implied_defaults(values), **values}
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


def build_section(section: str, values: dict[str, Any]) -> Any:
    """One validated section of the config (`model`, `lora`, ...) from flat dotted keys of
    that section, converted and checked as `build` converts and checks them; keys not given
    take the section's defaults. For a command that takes some of train's options under
    train's names (`shardwise plan --model.hf DIR --lora.rank 8`)."""
    cls = _section_types(Config)[section]
    types = _section_types(cls)
    kw = {}
    for key, raw in values.items():
        prefix, _, name = key.rpartition(".")
        if prefix != section or name not in types:
            raise _unknown(key, [f"{section}.{n}" for n in types])
        kw[name] = _convert(key, raw, types[name])
    return cls(**kw)


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
