"""The engine's layers as docs/design.md draws them: imports flow api -> ext -> core -> comm,
no engine module imports another lazily (inside a function), and the design doc names every
engine file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "src" / "shardwise" / "engine"
ORDER = {"api": 3, "ext": 2, "core": 1, "comm": 0}


def _modules() -> list[tuple[str, Path]]:
    return [(p.parent.name, p) for p in sorted(ENGINE.glob("*/*.py"))]


def _engine_imports(path: Path, pkg: str) -> list[tuple[str, bool]]:
    """(target layer, at module level) for every relative import that stays in the engine."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    guarded = {id(n) for n in ast.walk(tree) if isinstance(n, ast.If)
               and "TYPE_CHECKING" in ast.unparse(n.test) for n in ast.walk(n)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0 or id(node) in guarded:
            continue
        if node.level == 1:
            layer = pkg
        elif node.level == 2:
            layer = (node.module or "").split(".")[0]
        else:
            continue  # leaves the engine (none should, see below)
        out.append((layer, id(node) in top))
    return out


def test_imports_flow_down_the_layers() -> None:
    up = []
    for pkg, path in _modules():
        for layer, _ in _engine_imports(path, pkg):
            if layer in ORDER and ORDER[layer] > ORDER[pkg]:
                up.append(f"{path.relative_to(ENGINE)} imports {layer}")
    assert not up, up


def test_no_lazy_imports_inside_the_engine() -> None:
    lazy = [str(path.relative_to(ENGINE)) for pkg, path in _modules()
            for _, at_top in _engine_imports(path, pkg) if not at_top]
    assert not lazy, lazy


def test_engine_imports_nothing_above_it() -> None:
    above = []
    for _, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 3:
                above.append(f"{path.relative_to(ENGINE)}: {'.' * node.level}{node.module}")
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                    node.module or "").startswith("shardwise.") and not (
                    node.module or "").startswith("shardwise.engine"):
                above.append(f"{path.relative_to(ENGINE)}: {node.module}")
    assert not above, above


def test_design_doc_names_every_engine_file() -> None:
    doc = (ROOT / "docs" / "design.md").read_text()
    missing = [f"{pkg}/{path.name}" for pkg, path in _modules()
               if path.name != "__init__.py" and path.name not in doc]
    assert not missing, missing
