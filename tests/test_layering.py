"""The packages of ``trtbuild`` form layers, and a module imports only its own layer and the layers below it.

``LAYERS`` is the map, top to bottom: the CLI, the services on top of the runtime, the stages, the backends' builds,
the backends' sessions, the runtime, then what the stages share down to the plain configs. The rules it implies:
- no import cycle between packages (modules collapsed to their package, ``package``);
- ``trtbuild.runtime`` imports nothing from ``trtbuild.backends`` (the sessions are registered by module name in
  ``runtime.session.SESSION_MODULES``);
- a backend's session, and everything it imports, imports nothing from a backend's ``build`` package;
- no module imports a module of a higher layer (``ALLOWED_UPWARD`` lists the exceptions: none);
- a build request, followed through the code (``trace_build``), stays within few layers and seldom calls back up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from test_import_cycles import cycles, import_graph

# Top to bottom: a package may import its own layer and those below. ``trtbuild`` is the package's ``__init__``
# (the public ``LLM``); ``backends`` is the build table and the build request every backend's build shares.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("pipeline", "serve", "lang"),
    ("trtbuild", "build", "eval", "recipe", "demo"),
    ("backends", "backends.onnxruntime.build", "backends.tensorrt.build", "backends.torch.build"),
    ("backends.onnxruntime", "backends.tensorrt", "backends.torch"),  # the sessions and what they run with
    ("runtime",),
    ("quantize",),
    ("convert",),
    ("graph",),
    ("models",),
    ("calibration_data",),
    ("checkpoint",),
    ("artifacts",),
    ("plugins", "kernels"),  # the ops' contracts, references and kernel sources
    ("config", "errors", "configio", "progress"),  # the base: everything may import it
)
BASE = len(LAYERS) - 1
# (importing module, imported module) pairs allowed to go up a layer, each with its reason. None today.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()
BACKENDS = ("onnxruntime", "tensorrt", "torch")
# The build-request trace's limits (issue 40): layers visited, and calls from a lower layer into a higher one.
MAX_TRACE_LAYERS, MAX_TRACE_RETURNS_UP = 7, 4


def package(module: str) -> str:
    """The package a module belongs to: ``trtbuild.<pkg>``'s ``<pkg>``, ``backends.<name>[.build]`` for a
    backend's modules, the module's own name for a top-level module (``build``, ``eval``, ...)."""
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    if parts[1] == "backends" and len(parts) > 2 and parts[2] in BACKENDS:
        return ".".join(parts[1:4]) if len(parts) > 3 and parts[3] == "build" else ".".join(parts[1:3])
    return parts[1]


LAYER_OF: dict[str, int] = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def layer(module: str) -> int:
    """The index in ``LAYERS`` (0: the top) of ``module``'s package."""
    return LAYER_OF[package(module)]


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_every_package_has_a_layer():
    missing = sorted({package(m) for m in import_graph()} - LAYER_OF.keys())
    assert not missing, f"packages with no place in LAYERS: {missing}"


def test_no_cycles_between_packages():
    collapsed: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        collapsed.setdefault(package(mod), set()).update(package(t) for t in targets)
    for pkg, targets in collapsed.items():
        targets.discard(pkg)
    found = cycles(collapsed)
    assert not found, "package import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_runtime_imports_no_backend():
    graph = import_graph()
    bad = {
        (mod, m)
        for mod in graph
        if mod.startswith("trtbuild.runtime")
        for m in _closure(graph, mod)
        if m.startswith("trtbuild.backends")
    }
    assert not bad, "trtbuild.runtime reaches trtbuild.backends:\n" + "\n".join(f"{a} -> {b}" for a, b in sorted(bad))


def test_sessions_import_no_build_code():
    graph = import_graph()
    for name in BACKENDS:
        session = f"trtbuild.backends.{name}.session"
        reached = sorted(m for m in _closure(graph, session) if layer(m) < layer(session))
        assert not reached, f"{session} imports build-time code: {reached}"


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    up = sorted(
        f"{mod} -> {t}"
        for mod, targets in graph.items()
        for t in targets
        if layer(t) < layer(mod) and (mod, t) not in ALLOWED_UPWARD
    )
    assert not up, "imports of a higher layer (LAYERS):\n" + "\n".join(up)


@dataclass(frozen=True)
class Call:
    """One call between trtbuild functions of different layers."""

    caller: str  # module.function
    callee: str
    from_layer: int
    to_layer: int

    @property
    def up(self) -> bool:
        return self.to_layer < self.from_layer


def trace_calls(run: Callable[[], object], layer_of: Callable[[str], int] = layer) -> list[Call]:
    """The calls between trtbuild functions in different layers (neither in the base layer) made by ``run()``,
    in order (``sys.setprofile``)."""
    calls: list[Call] = []

    def profile(frame, event, arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_globals.get("__name__", ""), frame.f_back.f_globals.get("__name__", "")
        if not (callee.startswith("trtbuild.") and caller.startswith("trtbuild.")):
            return
        lo, hi = layer_of(caller), layer_of(callee)
        if lo != hi and BASE not in (lo, hi):
            where = f"{caller}.{frame.f_back.f_code.co_name}", f"{callee}.{frame.f_code.co_name}"
            calls.append(Call(*where, lo, hi))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def trace_build(root: Path, layer_of: Callable[[str], int] = layer) -> list[Call]:
    """The cross-layer calls of ``build_engine`` on a tiny converted model (built once untraced first, so that
    imports and the native library's first compile are not part of the trace)."""
    from tiny_models import make_hf_model

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert

    make_hf_model("llama_gqa", root / "hf")
    convert(root / "hf", root / "ckpt", DType.FLOAT32)
    build = BuildConfig(max_seq_len=64, kv_block_size=4)
    build_engine(root / "ckpt", root / "warm", build)
    return trace_calls(lambda: build_engine(root / "ckpt", root / "engine", build), layer_of)


def summary(calls: list[Call]) -> tuple[int, int]:
    """(distinct layers the calls visit, calls into a higher layer)."""
    layers = {c.from_layer for c in calls} | {c.to_layer for c in calls}
    return len(layers), sum(c.up for c in calls)


def test_a_build_request_stays_in_few_layers(tmp_path):
    calls = trace_build(tmp_path)
    layers, up = summary(calls)
    seen: list[str] = []
    for c in calls:  # each distinct step once, in order
        step = f"{'UP ' if c.up else '   '}{c.from_layer:2} {c.caller} -> {c.to_layer:2} {c.callee}"
        if step not in seen:
            seen.append(step)
    trace = "\n".join(seen)
    assert layers <= MAX_TRACE_LAYERS and up <= MAX_TRACE_RETURNS_UP, f"{layers} layers, {up} calls up:\n{trace}"


def test_pyproject_lists_every_package():
    # Packages are listed by hand (plugins/ is mapped into trtbuild.plugins): a subpackage missing there is left out
    # of wheels and `pip install --target` copies (the GPU machine's install), while editable installs still work.
    # A folder of data files (kernels/cpu: C++ sources) is a package too, for its package data.
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join([name, *path.relative_to(folder).parts])
        for folder, name in ((root / "trtbuild", "trtbuild"), (root / "plugins", "trtbuild.plugins"))
        for path in [folder, *folder.rglob("*")]
        if path.is_dir() and path.name != "__pycache__" and any(p.is_file() for p in path.iterdir())
    }
    assert found == set(setuptools["packages"])
