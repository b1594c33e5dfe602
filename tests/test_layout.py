"""The layout itself: no import circles between edgespec's modules, and runtime/ importing only
what an edge device has (onnxruntime, NumPy, tokenizers), the package format and itself.

Imports are read from the source (ast), not by importing: a module-level ``import`` or ``from
... import`` of another edgespec module is an edge (``from pkg import mod`` of a submodule is an
edge to ``pkg.mod``; a name imported from a package, to the package). Imports inside functions
are the deliberate lazy ones (the CLI's heavy imports on first use) and are not edges here;
``if TYPE_CHECKING:`` blocks are skipped.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "edgespec"
# What runtime/ may import besides the standard library and runtime/ itself: the edge stack,
# the package format and the few bottom-floor modules; the package root for its own path and
# version. jinja2 renders chat templates (a dependency); llguidance is the structured extra's
# engine, imported only when a constraint is asked for (inside a function).
RUNTIME_MAY_IMPORT = {"numpy", "onnxruntime", "tokenizers", "jinja2", "edgespec",
                      "edgespec.config", "edgespec.errors", "edgespec.manifest", "edgespec.cache"}
RUNTIME_LAZY = {"llguidance"}
NEVER_IN_RUNTIME = {"torch", "transformers", "optimum", "onnx"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


def statements(tree: ast.Module, top_level: bool) -> list[ast.AST]:
    """The module's statements outside functions and classes (``if TYPE_CHECKING:`` skipped),
    or every node of it."""
    if not top_level:
        return list(ast.walk(tree))
    out, nodes = [], list(tree.body)
    while nodes:
        node = nodes.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            nodes += node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes += node.body + node.orelse + node.finalbody + [
                s for handler in node.handlers for s in handler.body]
    return out


def imported(tree: ast.Module, top_level: bool) -> list[str]:
    """Dotted names imported at module level (``top_level``) or anywhere: a ``from m import
    n`` gives m and m.n."""
    found = []
    for node in statements(tree, top_level):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def edges(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the edgespec modules it imports at module level."""
    graph = {}
    for name, path in known.items():
        targets = set()
        for node in statements(ast.parse(path.read_text(encoding="utf-8")), top_level=True):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
                targets |= subs
                if len(subs) < len(node.names) and node.module in known:
                    targets.add(node.module)  # names of the module itself
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names} & set(known)
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    assert circles(edges(modules())) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def runtime_imports(root: Path = PACKAGE / "runtime") -> dict[str, set[str]]:
    """Each import of a runtime module that is neither the standard library nor runtime/: the
    imported name -> the modules; lazy ones (inside functions) marked with a trailing '*'."""
    found: dict[str, set[str]] = {}
    known = set(modules())
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        eager = set(imported(tree, top_level=True))
        for name in imported(tree, top_level=False):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or name.startswith("edgespec.runtime"):
                continue
            key = name if top == "edgespec" else top
            if top == "edgespec" and key not in known and key.rsplit(".", 1)[0] in known:
                key = key.rsplit(".", 1)[0]  # a name imported from a module
            found.setdefault(key if name in eager else key + "*", set()).add(path.name)
    return found


def test_the_runtime_imports_only_the_edge_stack_and_the_format():
    found = runtime_imports()
    eager = {name for name in found if not name.endswith("*")}
    lazy = {name[:-1] for name in found if name.endswith("*")}
    assert eager <= RUNTIME_MAY_IMPORT, {n: found[n] for n in eager - RUNTIME_MAY_IMPORT}
    assert lazy <= RUNTIME_MAY_IMPORT | RUNTIME_LAZY, {
        n: found[n + "*"] for n in lazy - RUNTIME_MAY_IMPORT - RUNTIME_LAZY}
    assert not (eager | lazy) & NEVER_IN_RUNTIME


def test_the_runtime_check_flags_a_heavy_or_upward_import(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "bad.py").write_text("import torch\nfrom edgespec.export.pair import check_pair\n"
                                    "def f():\n    import llguidance\n")
    found = runtime_imports(runtime)
    assert set(found) == {"torch", "edgespec.export.pair", "llguidance*"}
    assert not set(found) - {"llguidance*"} <= RUNTIME_MAY_IMPORT


@pytest.mark.parametrize("folder", ["export", "models", "serve", "cli"])
def test_no_layer_below_imports_the_one_above(folder):
    """runtime/ never reaches up into export/, models/, serve/ or cli/ (the CLI and the server
    sit on the runtime, export beside it)."""
    up = {name for name in runtime_imports() if name.rstrip("*").startswith(f"edgespec.{folder}")}
    assert up == set()
