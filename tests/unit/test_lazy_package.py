"""[Note: lazy package] in shardwise/__init__.py: the public API loads on first use, so the
commands that need little of it (export, generate, the train launcher) do not pay for it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import shardwise

API = Path(shardwise.__file__).with_name("_api.py")


def test_all_lists_exactly_what_api_imports() -> None:
    tree = ast.parse(API.read_text())
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                for a in n.names if n.module != "__future__"}
    assert imported == set(shardwise.__all__)
    for name in shardwise.__all__:
        assert getattr(shardwise, name) is not None, name
    assert set(shardwise.__all__) <= set(dir(shardwise))


def test_commands_import_without_the_engine_api() -> None:
    code = ("import sys\n"
            "import shardwise.cli, shardwise.commands.export, shardwise.commands.generate\n"
            "heavy = [m for m in ('torch._dynamo', 'shardwise.engine.api.fully_shard',\n"
            "                     'shardwise.planner', 'transformers') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", out
