"""The checks `shardwise train`'s configuration sections run in `__post_init__` (config.py):
each failure is a ValueError naming the field (`section.name`), the value and what is
allowed, raised before any process starts."""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from typing import Any


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, f"{section}.{name}={value!r} is not one of: {', '.join(allowed)}")


def typed(section: str, obj: Any) -> None:
    """Every field has its declared type (floats finite), so a later comparison cannot
    raise TypeError or let inf/NaN through; ints given for a float field become floats."""
    hints = typing.get_type_hints(type(obj))
    prefix = f"{section}." if section else ""
    for f in fields(obj):
        typ, v = hints[f.name], getattr(obj, f.name)
        if typ not in (bool, int, float, str):
            continue
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
            setattr(obj, f.name, v)
        ok = isinstance(v, typ) and (typ is bool or not isinstance(v, bool))
        if typ is float:
            ok = ok and math.isfinite(v)
        kind = "a finite float" if typ is float else f"a {typ.__name__}"
        check(ok, f"{prefix}{f.name}={v!r} is not allowed: must be {kind}")


def positive(section: str, obj: Any, *names: str, zero_ok: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = v >= 0 if zero_ok else v > 0
        key = f"{section}.{name}" if section else name  # top-level keys have no section
        check(ok, f"{key}={v!r} must be {'>= 0' if zero_ok else '> 0'}")
