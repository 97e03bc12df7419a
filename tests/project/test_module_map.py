"""The package's module map (DESIGN.md): no import cycles between modules (lazy and type-checking
imports count too), the GPU backend never imports the CPU backend, the model definitions import no
backend, and the backends never import the engine or the server. Read from the sources' import
statements, so it holds on a machine without CuPy too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "realizar_backend"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from . import x` names module x, not its package)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        base = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[:len(base.split(".")) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                names = subs + ([target] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges[m] |= {t for t in names if t in mods and t != m}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in edges:
        if v not in index:
            visit(v)
    return out


EDGES = _imports(_modules())


def test_no_import_cycles():
    assert _cycles(EDGES) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _reaches(src_prefix: str, dst_prefix: str) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in EDGES.items() if m.startswith(src_prefix)
                  for t in ts if t.startswith(dst_prefix))


def test_the_gpu_backend_never_imports_the_cpu_backend():
    assert _reaches("realizar_backend.backends.cuda", "realizar_backend.backends.cpu") == []


def test_the_model_definitions_import_no_backend():
    assert _reaches("realizar_backend.model", "realizar_backend.backends") == []


def test_backends_import_neither_the_engine_nor_the_server():
    assert _reaches("realizar_backend.backends", "realizar_backend.engine") == []
    assert _reaches("realizar_backend.backends", "realizar_backend.serving") == []
