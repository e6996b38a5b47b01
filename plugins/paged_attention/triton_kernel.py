"""Triton implementation of ``trtbuild::PagedAttention`` (contract in README.md, oracle in reference.py).

Design (after vLLM's Triton "unified attention"; kernels in ``_triton_kernels.py``):

- **Query tiles.** A program owns one *query tile*: ``BLOCK_Q`` consecutive tokens of one sequence times the
  ``G = Hq / Hkv`` query heads of one kv head, packed into ``BLOCK_M = BLOCK_Q * G`` (padded) rows. Sequence b owns
  tiles ``query_start_loc[b] // BLOCK_Q + b ...``, so the grid is ``(T // BLOCK_Q + B, Hkv[, segments])`` and a
  program finds its sequence by binary search; a tile never crosses a sequence boundary (surplus programs exit).
- **Tensor cores.** The program walks its sequence's context in tiles of ``BLOCK_N`` positions gathered through
  the block table (any block size), computes ``Q K^T`` and ``P V`` with ``tl.dot`` (fp16/bf16 operands, fp32
  accumulation; fp32 inputs use exact fp32 dots) and keeps an online softmax in base 2. Each K/V tile is read once
  for all ``BLOCK_M`` rows: the query tokens of a prefill chunk and the heads of a GQA group share it.
- **Split-KV decode (flash-decoding).** When there are few query rows per kv head (decode), the context of each tile
  is cut into ``NUM_SEGMENTS`` segments (a multiple of ``BLOCK_N`` long, per sequence) processed by separate
  programs (grid axis 2) that write their partial (max, sum, unnormalised output); ``_reduce_segments_kernel``
  merges them. :func:`choose_num_segments` picks the count from the work size and the GPU's SM count.
- **Cache writes.** ``fused=False``: ``_write_kv_kernel`` writes this step's rotated (and quantized) K/V into the
  cache and this step's rotated queries into a ``[T, Hq * D]`` temporary (as TensorRT-LLM's context path rotates
  before its attention kernel), then the attention kernel reads those queries and the whole context from the cache:
  rotating in its tile cost registers across the context loop (ptxas, sm_90: the 128 x 64 prefill tile of head size
  128 at the 255-register cap and spilling with Triton 3.6; 181-188 registers without). ``fused=True``: one kernel;
  each program writes its tile's K/V and reads this step's keys straight from ``qkv`` (positions >= the sequence's
  first new position) and older ones from the cache, so programs never wait on each other. This single-launch form
  (no split) is what the TensorRT AOT plugin compiles (:func:`compile_ptx`).
- **Quantized KV cache** (``attrs.kv_cache_dtype`` INT8 / FLOAT8E4M3FN, per-layer ``k_scale`` / ``v_scale``): K/V
  are quantized on write (``QuantizeLinear``: round half to even, saturate); the dots take the quantized levels as
  fp16/bf16 operands (exact) and apply ``k_scale`` to the scores and ``v_scale`` to the output. The step's own
  tokens attend to their quantized values, as the contract requires.
- **Sliding window and soft-capping** (``attrs.sliding_window`` / ``attrs.softcap``, constexprs: absent ones are
  compiled out): a query tile's context starts at its first token's window start, so the blocks wholly before it
  are never read (the runner may have freed them) and split-KV segments divide the window only; each row masks
  ``j > row_pos - window`` besides the causal ``j <= row_pos``. Scores are capped in the base-2 domain
  (``c * log2(e) * tanh(s / (c * log2(e)))`` of ``s = score * log2(e)``, the same value) before the mask; tanh is
  built from ``exp2`` so the interpreter and every GPU run the same code.
- **Safe on garbage metadata** (TensorRT times plugins on made-up inputs): the sequence index, token rows,
  positions (``< max_blocks * block_size``), rotary rows (``< cos_sin_cache.shape[0]``) and block ids
  (``< key_cache.shape[0]``) are clamped in the kernel, so no metadata makes it read or write out of bounds.

Public launch API (stable; the torch backend calls it): :func:`paged_attention_triton` (evaluate the op on torch
tensors, caches written in place), :func:`compile_ptx` (AOT PTX of the fused kernel), :func:`choose_num_segments`,
:class:`Tiling`. The kernel signature follows TensorRT's AOT launch convention: input pointers, then int32 scalars,
then output pointers.

The kernels are imported (with Triton) on first use: this module imports without Triton and raises ``ImportError``
only when called. Set ``TRITON_INTERPRET=1`` before Triton's first import to run the kernels on CPU torch tensors.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .reference import KV_FLOAT, KV_FP8, KV_INT8, PagedAttentionAttrs


@dataclass(frozen=True)
class Tiling:
    """Tile sizes and launch options of the attention kernel."""

    block_m: int  # query rows per program: tokens x GQA heads (raised to the group size; >= 16 for tl.dot)
    block_n: int  # context positions per step (>= 16)
    num_warps: int = 4
    num_stages: int = 2


PREFILL_TILING = Tiling(block_m=128, block_n=64, num_warps=8, num_stages=2)
DECODE_TILING = Tiling(block_m=16, block_n=64, num_warps=4, num_stages=2)
AOT_TILING = Tiling(block_m=64, block_n=32, num_warps=4, num_stages=1)  # one kernel for prefill and decode
MAX_SEGMENTS = 64
MIN_SEGMENT_LEN = 128  # context positions per split-KV segment, at least
WAVES = 4  # split decode until there are this many programs per SM (memory-bound: many warps in flight)

_KV_QUANT = {KV_FLOAT: 0, KV_INT8: 1, KV_FP8: 2}  # the kernel's KV_QUANT constexpr


def _kernels() -> ModuleType:
    """The kernel module, importing Triton on first use."""
    try:
        from . import _triton_kernels
    except ImportError as e:
        raise ImportError(
            "the Triton paged-attention kernel needs triton: the version your torch depends on (a CUDA torch wheel "
            f"brings it; tested with 3.6 and 3.9), or `pip install 'trtbuild[kernels]'` ({e})"
        ) from e
    return _triton_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def _block_m(attrs: PagedAttentionAttrs, tiling: Tiling) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: rows per program and query tokens per tile."""
    group = attrs.num_heads // attrs.num_kv_heads
    block_m = max(tiling.block_m, 16, _next_pow2(group))
    return block_m, block_m // group


def kernel_constexprs(
    attrs: PagedAttentionAttrs,
    has_rope: bool,
    fused: bool,
    *,
    tiling: Tiling = AOT_TILING,
    num_segments: int = 1,
    fp32: bool = False,
    q_rotated: bool = False,
) -> dict[str, Any]:
    """The compile-time constants of ``_paged_attention_kernel`` for one op instance (``q_rotated``: its ``qkv``
    argument is the cache-write kernel's rotated queries, see ``launch_constexprs``)."""
    block_m, block_q = _block_m(attrs, tiling)
    return {
        "NUM_HEADS": attrs.num_heads,
        "NUM_KV_HEADS": attrs.num_kv_heads,
        "HEAD_SIZE": attrs.head_size,
        "SCALE": float(attrs.scale),
        "HAS_ROPE": bool(has_rope) and not q_rotated,
        "Q_ROTATED": q_rotated,
        "INTERLEAVED": bool(attrs.rotary_interleaved),
        "FUSED": bool(fused),
        "KV_QUANT": _KV_QUANT[attrs.kv_cache_dtype],
        "DOT_PRECISION": "ieee" if fp32 else "tf32",
        "BLOCK_M": block_m,
        "BLOCK_Q": block_q,
        "BLOCK_QP": _next_pow2(block_q),
        "BLOCK_D": max(16, _next_pow2(attrs.head_size)),
        "BLOCK_N": max(16, tiling.block_n),
        "NUM_SEGMENTS": num_segments,
        "SLIDING_WINDOW": attrs.sliding_window,  # None: no window (a constexpr None compiles the test out)
        "SOFTCAP": None if attrs.softcap is None else float(attrs.softcap),
    }


# The cache-write kernel's constants that it shares with the attention kernel.
WRITE_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "INTERLEAVED", "KV_QUANT", "BLOCK_Q", "BLOCK_D")
# The cache-write kernel handles a query tile in [WRITE_ROWS, BLOCK_D] pieces of WRITE_TILE elements, with WRITE_WARPS
# warps (ptxas, sm_90: no spill at head sizes 64 to 256, 118-145 registers; whole 32 x 128 tiles with 4 warps took
# 255 and spilled, whole 64 x 256 ones spilled kilobytes at any warp count).
WRITE_TILE, WRITE_WARPS = 2048, 8


def launch_constexprs(
    attrs: PagedAttentionAttrs, has_rope: bool, fused: bool, *, tiling: Tiling, num_segments: int, fp32: bool
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The compile-time constants of one launch: ``(cache-write kernel's, attention kernel's)``, the first None for
    the fused form. The two-kernel form with rotary rotates the queries in the cache-write kernel (``WRITE_Q``),
    which stores them for the attention kernel (``Q_ROTATED``), as TensorRT-LLM's context path does."""
    rotate_first = has_rope and not fused
    attention = kernel_constexprs(
        attrs, has_rope, fused, tiling=tiling, num_segments=num_segments, fp32=fp32, q_rotated=rotate_first
    )
    if fused:
        return None, attention
    write = {k: attention[k] for k in WRITE_CONSTEXPRS}
    rows = min(attention["BLOCK_QP"], max(1, WRITE_TILE // attention["BLOCK_D"]))  # powers of two
    return {**write, "HAS_ROPE": bool(has_rope), "WRITE_Q": rotate_first, "WRITE_ROWS": rows}, attention


def choose_num_segments(num_tiles: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-KV segments per query tile (a power of two): enough programs for ``WAVES`` per SM on ``num_sms`` SMs,
    each segment at least ``MIN_SEGMENT_LEN`` positions of the longest possible context, at most ``MAX_SEGMENTS``."""
    programs = num_tiles * num_kv_heads
    if programs >= WAVES * num_sms:
        return 1
    want = min(-(-WAVES * num_sms // programs), max(1, max_context // MIN_SEGMENT_LEN), MAX_SEGMENTS)
    return 1 << (want.bit_length() - 1)


@dataclass(frozen=True)
class CompiledKernel:
    """PTX of the fused kernel plus what a launcher needs (grid ``(T // block_q + B, num_kv_heads)``)."""

    name: str
    ptx: str
    num_threads: int  # threads per program (block_x)
    shared_mem: int  # dynamic shared memory in bytes
    arch: int  # compute capability it was compiled for, e.g. 90
    block_q: int = 1  # query tokens per program (grid_x = T // block_q + B)

    @property
    def ptx_isa(self) -> str | None:
        """The PTX ISA version the kernel was written in, e.g. ``"8.5"`` (its ``.version`` line)."""
        found = re.search(r"^\s*\.version\s+(\d+\.\d+)", self.ptx, re.M)
        return found.group(1) if found else None


UNUSED_IN_AOT = ("k_scale", "v_scale", "seg_m", "seg_l", "seg_acc")  # float cache, no split: constexpr None


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
    """Compile the fused single-launch kernel (``AOT_TILING``, no split) to PTX for ``sm_{arch}`` without a GPU.

    ``float_type`` is the Triton type of qkv, the caches and the output (``fp32``, ``fp16``, ``bf16``);
    ``index_type`` that of the metadata tensors. ``ptx_version`` (e.g. 85) caps the PTX ISA for older drivers.
    Raises ``RuntimeError`` when the kernel would need Triton's global/profile scratch buffers, which TensorRT's
    AOT launcher does not provide.
    """
    kernels = _kernels()
    from .triton_compile import arg_types, compile_kernel

    if attrs.kv_cache_dtype != KV_FLOAT:
        raise ValueError("the TensorRT AOT kernel supports float KV caches only")
    consts = kernel_constexprs(attrs, has_rope, fused=True, fp32=float_type == "fp32")
    consts.update(dict.fromkeys(UNUSED_IN_AOT))
    types = arg_types(float_type, index_type=index_type, cos_sin_type=cos_sin_type)
    compiled = compile_kernel(
        kernels._paged_attention_kernel,
        consts,
        types,
        arch=arch,
        num_warps=AOT_TILING.num_warps,
        num_stages=AOT_TILING.num_stages,
        aligned=False,
        ptx_version=ptx_version,
    )  # fmt: skip  (TensorRT's pointer alignment is not known: no alignment declared)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError("the paged-attention kernel needs Triton scratch memory, which TensorRT AOT cannot pass")
    return CompiledKernel(meta.name, compiled.asm["ptx"], meta.num_warps * 32, meta.shared, arch, consts["BLOCK_Q"])


def _scale_tensor(scale: Any, like: Any) -> Any:
    import torch

    return torch.as_tensor(scale, dtype=torch.float32, device=like.device).reshape(1)


def _check_inputs(qkv: Any, key_cache: Any, value_cache: Any, positions: Any, qsl: Any, attrs: Any) -> None:
    import torch

    hq, hkv, dh = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * dh:
        raise ValueError(f"qkv shape {tuple(qkv.shape)} != [T, (num_heads + 2 * num_kv_heads) * head_size]")
    want = {KV_INT8: torch.int8, KV_FP8: getattr(torch, "float8_e4m3fn", None)}.get(attrs.kv_cache_dtype)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (hkv, dh):
            raise ValueError(f"{name} shape {tuple(cache.shape)} != [NB, BS, num_kv_heads, head_size]")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is written in place")
        if (want is None and not cache.dtype.is_floating_point) or (want is not None and cache.dtype != want):
            raise ValueError(f"{name} dtype {cache.dtype} does not match kv_cache_dtype {attrs.kv_cache_dtype}")
    if qsl.shape[0] < 2 or positions.shape[0] != qkv.shape[0]:
        raise ValueError("query_start_loc needs B + 1 >= 2 entries and positions one entry per token")


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
    k_scale: Any | None = None,
    v_scale: Any | None = None,
    num_kv_splits: int | None = None,
    tiling: Tiling | None = None,
) -> Any:
    """Evaluate the op on torch tensors; writes ``key_cache``/``value_cache`` IN PLACE and returns ``output``.

    ``fused=False`` launches the cache-write kernel then the attention kernel (which reads the whole context from
    the cache); ``fused=True`` launches the fused kernel the TensorRT AOT plugin uses. Metadata tensors may be
    int32 or int64. The caches must be contiguous (they are written through their data pointer). ``out``, if given,
    is a contiguous ``[T, Hq * D]`` tensor to write the result into (the TensorRT plugin's output buffer).
    ``k_scale`` / ``v_scale`` (float or one-element tensor) are required exactly for a quantized cache (int8 /
    ``torch.float8_e4m3fn`` tensors). ``num_kv_splits`` forces the split-KV segment count (default: decode-shaped
    steps split by :func:`choose_num_segments`, others do not); ``tiling`` overrides the tile sizes. Neither changes
    the result beyond rounding. No host synchronisation: every launch decision uses shapes only.
    """
    kernels = _kernels()
    _check_inputs(qkv, key_cache, value_cache, positions, query_start_loc, attrs)
    quantized = attrs.kv_cache_dtype != KV_FLOAT
    if quantized != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale are required exactly for a quantized KV cache")
    hq, hkv, dh = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    t = qkv.shape[0]
    qkv = qkv.contiguous()
    positions, block_tables, query_start_loc = (x.contiguous() for x in (positions, block_tables, query_start_loc))
    has_rope = cos_sin_cache is not None
    if has_rope:
        cos_sin_cache = cos_sin_cache.contiguous()
        if cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > dh:
            raise ValueError(f"rotary dim {cos_sin_cache.shape[1]} must be even and <= head_size {dh}")
    cos_sin = cos_sin_cache if has_rope else qkv  # dummy pointer, never read
    rot_dim, rope_rows = (cos_sin_cache.shape[1], cos_sin_cache.shape[0]) if has_rope else (0, 1)
    ks, vs = (_scale_tensor(k_scale, qkv), _scale_tensor(v_scale, qkv)) if quantized else (qkv, qkv)
    num_seqs = query_start_loc.shape[0] - 1
    max_blocks, num_blocks, block_size = block_tables.shape[1], key_cache.shape[0], key_cache.shape[1]
    if min(max_blocks, num_blocks, rope_rows) < 1:
        raise ValueError("block_tables, the caches and cos_sin_cache need at least one row / block")
    output = qkv.new_empty((t, hq * dh)) if out is None else out
    if tuple(output.shape) != (t, hq * dh) or not output.is_contiguous():
        raise ValueError(f"out must be a contiguous [{t}, {hq * dh}] tensor")

    decode_like = t <= num_seqs * _block_m(attrs, DECODE_TILING)[1]
    tiling = tiling or (DECODE_TILING if decode_like else PREFILL_TILING)
    block_q = _block_m(attrs, tiling)[1]
    num_tiles = t // block_q + num_seqs
    segments = num_kv_splits
    if segments is None:
        sms = _num_sms(qkv) if decode_like else 0
        segments = choose_num_segments(num_tiles, hkv, max_blocks * block_size, sms) if sms else 1
    write, consts = launch_constexprs(
        attrs, has_rope, fused, tiling=tiling, num_segments=segments, fp32=qkv.dtype.itemsize == 4
    )
    scalars = (t, num_seqs, max_blocks, num_blocks, block_size, rot_dim, rope_rows)
    meta_in = (positions, block_tables, query_start_loc, cos_sin, ks, vs)
    queries = qkv  # what the attention kernel reads its queries from
    if write is not None:
        queries = _scratch(qkv, (t, hq * dh)) if write["WRITE_Q"] else qkv
        kernels._write_kv_kernel[(num_tiles, hkv)](
            qkv, *meta_in, *scalars, key_cache, value_cache, queries, **write, num_warps=WRITE_WARPS
        )  # fmt: skip
    launch = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}
    if segments == 1:
        kernels._paged_attention_kernel[(num_tiles, hkv, 1)](
            queries, key_cache, value_cache, *meta_in, *scalars, output, key_cache, value_cache, output, output,
            output, **consts, **launch,
        )  # fmt: skip
        return output
    seg_m, seg_l, seg_acc = _workspace(qkv, t, hq, segments, consts["BLOCK_D"])
    kernels._paged_attention_kernel[(num_tiles, hkv, segments)](
        queries, key_cache, value_cache, *meta_in, *scalars, output, key_cache, value_cache, seg_m, seg_l, seg_acc,
        **consts, **launch,
    )  # fmt: skip
    kernels._reduce_segments_kernel[(t, hq)](
        seg_m, seg_l, seg_acc, output, NUM_HEADS=hq, HEAD_SIZE=dh, NUM_SEGMENTS=segments,
        BLOCK_S=_next_pow2(segments), BLOCK_D=consts["BLOCK_D"],
    )  # fmt: skip
    return output


def _workspace(qkv: Any, t: int, hq: int, segments: int, block_d: int) -> tuple[Any, Any, Any]:
    """fp32 split-KV partials per (token, head, segment): running max (base 2), sum, unnormalised output."""
    import torch

    sums = (t, hq, segments)
    f32 = torch.float32
    return _scratch(qkv, sums, f32), _scratch(qkv, sums, f32), _scratch(qkv, (*sums, block_d), f32)


def _scratch(like: Any, shape: tuple[int, ...], dtype: Any = None) -> Any:
    """An uninitialised tensor on ``like``'s device (its dtype unless given): every temporary a launch allocates
    (through torch's caching allocator: inside a CUDA-graph capture, from the graph's pool)."""
    return like.new_empty(shape, dtype=dtype or like.dtype)


def _num_sms(x: Any) -> int:
    """SM count of the tensor's GPU (0 on the CPU: the interpreter never splits unless asked to)."""
    return _sm_count(x.device.index or 0) if x.is_cuda else 0


@functools.cache
def _sm_count(device: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)
