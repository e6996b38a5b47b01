"""The ``trtbuild`` package's modules import each other without cycles.

Every import counts: module level, inside functions (lazy imports) and under ``TYPE_CHECKING``. A cycle hidden behind
a lazy import still ties the modules together (neither can move or be read without the other), so it is refused
the same. An import names the module it loads (``from .pkg import sub`` -> ``pkg.sub`` when ``sub`` is a module);
the packages above it, which Python runs first, are not edges (a registry in a package's ``__init__`` that lazily
imports its subpackages would otherwise always be a cycle).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package directory -> its dotted name (pyproject.toml maps plugins/ to trtbuild.plugins)
PACKAGES = {ROOT / "trtbuild": "trtbuild", ROOT / "plugins": "trtbuild.plugins"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, whether it is a package ``__init__``)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg_dir, pkg_name in PACKAGES.items():
        for path in sorted(pkg_dir.rglob("*.py")):
            parts = list(path.relative_to(pkg_dir).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            mods[".".join([pkg_name, *parts])] = (path, is_pkg)
    return mods


def _imported(name: str, mods: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of ``name`` that is one of ``mods`` (``trtbuild.x.attr`` -> ``trtbuild.x``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``trtbuild`` modules it imports anywhere in its source."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # ``from pkg import sub`` loads the submodule; ``from pkg import attr`` reads pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges.update(t for t in (_imported(t, mods) for t in targets) if t is not None and t != mod)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(c)[0], c, graph) for c in components]


def _cycle_in(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a component without a cycle back to it")


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "trtbuild.config" in graph["trtbuild.backends"]  # module level, relative
    assert "trtbuild.runtime.llm" in graph["trtbuild"]  # inside a function
    assert "trtbuild.backends.torch.ops" in graph["trtbuild.backends.torch.session"]  # ``from . import ops``


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_backend_packages_import_the_real_libraries_and_tensorrt_lazily():
    # trtbuild.backends.onnxruntime / .tensorrt / .torch share their names with the libraries they wrap: the
    # imports inside them are absolute, so ``import onnxruntime`` there is the real package.
    code = (
        "import sys\n"
        "import trtbuild.backends.onnxruntime.session as s\n"
        "assert 'trtbuild' not in s.ort.__file__, s.ort.__file__\n"
        "import trtbuild.backends.tensorrt.build, trtbuild.backends.tensorrt.session\n"
        "assert 'tensorrt' not in sys.modules, 'the tensorrt backend imported TensorRT before it was needed'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
