"""The native CPU kernels' library: built for this machine at first use, cached, and found by the runtime.

Its sources are ``trtbuild/kernels/cpu/`` (C++, one file per op: ``paged_attention.cc``, ``linear.cc`` with its
per-instruction-set headers, ``row_ops.cc``, ``swiglu.cc``, ``moe.cc``; the onnxruntime glue ``ort_ops.cc``): an
onnxruntime custom-op library, domain ``trtbuild.cpu``: ``PagedAttention``, ``QLinear``, the per-token row ops,
``SwiGLU`` and ``MoE``; ``c_api.cc`` adds a plain C entry point to the attention kernel, which the torch engine's
CPU op calls (``backends/torch/native_ops.py``).
It is compiled at first use with the machine's C++ compiler (``$CXX``, else ``g++``), every ``.cc`` a translation
unit of one command, for the machine's own CPU (``-march=native``) and cached under
``$XDG_CACHE_HOME/trtbuild/kernels/`` by a digest of the sources, the compiler and the CPU, so a changed file,
compiler or machine gets its own build. It links nothing: onnxruntime hands it its API table when the session
registers the library. This module imports no build tool (no ``onnx``) and no runtime; the graph rewrites that
place the ops are ``backends/onnxruntime/build/native.py`` and ``native_linear.py``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import EngineError

NATIVE_DOMAIN = "trtbuild.cpu"
QLINEAR_OP = "QLinear"
SWIGLU_OP = "SwiGLU"
MOE_OP = "MoE"
# The native ops that read their weight inputs in place every step: OrtSession gives those a huge-page arena
# (huge_pages.WeightArena; the build records its layout, native_linear.weight_arena_layout).
WEIGHT_OPS = frozenset({(NATIVE_DOMAIN, QLINEAR_OP), (NATIVE_DOMAIN, MOE_OP)})
KERNEL_DIR = Path(__file__).resolve().parent / "cpu"
# Every source file, in a fixed order (all digested: a changed header is a new build); the .cc files are compiled.
SOURCES = (*sorted(KERNEL_DIR.glob("*.cc")), *sorted(KERNEL_DIR.glob("*.h")))
TRANSLATION_UNITS = tuple(path for path in SOURCES if path.suffix == ".cc")
# Reassociation lets the compiler vectorise the dot products; infinities and NaNs keep their meaning (masked scores).
# Not -ffast-math, whose crtfastmath.o would set flush-to-zero for the whole process: docs/decisions/no-fast-math.md.
CXXFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
# What the attention kernel's fixed scratch holds (kernels/cpu/paged_attention.h: kMaxRows, kMaxTileFloats,
# kMaxBlockSize, kMaxHeadSize).
MAX_GQA_GROUP, MAX_GROUP_X_HEAD_SIZE, MAX_BLOCK_SIZE, MAX_HEAD_SIZE = 128, 8192, 64, 512


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise EngineError(
            f"trtbuild's native kernels need a C++ compiler and {cxx!r} was not found: install g++ (or set CXX), "
            "or build the engine with --cpu-attention lowered --cpu-linear onnxruntime"
        )
    return path


def _cpu_identity() -> str:
    """The CPU's model and features: ``-march=native`` code is only valid on CPUs that have them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({line for line in lines if line.startswith(keep)}))


def compile_args(output: str | Path, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler's arguments that build the library into ``output``: ``CXXFLAGS``, then ``extra_flags`` (tests
    and benchmarks build other instruction-set loops, e.g. ``-mno-avx512f``), then every translation unit."""
    return [*CXXFLAGS, *extra_flags, "-o", str(output), *map(str, TRANSLATION_UNITS)]


def library_path() -> Path:
    """The compiled kernel library for this machine, building it on first use (a few seconds)."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    sources = [path.read_bytes() for path in SOURCES]
    for part in (*sources, " ".join(CXXFLAGS).encode(), version.encode(), _cpu_identity().encode()):
        digest.update(part)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild" / "kernels"
    lib = cache / f"paged_attention-{digest.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)  # compile beside it, then rename: concurrent builds are safe
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *compile_args(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            raise EngineError(
                f"compiling the native kernels failed ({first}); use --cpu-attention lowered --cpu-linear onnxruntime"
            )
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib
