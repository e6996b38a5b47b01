"""Triton implementation of ``trtbuild::PagedAttention`` (contract in README.md, oracle in reference.py).

Two kernels, both launched on a ``(T, Hkv)`` grid (one program per token and kv head; the program handles the
``Hq / Hkv`` query heads of its group, so GQA reads every key once per group):

- ``_write_kv_kernel`` rotates the token's key (RoPE) and writes key and value into their cache slot
  ``block_tables[b, p // BS] * BS + p % BS``.
- ``_paged_attention_kernel`` rotates the queries and attends causally over positions ``0 ..= p`` of the token's
  sequence, walking the block table in tiles of ``BLOCK_N`` positions with an online softmax (fp32 accumulation).
  With ``FUSED=True`` it also writes its own token's K/V and reads this step's keys/values straight from ``qkv``
  instead of the cache, so one launch does everything with no ordering between programs: this is the form the
  TensorRT AOT plugin needs (one kernel per plugin).

The kernel signature follows TensorRT's AOT launch convention: input pointers, then int32 scalars, then output
pointers. The caches are inputs 1-2 *and* outputs 1-2 (same memory, written in place).

The kernels live in ``_triton_kernels.py``, imported (with Triton) on first use: this module imports without Triton
and raises ``ImportError`` only when called. Set ``TRITON_INTERPRET=1`` before Triton's first import to run the
kernels on CPU torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .reference import PagedAttentionAttrs

BLOCK_N = 16  # context positions per tile
BLOCK_B = 16  # sequences scanned per step when a program looks up its sequence


def _kernels() -> ModuleType:
    """The kernel module, importing Triton on first use."""
    try:
        from . import _triton_kernels
    except ImportError as e:
        raise ImportError(f"the Triton paged-attention kernel needs triton: pip install 'triton==3.9.0' ({e})") from e
    return _triton_kernels


def kernel_constexprs(attrs: PagedAttentionAttrs, has_rope: bool, fused: bool) -> dict[str, Any]:
    """The compile-time constants of ``_paged_attention_kernel`` for one op instance."""
    return {
        "NUM_HEADS": attrs.num_heads,
        "NUM_KV_HEADS": attrs.num_kv_heads,
        "HEAD_SIZE": attrs.head_size,
        "SCALE": float(attrs.scale),
        "HAS_ROPE": bool(has_rope),
        "INTERLEAVED": bool(attrs.rotary_interleaved),
        "FUSED": bool(fused),
        "BLOCK_G": _next_pow2(attrs.num_heads // attrs.num_kv_heads),
        "BLOCK_D": _next_pow2(attrs.head_size),
        "BLOCK_N": BLOCK_N,
        "BLOCK_B": BLOCK_B,
    }


@dataclass(frozen=True)
class CompiledKernel:
    """PTX of the fused kernel plus what a launcher needs (grid is ``(T, num_kv_heads)``)."""

    name: str
    ptx: str
    num_threads: int  # threads per program (block_x)
    shared_mem: int  # dynamic shared memory in bytes
    arch: int  # compute capability it was compiled for, e.g. 90


POINTER_ARGS = ("qkv", "k_in", "v_in", "positions", "block_tables", "qsl", "cos_sin", "out", "k_out", "v_out")
SCALAR_ARGS = ("num_seqs", "max_blocks", "block_size", "rot_dim")


def compile_ptx(
    attrs: PagedAttentionAttrs,
    *,
    has_rope: bool,
    arch: int,
    float_type: str = "fp32",
    index_type: str = "i32",
    cos_sin_type: str = "fp32",
    ptx_version: int | None = None,
) -> CompiledKernel:
    """Compile the fused kernel to PTX for ``sm_{arch}`` without a GPU (Triton's bundled LLVM and ptxas).

    ``float_type`` is the Triton type of qkv, the caches and the output (``fp32``, ``fp16``, ``bf16``);
    ``index_type`` that of the metadata tensors. ``ptx_version`` (e.g. 85) caps the PTX ISA for older drivers.
    Raises ``RuntimeError`` when the kernel would need Triton's global/profile scratch buffers, which TensorRT's
    AOT launcher does not provide.
    """
    kernels = _kernels()
    import triton
    from triton.backends.compiler import GPUTarget

    consts = kernel_constexprs(attrs, has_rope, fused=True)
    types = {name: f"*{float_type}" for name in POINTER_ARGS}
    types.update({name: f"*{index_type}" for name in ("positions", "block_tables", "qsl")})
    types["cos_sin"] = f"*{cos_sin_type}"
    types.update({name: "i32" for name in SCALAR_ARGS})
    kernel = kernels._paged_attention_kernel
    signature = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts)
    options = {"ptx_version": ptx_version} if ptx_version else None
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError("the paged-attention kernel needs Triton scratch memory, which TensorRT AOT cannot pass")
    return CompiledKernel(meta.name, compiled.asm["ptx"], meta.num_warps * 32, meta.shared, arch)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def paged_attention_triton(
    qkv: Any,
    key_cache: Any,
    value_cache: Any,
    positions: Any,
    block_tables: Any,
    query_start_loc: Any,
    cos_sin_cache: Any | None,
    attrs: PagedAttentionAttrs,
    *,
    fused: bool = False,
    out: Any | None = None,
) -> Any:
    """Evaluate the op on torch tensors; writes ``key_cache``/``value_cache`` IN PLACE and returns ``output``.

    ``fused=False`` launches the cache-write kernel then the attention kernel (which reads the whole context from
    the cache); ``fused=True`` launches the single fused kernel the TensorRT AOT plugin uses. Metadata tensors may
    be int32 or int64. The caches must be contiguous (they are written through their data pointer). ``out``, if
    given, is a contiguous ``[T, Hq * D]`` tensor to write the result into (the TensorRT plugin's output buffer).
    """
    kernels = _kernels()
    hq, hkv, dh = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    t = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * dh:
        raise ValueError(f"qkv shape {tuple(qkv.shape)} != [T, (num_heads + 2 * num_kv_heads) * head_size]")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (hkv, dh):
            raise ValueError(f"{name} shape {tuple(cache.shape)} != [NB, BS, num_kv_heads, head_size]")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is written in place")
    if query_start_loc.shape[0] < 2 or positions.shape[0] != t:
        raise ValueError("query_start_loc needs B + 1 >= 2 entries and positions one entry per token")
    qkv = qkv.contiguous()
    positions, block_tables, query_start_loc = (x.contiguous() for x in (positions, block_tables, query_start_loc))
    has_rope = cos_sin_cache is not None
    if has_rope:
        cos_sin_cache = cos_sin_cache.contiguous()
        if cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > dh:
            raise ValueError(f"rotary dim {cos_sin_cache.shape[1]} must be even and <= head_size {dh}")
    cos_sin = cos_sin_cache if has_rope else qkv  # dummy pointer, never read
    rot_dim = cos_sin_cache.shape[1] if has_rope else 0
    num_seqs = query_start_loc.shape[0] - 1
    max_blocks, block_size = block_tables.shape[1], key_cache.shape[1]
    output = qkv.new_empty((t, hq * dh)) if out is None else out
    if tuple(output.shape) != (t, hq * dh) or not output.is_contiguous():
        raise ValueError(f"out must be a contiguous [{t}, {hq * dh}] tensor")
    consts = kernel_constexprs(attrs, has_rope, fused)
    scalars = (num_seqs, max_blocks, block_size, rot_dim)
    if not fused:
        kernels._write_kv_kernel[(t, hkv)](
            qkv, positions, block_tables, query_start_loc, cos_sin, *scalars, key_cache, value_cache,
            NUM_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_SIZE=dh, HAS_ROPE=has_rope,
            INTERLEAVED=consts["INTERLEAVED"], BLOCK_D=consts["BLOCK_D"], BLOCK_B=BLOCK_B,
        )  # fmt: skip
    kernels._paged_attention_kernel[(t, hkv)](
        qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin, *scalars,
        output, key_cache, value_cache, **consts,
    )  # fmt: skip
    return output
