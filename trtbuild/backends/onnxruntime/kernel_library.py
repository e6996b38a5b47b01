"""The native CPU kernels' library: built for this machine at first use, cached, and found by the runtime.

``plugins/paged_attention/cpu_kernel.cc`` (with ``cpu_linear.inc`` and ``cpu_swiglu.inc``) is an onnxruntime
custom-op library, domain ``trtbuild.cpu``: ``PagedAttention``, ``QLinear``, the per-token row ops and ``SwiGLU``.
It is compiled at first use with the machine's C++ compiler (``$CXX``, else ``g++``) for the machine's own CPU
(``-march=native``) and cached under ``$XDG_CACHE_HOME/trtbuild/kernels/`` by a digest of the source, the compiler
and the CPU, so a changed file, compiler or machine gets its own build. It links nothing: onnxruntime hands it its
API table when the session registers the library. This module is the runtime's part and imports no build tool (no
``onnx``); the graph rewrites that place the ops are ``native.py`` and ``native_linear.py``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...errors import EngineError
from ...plugins import paged_attention

NATIVE_DOMAIN = "trtbuild.cpu"
QLINEAR_OP = "QLinear"
SWIGLU_OP = "SwiGLU"
# The native ops that read their weight inputs in place every step: OrtSession gives those a huge-page arena
# (huge_pages.WeightArena; the build records its layout, native_linear.weight_arena_layout).
WEIGHT_OPS = frozenset({(NATIVE_DOMAIN, QLINEAR_OP)})
SOURCE = Path(paged_attention.__file__).resolve().parent / "cpu_kernel.cc"
INCLUDES = (SOURCE.with_name("cpu_linear.inc"), SOURCE.with_name("cpu_swiglu.inc"))  # included by SOURCE: digested
# Reassociation lets the compiler vectorise the dot products; infinities and NaNs keep their meaning (masked scores).
# Not -ffast-math: linked into a shared object it pulls in crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero/denormals-are-zero bits for the whole process on load (numpy, torch and every other library then
# compute subnormals as zero). The individual flags give the same code without that side effect.
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
# What the kernel's fixed scratch holds (cpu_kernel.cc: kMaxRows, kMaxTileFloats, kMaxBlockSize, kMaxHeadSize).
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


def library_path() -> Path:
    """The compiled kernel library for this machine, building it on first use (a few seconds)."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    sources = [SOURCE.read_bytes(), *(p.read_bytes() for p in INCLUDES)]
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
        proc = subprocess.run([cxx, *CXXFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            raise EngineError(
                f"compiling the native kernels failed ({first}); use --cpu-attention lowered --cpu-linear onnxruntime"
            )
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib
