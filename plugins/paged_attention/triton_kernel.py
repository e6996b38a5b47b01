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

Triton is imported when this module is imported, but the module still imports without it; the kernels then raise
on use. Set ``TRITON_INTERPRET=1`` before the first import to run the kernels on CPU torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .reference import PagedAttentionAttrs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised when triton is absent
    triton = None
    tl = None

BLOCK_N = 16  # context positions per tile
BLOCK_B = 16  # sequences scanned per step when a program looks up its sequence


def _require_triton() -> None:
    if triton is None:
        raise ImportError("the Triton paged-attention kernel needs triton: pip install 'triton==3.9.0'")


if triton is not None:

    @triton.jit
    def _seq_of(qsl_ptr, t, num_seqs, BLOCK_B: tl.constexpr):
        """Index of the sequence that owns token ``t``: the number of sequence ends ``<= t``."""
        b = 0
        for start in range(0, num_seqs, BLOCK_B):
            offs = start + tl.arange(0, BLOCK_B)
            live = offs < num_seqs
            ends = tl.load(qsl_ptr + 1 + offs, mask=live, other=0)
            b += tl.sum((live & (ends <= t)).to(tl.int32), axis=0)
        return b

    @triton.jit
    def _load_rotated(base, pos, d, mask, cos_sin, rot, HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Load ``base + d`` as fp32, rotating its first ``rot`` dims by the angle of ``pos`` (broadcasts)."""
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            half = rot // 2
            if INTERLEAVED:
                partner = d + 1 - 2 * (d % 2)
                sign = tl.where(d % 2 == 0, -1.0, 1.0)
                fidx = d // 2
            else:
                partner = tl.where(d < half, d + half, d - half)
                sign = tl.where(d < half, -1.0, 1.0)
                fidx = tl.where(d < half, d, d - half)
            in_rot = d < rot
            rmask = mask & in_rot
            xp = tl.load(base + partner, mask=rmask, other=0.0).to(tl.float32)
            row = cos_sin + pos * rot
            cos = tl.load(row + fidx, mask=rmask, other=1.0).to(tl.float32)
            sin = tl.load(row + half + fidx, mask=rmask, other=0.0).to(tl.float32)
            x = tl.where(in_rot, x * cos + sign * xp * sin, x)
        return x

    @triton.jit
    def _write_kv_kernel(
        qkv, positions, block_tables, qsl, cos_sin,
        num_seqs, max_blocks, block_size, rot_dim,
        k_out, v_out,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
        b = _seq_of(qsl, t, num_seqs, BLOCK_B).to(tl.int64)
        p = tl.load(positions + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_SIZE
        k_base = qkv + t.to(tl.int64) * width + (NUM_HEADS + kvh) * HEAD_SIZE
        k = _load_rotated(k_base, p, d, dmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
        v = tl.load(k_base + NUM_KV_HEADS * HEAD_SIZE + d, mask=dmask, other=0.0)
        blk = tl.load(block_tables + b * max_blocks + p // block_size).to(tl.int64)
        dst = ((blk * block_size + p % block_size) * NUM_KV_HEADS + kvh) * HEAD_SIZE + d
        tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=dmask)
        tl.store(v_out + dst, v.to(v_out.dtype.element_ty), mask=dmask)

    @triton.jit
    def _paged_attention_kernel(
        qkv, k_in, v_in, positions, block_tables, qsl, cos_sin,
        num_seqs, max_blocks, block_size, rot_dim,
        out, k_out, v_out,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, SCALE: tl.constexpr,
        HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, FUSED: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        group = NUM_HEADS // NUM_KV_HEADS
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
        b = _seq_of(qsl, t, num_seqs, BLOCK_B).to(tl.int64)
        p = tl.load(positions + t).to(tl.int64)
        t64 = t.to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_SIZE
        qmask = (g < group)[:, None] & dmask[None, :]
        heads = kvh * group + g
        q_base = qkv + t64 * width + heads[:, None] * HEAD_SIZE
        q = _load_rotated(q_base, p, d[None, :], qmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
        bt_row = block_tables + b * max_blocks
        kv_col = (NUM_HEADS + kvh) * HEAD_SIZE  # column of this kv head's key in a qkv row
        first_row = tl.load(qsl + b).to(tl.int64)
        p0 = tl.load(positions + first_row).to(tl.int64)  # first position written in this step
        if FUSED:
            k_new = _load_rotated(qkv + t64 * width + kv_col, p, d, dmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
            v_new = tl.load(qkv + t64 * width + kv_col + NUM_KV_HEADS * HEAD_SIZE + d, mask=dmask, other=0.0)
            own_blk = tl.load(bt_row + p // block_size).to(tl.int64)
            dst = ((own_blk * block_size + p % block_size) * NUM_KV_HEADS + kvh) * HEAD_SIZE + d
            tl.store(k_out + dst, k_new.to(k_out.dtype.element_ty), mask=dmask)
            tl.store(v_out + dst, v_new.to(v_out.dtype.element_ty), mask=dmask)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, p + 1, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N).to(tl.int64)
            valid = j <= p
            blk = tl.load(bt_row + j // block_size, mask=valid, other=0).to(tl.int64)
            kv_off = ((blk * block_size + j % block_size) * NUM_KV_HEADS + kvh)[:, None] * HEAD_SIZE + d[None, :]
            kvmask = valid[:, None] & dmask[None, :]
            if FUSED:
                cached = (j < p0)[:, None]
                cmask = kvmask & cached
                nmask = kvmask & (~cached)
                new_base = qkv + (first_row + j - p0)[:, None] * width + kv_col
                k = tl.load(k_in + kv_off, mask=cmask, other=0.0).to(tl.float32)
                k += _load_rotated(new_base, j[:, None], d[None, :], nmask, cos_sin, rot_dim, HAS_ROPE, INTERLEAVED)
                v = tl.load(v_in + kv_off, mask=cmask, other=0.0).to(tl.float32)
                v += tl.load(new_base + NUM_KV_HEADS * HEAD_SIZE + d[None, :], mask=nmask, other=0.0).to(tl.float32)
            else:
                k = tl.load(k_in + kv_off, mask=kvmask, other=0.0).to(tl.float32)
                v = tl.load(v_in + kv_off, mask=kvmask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * SCALE  # [G, N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            prob = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        o = acc / l_i[:, None]
        o_ptr = out + t64 * (NUM_HEADS * HEAD_SIZE) + heads[:, None] * HEAD_SIZE + d[None, :]
        tl.store(o_ptr, o.to(out.dtype.element_ty), mask=qmask)


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
    _require_triton()
    from triton.backends.compiler import GPUTarget

    consts = kernel_constexprs(attrs, has_rope, fused=True)
    types = {name: f"*{float_type}" for name in POINTER_ARGS}
    types.update({name: f"*{index_type}" for name in ("positions", "block_tables", "qsl")})
    types["cos_sin"] = f"*{cos_sin_type}"
    types.update({name: "i32" for name in SCALAR_ARGS})
    kernel = _paged_attention_kernel
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
    _require_triton()
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
        _write_kv_kernel[(t, hkv)](
            qkv, positions, block_tables, query_start_loc, cos_sin, *scalars, key_cache, value_cache,
            NUM_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_SIZE=dh, HAS_ROPE=has_rope,
            INTERLEAVED=consts["INTERLEAVED"], BLOCK_D=consts["BLOCK_D"], BLOCK_B=BLOCK_B,
        )  # fmt: skip
    _paged_attention_kernel[(t, hkv)](
        qkv, key_cache, value_cache, positions, block_tables, query_start_loc, cos_sin, *scalars,
        output, key_cache, value_cache, **consts,
    )  # fmt: skip
    return output
