"""The callable that runs one step of a torch engine, per ``TorchRuntime``.

``runner(input_ids, positions, block_tables, query_start_loc, logits_indices, caches) -> logits`` for both:
- ``aot-inductor``: the engine's ``model.pt2`` programs over its ``weights.safetensors`` (``aoti_package.py``);
- ``torch-compile``: the ``PortableModule`` rebuilt on the device from the engine's graph and weights
  (``module_files.py``) and wrapped by ``torch.compile`` (Inductor, ``dynamic=True``: one graph serves every token
  count >= 2; sizes 1 get their own; no duck shaping, so equal sizes are not assumed to stay equal). Dynamo
  traces the module once per such specialisation, at the session's warm-up; Inductor's compiled code is cached on
  disk (``inductor_cache_dir``) so a second load of the same engine skips code generation. ``compile=False`` runs
  the module eagerly (vLLM's ``enforce_eager``; debugging).
  ``max_autotune`` (``--max-autotune``): Inductor times its GEMM templates against the library's at open; on the
  CPU with the weights frozen into prepacked constants. SmolLM2 fp32 on 2 cores: 1.7x faster batch-1 decode, but
  each open takes ~4 minutes (frozen graphs skip the compile cache), so there it suits long-lived servers, and an
  AOTInductor build, which pays it once, suits the rest.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...config import EngineIO
from .aoti_package import AotiRunner
from .importer import PortableModule
from .module_files import load_module
from .row_products import RowProducts

Runner = Callable[..., torch.Tensor]
RECOMPILE_LIMIT = 64  # Dynamo's per-function graph limit (8 by default): 0/1 size specialisations of five inputs


def inductor_cache_dir() -> Path:
    """Where Inductor (and Triton, unless the user set theirs) keep compiled code: ``$TORCHINDUCTOR_CACHE_DIR``,
    else ``~/.cache/trtbuild/inductor`` (created), which this sets for the process before anything compiles."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return Path(configured)
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild" / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
    return path


def load_aoti(package: Path, device: torch.device) -> Runner:
    """An AOTInductor package's runner (the process must have imported ``ops.py``: the package calls the op)."""
    return AotiRunner(package, device)


def load_compiled(
    graph: Path,
    io: EngineIO,
    dtype: torch.dtype,
    device: torch.device,
    *,
    compile: bool,
    max_autotune: bool,
    row_products: RowProducts,
) -> Runner:
    """The torch-compile runtime's runner: the module on ``device``, compiled lazily by its first calls;
    ``row_products`` as ``PortableModule``'s (only when compiling)."""
    module = load_module(graph, io, dtype, device, row_products=row_products if compile else RowProducts.NONE)
    if not compile:
        return module
    inductor_cache_dir()
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7; both kept for the GPU image's
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
    # No duck shaping: otherwise sizes that happen to be equal when a graph is traced (a warm-up's 2 sequences, 2
    # logits rows, 2 block-table columns, 2 KV heads) share one symbol, and every later step where they differ
    # recompiles (on a GPU, seconds of Inductor each). Process-wide, as vLLM sets its Dynamo options.
    torch.fx.experimental._config.use_duck_shape = False
    # Python floats (the nodes' epsilon, scale, softcap attributes) as constants: unspecialised, Dynamo traced each
    # graph with them as inputs, then Inductor's scalar pass restarted the whole analysis to specialise them: every
    # open traced every graph twice and missed the AOTAutograd cache once (SmolLM2 on 2 cores: 57 -> 16 s warm).
    torch._dynamo.config.specialize_float = True
    options: dict[str, Any] = {}
    # No guards on the module's own attributes (its nodes' metadata, constants, layout sets, buffers: ~6,000 a graph
    # for SmolLM2, 1.7 ms of a 13 ms decode step on 2 cores; 0.2 ms left for the step's inputs and the process's
    # state): nothing of a PortableModule changes after construction (its invariant), and ``_own_forward`` keeps
    # other modules' graphs apart. Guard filters came with torch 2.8.
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if max_autotune:  # Inductor times its GEMM templates (Triton on a GPU, C++ micro-kernels on the CPU)
        options.update(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))  # graphs: DecodeGraphs'
        if device.type == "cpu":  # the C++ templates take prepacked weights: the weights become constants
            torch._inductor.config.freezing = True  # process-wide: as ``options`` it did not take (65 vs 33 ms)
    _own_forward(module)
    compiled: Any = torch.compile(module, dynamic=True, fullgraph=True, options=options)
    return compiled


def _own_forward(module: PortableModule) -> None:
    """Give ``module`` a ``forward`` of its own code object. Dynamo keeps compiled graphs per code object, and with
    no guards on the module (``load_compiled``) a graph traced for another ``PortableModule`` of the same class would
    pass them, its nodes and weights differing."""
    function = type(module).forward
    code = function.__code__.replace()  # the same bytecode, a new object
    own = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    module.forward = types.MethodType(own, module)  # type: ignore[method-assign]
