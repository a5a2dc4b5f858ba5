"""The commands' argument parser: a bad option is one line on stderr and exit status 2.

argparse's own `error()` prints the whole usage block first; for a long command line that
buries the one line that says what was wrong. Every command's mistakes look the same:
`shardwise <cmd>: error: <what, the value, what is allowed>`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def report(prog: str, message: object, hint: bool | None = None) -> int:
    """Print `prog: error: message` (one line); return the exit status, 2.

    The pointer to `--help` is added for mistakes in what was typed (a message string from
    the parser, a ValueError); a damaged checkpoint or a failed collective is not something
    --help explains. `hint` overrides that choice.
    """
    text = " ".join(str(message).split())
    if hint is None:
        hint = isinstance(message, (str, ValueError))
    print(f"{prog}: error: {text}" + (f" (see `{prog} --help`)" if hint else ""),
          file=sys.stderr)
    return 2


def fail(prog: str, message: object) -> NoReturn:
    raise SystemExit(report(prog, message))


def at_least(ap: argparse.ArgumentParser, flag: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        ap.error(f"--{flag}={value} is not allowed: must be >= {minimum}")


def finite(ap: argparse.ArgumentParser, flag: str, value: float | None,
           minimum: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        ap.error(f"--{flag}={value} is not allowed: must be a finite number{bound}")
