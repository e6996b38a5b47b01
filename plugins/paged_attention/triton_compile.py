"""The paged-attention Triton kernels compiled for an NVIDIA architecture without a GPU, and what ptxas says of them.

Used by ``triton_kernel.compile_ptx`` (the TensorRT AOT kernel), ``tests/test_triton_kernel.py`` (every JIT launch
compiles for sm_90, without spills) and ``benchmarks/triton_registers.py`` (registers, spills, shared memory per
launch). Imports Triton when called, like ``triton_kernel``.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from typing import Any

SCALAR_ARGS = ("num_tokens", "num_seqs", "max_blocks", "num_blocks", "block_size", "rot_dim", "rope_rows")  # int32
INDEX_ARGS = ("positions", "block_tables", "qsl")
FLOAT32_ARGS = ("cos_sin", "k_scale", "v_scale", "seg_m", "seg_l", "seg_acc")


def arg_types(
    float_type: str, *, cache_type: str | None = None, index_type: str = "i32", cos_sin_type: str = "fp32"
) -> dict[str, str]:
    """Triton's type of every kernel argument, by name, for a launch on such tensors: qkv, the output and the
    rotated queries in ``float_type``; the caches in ``cache_type`` (default ``float_type``); the metadata in
    ``index_type``; the rotary table in ``cos_sin_type``; the scales and split-KV partials fp32; scalars i32."""
    types = {name: f"*{float_type}" for name in ("qkv", "out", "q_out")}
    types.update({name: f"*{cache_type or float_type}" for name in ("k_in", "v_in", "k_out", "v_out")})
    types.update({name: f"*{index_type}" for name in INDEX_ARGS})
    types.update({name: "*fp32" for name in FLOAT32_ARGS})
    types["cos_sin"] = f"*{cos_sin_type}"
    types.update({name: "i32" for name in SCALAR_ARGS})
    return types


def compile_kernel(
    kernel: Any,
    consts: dict[str, Any],
    types: dict[str, str],
    *,
    arch: int,
    num_warps: int,
    num_stages: int,
    aligned: bool,
    ptx_version: int | None = None,
) -> Any:
    """``triton.compile`` of ``kernel`` (a ``_triton_kernels`` function) for ``sm_{arch}``: the arguments in
    ``consts`` are constexprs, the others typed by ``types``. ``aligned`` declares every pointer (and
    ``block_size``) divisible by 16, as Triton's JIT does for torch's allocations: without it the loads stay scalar
    and nothing is copied asynchronously. ``ptx_version`` (e.g. 85) caps the PTX ISA."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
    attrs = {}
    if aligned:
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name].startswith("*") or name == "block_size"}  # fmt: skip
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if ptx_version:
        options["ptx_version"] = ptx_version
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_report(compiled: Any, arch: int = 90) -> dict[str, int]:
    """``{"registers", "spill_bytes", "smem"}`` of a compiled kernel: registers per thread and bytes of register
    spill stores from ``ptxas -v`` (the ptxas Triton compiles ``sm_{arch}`` with), shared memory from Triton."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # Triton's PTX targets the arch-specific ISA
        cmd = [get_ptxas(arch).path, f"-arch={target}", "-v", f.name, "-o", "/dev/null"]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return {"registers": max(int(n) for n in re.findall(r"Used (\d+) registers", report)),
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)),
            "smem": int(compiled.metadata.shared)}  # fmt: skip
