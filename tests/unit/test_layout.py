"""The engine's layers as docs/design.md draws them: imports flow api -> ext -> core -> comm,
no engine module imports another lazily (inside a function), no two engine files import each
other (type-only imports count: a circle of them is a reader's circle too), each class is
whole in its file, and the design doc names every engine file."""

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


def _graph() -> dict[str, set[str]]:
    """Engine file -> engine files it imports, type-only imports included."""
    out: dict[str, set[str]] = {}
    for pkg, path in _modules():
        me = f"{pkg}.{path.stem}"
        deps = out.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level not in (1, 2):
                continue
            base = pkg if node.level == 1 else (node.module or "").split(".")[0]
            if node.module and (node.level == 1 or "." in node.module):
                deps.add(node.module if node.level == 2 else f"{pkg}.{node.module}")
            else:
                deps.update(f"{base}.{a.name}" for a in node.names)
        deps.discard(me)
    return out


def test_no_import_circles_type_only_ones_included() -> None:
    graph = _graph()
    circles = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                circles.append(" -> ".join(path[path.index(v):] + [v]))
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    assert not circles, circles


def test_core_imports_nothing_from_api_or_ext_for_types_either() -> None:
    up = [f"{a} imports {b}" for a, deps in _graph().items() if a.startswith(("core.", "comm."))
          for b in deps if b.startswith(("api.", "ext."))]
    assert not up, up


def test_engine_stays_small_enough_to_read() -> None:
    # FSDP2 does the same ground in 9 files; 61 pieces made a reader cross 15 files.
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) <= 25, [str(f.relative_to(ENGINE)) for f in files]


def test_no_class_is_assembled_from_sibling_files() -> None:
    """A class whose bases come from other engine files is a mixin split: keep it whole."""
    split = []
    for _, path in _modules():
        tree = ast.parse(path.read_text())
        local = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                 and n.level >= 1 for a in n.names}
        for n in tree.body:
            if isinstance(n, ast.ClassDef):
                bases = [b.id for b in n.bases if isinstance(b, ast.Name) and b.id in local]
                if bases:
                    split.append(f"{path.relative_to(ENGINE)}: {n.name}({', '.join(bases)})")
    assert not split, split
