"""Write a torch engine's files, in the form its ``TorchRuntime`` runs.

- ``torch-compile``: ``engines/torch-compile-<device>/graph.onnx`` + ``weights.safetensors`` (``module_files.py``);
  target ``compile-cuda`` / ``compile-cpu``. No GPU needed to build.
- ``aot-inductor``: portable graph -> torch module -> ``torch.export`` (dynamic sizes; and one token, its one-row
  products fused) -> AOTInductor ``engines/torch-<target>/model.pt2`` + ``weights.safetensors`` (``aoti_package.py``;
  target ``cuda-sm90``, ``cpu-avx512``, see ``target.py``). Building for CUDA needs a GPU of the architecture it
  builds for. The package is then loaded and run once in a child process
  (``isolate.py``, a few seconds): a package that crashes or fails there (every CUDA package segfaulted at load on
  the H200 image of docs/gpu.md), or one Inductor cannot compile on the machine, is replaced by the torch-compile
  form, with one warning line, instead of handed to users.

The manifest entry records the runtime, the target and the torch / Triton versions.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from safetensors.torch import save_file
from torch._inductor.package import package_aoti

from ....artifacts.engine_select import EngineEntry
from ....checkpoint.dtypes import torch_dtype
from ....config import BuildConfig, EngineIO, ModelConfig, TorchConfig, TorchDevice, TorchRuntime
from ....runtime.kv_groups import sliding_group_layers
from ..aoti_package import DECODE_MODEL, STEP_MODEL, WEIGHTS_FILE
from ..importer import PortableModule
from ..module_files import write_module_files
from ..ops import cache_dtype
from ..row_products import RowProducts, default_row_products
from ..target import compile_target, local_target
from .isolate import IsolatedRun, run_isolated

log = logging.getLogger(__name__)

MAX_NUM_BLOCKS = 1 << 24


@dataclass(frozen=True)
class ExampleStep:
    """A small valid step used to trace the module: 2 sequences, 5 tokens (every size >= 2, so export keeps it
    symbolic), or, ``decode``, one sequence's one token (the sizes the decode program fixes at 1)."""

    tensors: tuple[torch.Tensor, ...]
    caches: list[torch.Tensor]
    # The sliding layers' block tables of a model of both attention kinds (ModelConfig.has_sliding_kv_group), else
    # None. Their width and the sliding caches' block count differ from the full ones' so that export keeps them
    # apart (equal example sizes would tie the two dimensions).
    sliding_tables: torch.Tensor | None = None

    @property
    def args(self) -> tuple[object, ...]:
        """The module's (and the package's) arguments: the step tensors, the caches, the sliding tables if any."""
        extra = () if self.sliding_tables is None else (self.sliding_tables,)
        return (*self.tensors, self.caches, *extra)


def example_step(
    model: ModelConfig, block_size: int, dtype: torch.dtype, device: str, *, decode: bool = False
) -> ExampleStep:
    long = dict(dtype=torch.long, device=device)
    if decode:  # the third token of one sequence
        steps = ([7 % model.vocab_size], [2], [[1, 2, 3]], [0, 1], [0])
    else:
        steps = ([i % model.vocab_size for i in range(5)], [0, 1, 2, 0, 1], [[1, 2, 3], [4, 5, 6]], [0, 3, 5], [2, 4])
    tensors = tuple(torch.tensor(values, **long) for values in steps)
    sliding = sliding_group_layers(model)
    caches = [
        torch.zeros((7 if n // 2 in sliding else 8, block_size, model.num_kv_heads, model.head_size), device=device).to(
            cache_dtype(model, dtype)
        )
        for n in range(2 * model.num_layers)
    ]
    tables = torch.tensor([[1, 2, 3, 0]] if decode else [[1, 2, 3, 0], [4, 5, 6, 0]], **long) if sliding else None
    return ExampleStep(tensors, caches, tables)


def dynamic_shapes(model: ModelConfig, build: BuildConfig, *, decode: bool = False) -> tuple[object, ...]:
    """The step program's symbolic sizes, or (``decode``) the decode program's: token, sequence and logits counts
    fixed at 1, the block tables' widths and the caches' block counts symbolic."""
    dim = torch.export.Dim
    width = dim("max_blocks_per_seq", min=1, max=math.ceil(build.max_seq_len / build.kv_block_size) + 1)
    blocks = dim("num_blocks", min=2, max=MAX_NUM_BLOCKS)
    if decode:
        steps: tuple[dict[int, object], ...] = ({}, {}, {1: width}, {}, {})
    else:
        tokens = dim("num_tokens", min=1, max=build.max_num_tokens)
        seqs = dim("num_seqs", min=1, max=build.max_batch_size)
        seqs1 = dim("num_seqs_plus_1", min=2, max=build.max_batch_size + 1)
        logits = dim("num_logits", min=1, max=build.max_num_tokens)
        steps = ({0: tokens}, {0: tokens}, {0: seqs, 1: width}, {0: seqs1}, {0: logits})
    sliding = sliding_group_layers(model)
    if not sliding:
        return (*steps, [{0: blocks} for _ in range(2 * model.num_layers)])
    sliding_blocks = dim("num_sliding_blocks", min=2, max=MAX_NUM_BLOCKS)
    sliding_width = dim("max_sliding_blocks_per_seq", min=1, max=math.ceil(build.max_seq_len / build.kv_block_size) + 1)
    caches = [{0: sliding_blocks if n // 2 in sliding else blocks} for n in range(2 * model.num_layers)]
    return (*steps, caches, {**steps[2], 1: sliding_width})  # the block tables' rows, a width of its own


@dataclass(frozen=True)
class WrittenEngine:
    """The engine written (its manifest entry) and what the user should hear about it (one line each)."""

    entry: EngineEntry
    warnings: tuple[str, ...] = ()


def write_torch_engine(
    portable: onnx.ModelProto, model: ModelConfig, build: BuildConfig, io: EngineIO, cfg: TorchConfig, out_dir: Path
) -> WrittenEngine:
    """Write ``portable`` under ``out_dir/engines/`` in the form ``cfg.torch_runtime`` runs (module docstring)."""
    if cfg.torch_runtime is TorchRuntime.TORCH_COMPILE:
        return WrittenEngine(write_compile_engine(portable, cfg, out_dir))
    try:
        entry = write_aoti_package(portable, model, build, io, cfg, out_dir)
    except Exception as e:  # Inductor's C++ / CUDA compile failing on this machine (e.g. no CUDA toolkit headers)
        log.debug("AOTInductor build failed", exc_info=True)
        why = f"it does not build on this machine ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]})"
    else:
        gc.collect()  # the export's device copies of the weights: the check's child loads its own
        if cfg.device is TorchDevice.CUDA:
            torch.cuda.empty_cache()
        check = aoti_load_check(out_dir / entry.path, model, build.kv_block_size, cfg)
        if check.ok:
            return WrittenEngine(entry)
        why = f"it does not run on this machine ({check.summary()})"
    shutil.rmtree(out_dir / "engines", ignore_errors=True)
    warning = f"the AOTInductor package: {why}: the engine uses the torch-compile runtime instead (docs/gpu.md)"
    return WrittenEngine(write_compile_engine(portable, cfg, out_dir), (warning,))


def write_compile_engine(portable: onnx.ModelProto, cfg: TorchConfig, out_dir: Path) -> EngineEntry:
    """The torch-compile form: the graph's structure and the module's weights (``module_files.py``)."""
    target = compile_target(cfg.device)
    graph = write_module_files(portable, torch_dtype(cfg.dtype), out_dir / "engines" / f"torch-{target}")
    return EngineEntry(
        backend="torch",
        target=target,
        path=graph.relative_to(out_dir).as_posix(),
        torch_version=torch.__version__,
        triton_version=_version("triton"),
        torch_runtime=TorchRuntime.TORCH_COMPILE.value,
    )


def write_aoti_package(
    portable: onnx.ModelProto, model: ModelConfig, build: BuildConfig, io: EngineIO, cfg: TorchConfig, out_dir: Path
) -> EngineEntry:
    """Export and AOT-compile ``portable`` into ``out_dir/engines/torch-<target>/`` (``aoti_package.py``: the step
    program, the decode program where it differs, their weights once); returns its entry."""
    target = local_target(cfg.device)
    device = cfg.device.value
    if cfg.device is TorchDevice.CUDA:
        ensure_cuda_home()
    dtype = torch_dtype(cfg.dtype)
    options: dict[str, object] = {"aot_inductor.package": True}
    if hasattr(torch._inductor.config.aot_inductor, "emit_multi_arch_kernel"):
        options["aot_inductor.emit_multi_arch_kernel"] = False  # this GPU's cubins only: no nvcc/fatbinary needed
    # On the CPU, max-autotune's C++ templates take prepacked weights: frozen into the code, one program only.
    frozen = cfg.max_autotune and cfg.device is TorchDevice.CPU
    if cfg.max_autotune:  # Triton templates (may take the dequantization as a fused prologue) / C++ micro-kernels
        options["max_autotune"] = True
        options["freezing"] = frozen
    options["aot_inductor.package_constants_in_so"] = frozen  # else weights.safetensors, shared by the programs
    rows = RowProducts.NONE if frozen else default_row_products(torch.device(device))
    module = PortableModule(portable, io, dtype, row_products=rows).to(device).eval()
    programs = {STEP_MODEL: _export(module, model, build, dtype, device, decode=False)}
    if module.row_weights:  # else the decode program would compute what the step one does
        programs[DECODE_MODEL] = _export(module, model, build, dtype, device, decode=True)
    constants = {**programs[STEP_MODEL].state_dict, **programs[STEP_MODEL].constants}
    del module
    directory = out_dir / "engines" / f"torch-{target}"
    directory.mkdir(parents=True)
    files = {
        name: torch._inductor.aot_compile(_graph_module(p), *p.example_inputs, options=dict(options))
        for name, p in programs.items()
    }
    del programs
    package_aoti(str(directory / "model.pt2"), files)
    if not frozen:
        save_file({k: v.contiguous() for k, v in constants.items()}, str(directory / WEIGHTS_FILE))
    return EngineEntry(
        backend="torch",
        target=target,
        path=(directory / "model.pt2").relative_to(out_dir).as_posix(),
        compute_capability=_compute_capability(cfg.device),
        torch_version=torch.__version__,
        triton_version=_version("triton"),
        torch_runtime=TorchRuntime.AOT_INDUCTOR.value,
    )


def _export(
    module: PortableModule, model: ModelConfig, build: BuildConfig, dtype: torch.dtype, device: str, *, decode: bool
) -> torch.export.ExportedProgram:
    """``module`` exported for every step, or (``decode``) for one token, with its one-row products fused."""
    module.fuse_one_row = decode
    example = example_step(model, build.kv_block_size, dtype, device, decode=decode)
    with torch.no_grad():
        return torch.export.export(module, example.args, dynamic_shapes=dynamic_shapes(model, build, decode=decode))


def _graph_module(program: torch.export.ExportedProgram) -> torch.nn.Module:
    """``program`` as the graph module AOTInductor compiles (as ``aoti_compile_and_package`` makes it)."""
    try:
        return program.module(check_guards=False)
    except TypeError:  # torch before 2.9 adds no guard checks to leave out
        return program.module()


# Loads a package as the session does and runs the example steps on it (the step program's, the decode program's),
# in a child process (argv: package, config JSON).
_LOAD_CHECK = """
import json, sys
from pathlib import Path
import torch
import trtbuild.backends.torch.ops  # the custom op the package calls
from trtbuild.backends.torch.build.writer import example_step
from trtbuild.backends.torch.runners import load_aoti
from trtbuild.config import ModelConfig
from trtbuild.configio import from_dict
spec = json.loads(sys.argv[2])
model = from_dict(ModelConfig, spec["model"], "model")
dtype = getattr(torch, spec["dtype"])
runner = load_aoti(Path(sys.argv[1]), torch.device(spec["device"]))
for decode, rows in ((False, 2), (True, 1)):
    example = example_step(model, spec["block_size"], dtype, spec["device"], decode=decode)
    with torch.inference_mode():
        logits = runner(*example.args)
    if spec["device"] == "cuda":
        torch.cuda.synchronize()
    assert logits.shape == (rows, model.vocab_size), logits.shape
    assert bool(torch.isfinite(logits).all()), "non-finite logits"
"""


def aoti_load_check(
    package: Path, model: ModelConfig, block_size: int, cfg: TorchConfig, timeout: float = 300.0
) -> IsolatedRun:
    """Load ``package`` and run one example step in a child process (``isolate.run_isolated``): whether it runs."""
    from ....configio import to_dict

    spec = {
        "model": to_dict(model),
        "block_size": block_size,
        "dtype": str(torch_dtype(cfg.dtype)).removeprefix("torch."),
        "device": cfg.device.value,
    }
    return run_isolated(_LOAD_CHECK, args=[str(package), json.dumps(spec)], timeout=timeout)


def ensure_cuda_home() -> str | None:
    """Make sure AOTInductor finds CUDA headers and ``libcuda.so``; returns the CUDA home it will use.

    AOTInductor compiles its C++ wrapper against the CUDA headers and links ``-lcuda``, found through ``CUDA_HOME``
    (or nvcc, or /usr/local/cuda). A machine with torch and Triton but no CUDA toolkit still has both: the headers
    Triton bundles and the driver's ``libcuda.so.1``. Then torch is pointed at a directory made of links to them.
    """
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is not None:
        return cpp_extension.CUDA_HOME
    home = triton_cuda_home(Path(tempfile.mkdtemp(prefix="trtbuild-cuda-home-")))
    if home is None:  # no Triton, or no driver library: AOTInductor will say what it misses
        return None
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = str(home)
    return str(home)


def triton_cuda_home(home: Path) -> Path | None:
    """``home`` made a CUDA home of links: ``include`` to the headers Triton bundles, ``lib64/libcuda.so`` to the
    driver's ``libcuda.so.1``; None where Triton's NVIDIA backend or its ``cuda.h`` is missing."""
    try:
        import triton
        from triton.backends.nvidia.driver import libcuda_dirs

        include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
        dirs = [Path(d) for d in libcuda_dirs()]
    except Exception:
        return None
    if not (include / "cuda.h").is_file():
        return None
    home.mkdir(parents=True, exist_ok=True)
    (home / "include").symlink_to(include, target_is_directory=True)
    (home / "lib64").mkdir()
    for d in dirs:
        if (d / "libcuda.so.1").exists():
            (home / "lib64" / "libcuda.so").symlink_to(d / "libcuda.so.1")
            break
    return home


def _compute_capability(device: TorchDevice) -> str | None:
    if device is not TorchDevice.CUDA:
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
