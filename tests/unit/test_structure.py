"""The shape of the code (DESIGN.md section 3): the core has no import cycle, data flows one
way (namespaces -> value layer -> backends), backends know nothing of the core, and the
core imports nothing of FUSE."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"distorefs": ROOT / "distorefs", "distorefs.backends": ROOT / "backends",
            "distorefs.mount": ROOT / "mount", "distorefs.tools": ROOT / "tools"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGES.items():
        for f in d.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package `name` imports, at run time or for type checking."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
        found |= {c for c in candidates if c.split(".")[0] in ("pyfuse3",)}
    return found


def _layer(name: str) -> str:
    """"core", "mount", "tools" or "backends" for a module of the package."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("mount", "tools", "backends") else "core"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]], members: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module, within `members`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v] & members:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(members):
        if v not in index:
            visit(v)
    return out


def test_core_has_no_import_cycle():
    graph = _graph()
    core = {m for m in graph if _layer(m) == "core"}
    assert _cycles(graph, core) == []


def test_backends_know_nothing_of_the_core():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("distorefs.backends"):
            outside = {d for d in deps if not d.startswith("distorefs.backends")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_core_imports_no_fuse():
    graph = _graph()
    for name, deps in graph.items():
        if _layer(name) in ("core", "backends"):
            assert not {d for d in deps if d.startswith("pyfuse3") or d.startswith("distorefs.mount")}, name


def test_namespaces_never_reach_the_store():
    """Namespaces are built with Services (values, committer, ...), not with the Store."""
    graph = _graph()
    for name in ("ring", "buffer", "bank", "weights", "dataset", "checkpoints", "tiering", "values", "verify",
                 "recovery", "batch", "sampler", "prefetcher", "treerules", "fileattrs", "draft", "restorepoints"):
        assert "distorefs.store" not in graph[f"distorefs.{name}"], name


def test_the_file_tree_rules_stand_alone():
    """The general file trees' shared rules (names, renames, attributes, drafts) know no
    namespace: weights, checkpoints and datasets use them, never the other way round."""
    graph = _graph()
    namespaces = {"distorefs.weights", "distorefs.checkpoints", "distorefs.dataset", "distorefs.store"}
    for name in ("treerules", "fileattrs", "draft", "restorepoints"):
        assert not graph[f"distorefs.{name}"] & namespaces, name
