"""No import cycle in kt_sglang: the modules' runtime imports (at module level or inside functions;
not those under ``if TYPE_CHECKING:``, which only name types) form no loop. Between the engine and the
weights the direction is fixed, type-only imports included: weights/ reads files into the engine,
and the engine knows weight sources only through ``engine/weight_source.py``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kt_sglang"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, type_only: bool = False) -> list[str]:
    """Imported module names, skipping the bodies of ``if TYPE_CHECKING:`` unless ``type_only``."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend(f"{node.module}.{a.name}" for a in node.names)
            names.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (with ``type_only``, under TYPE_CHECKING too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _runtime_imports(ast.parse(path.read_text()), type_only):
            # `from a.b import c` names module a.b.c when c is one, else a.b; a package's own
            # submodules importing the package itself are not a loop worth naming
            if name in modules and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    for module, targets in graph.items():  # `from a.b import c` also added a.b: keep the deepest only
        graph[module] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_detector_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "kt_sglang.engine.wrapper" in graph and graph["kt_sglang.layer.hybrid"]  # the graph is real
    assert cycles(graph) == []


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_never_imports_the_weights():
    """engine/ -> weights/ is no edge at all (lazy and type-only imports counted), so the two
    packages form no cycle: weights/ imports the engine, whose sources register from outside."""
    graph = import_graph(type_only=True)
    engine, weights = "kt_sglang.engine", "kt_sglang.weights"
    assert any(_in(t, engine) for m, ts in graph.items() if _in(m, weights) for t in ts)  # the graph is real
    found = sorted((m, t) for m, ts in graph.items() if _in(m, engine) for t in ts if _in(t, weights))
    assert found == []
    packages = {
        p: {
            q
            for m, ts in graph.items()
            if _in(m, p)
            for t in ts
            for q in (engine, weights)
            if _in(t, q) and q != p
        }
        for p in (engine, weights)
    }
    assert cycles(packages) == []
