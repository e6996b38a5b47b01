"""PTX ISA versions: which one the local driver loads, which one the plugin's AOT kernel was compiled to.

Triton writes PTX in the ISA of its bundled ptxas (8.8 for sm_80, 9.x for sm_90a with Triton 3.9), which a driver
older than that CUDA release refuses at engine run time (``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``). The TensorRT
backend caps the ISA at what the build machine's driver loads (or at ``--ptx-version``) and records the ISA of the
embedded kernel in the manifest, so engine selection (``engine_select.py``) can tell a too-old driver apart from
other mismatches; the cap is ``backends/tensorrt/build/engines.py``'s.
"""

from __future__ import annotations

import ctypes

# Highest PTX ISA each CUDA release's driver loads (CUDA release notes / PTX ISA document, "PTX ISA version").
_PTX_OF_CUDA = {
    (11, 0): 70, (11, 1): 71, (11, 2): 72, (11, 3): 73, (11, 4): 74, (11, 5): 75, (11, 6): 76, (11, 7): 77,
    (11, 8): 78, (12, 0): 80, (12, 1): 81, (12, 2): 82, (12, 3): 83, (12, 4): 84, (12, 5): 85, (12, 6): 85,
    (12, 8): 87, (12, 9): 88, (13, 0): 90,
}  # fmt: skip


def max_ptx_for_cuda(cuda: tuple[int, int]) -> int | None:
    """The highest PTX ISA (e.g. 85 for 8.5) a driver of CUDA ``cuda`` loads; None when newer than this table."""
    known = [c for c in _PTX_OF_CUDA if c <= cuda]
    if not known:
        return min(_PTX_OF_CUDA.values())
    if cuda > max(_PTX_OF_CUDA):
        return None  # a newer driver than any listed: it loads whatever Triton writes
    return _PTX_OF_CUDA[max(known)]


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version of the installed NVIDIA driver (``cuDriverGetVersion``), None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def ptx_cap(flag: int | None, driver: tuple[int, int] | None) -> int | None:
    """The PTX ISA cap for the AOT kernel: the flag when given, else what the local driver loads (None: no cap)."""
    if flag is not None:
        return flag
    return None if driver is None else max_ptx_for_cuda(driver)


def ptx_number(isa: str) -> int:
    """``"8.5"`` -> ``85``."""
    major, _, minor = isa.partition(".")
    return int(major) * 10 + int(minor)
