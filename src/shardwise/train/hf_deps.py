"""The optional Hugging Face libraries (`pip install 'shardwise[hf]'`): transformers for
`--model.hf`, peft for LoRA. Checked without importing them (an import costs seconds), so a
missing one is one line naming the install command, before any process starts, instead of a
traceback from every rank."""

from __future__ import annotations

import importlib.util

INSTALL = "pip install 'shardwise[hf]'"


def missing(*modules: str) -> list[str]:
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):  # a broken or blocked package
            found = False
        if not found:
            out.append(m)
    return out


def require(what: str, *modules: str) -> None:
    """A ValueError naming `what` needs and the install command when a module is absent."""
    gone = missing(*modules)
    if gone:
        raise ValueError(f"{what} needs {' and '.join(gone)}, which "
                         f"{'is' if len(gone) == 1 else 'are'} not installed: {INSTALL}")
