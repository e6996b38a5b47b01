"""The torch engine's paged attention on the CPU, run by the native kernel the onnxruntime engine uses.

``kernels/cpu/paged_attention.cc`` through the library's plain C entry point ``trtbuild_paged_attention``
(``kernels/cpu/c_api.cc``, called with ctypes: scalars and data pointers only, so no struct layout is mirrored
here). The library is the one ``kernels/library.py`` compiles for this machine at first use;
without a C++ compiler, or for a call the kernel does not take (qkv not float32, tensors not contiguous, a shape
beyond its limits), :func:`paged_attention_native` returns None and the op runs its torch code
(``ops.paged_attention_torch``). Why: the torch code costs ~0.7 ms a layer per decode step on two cores (about 30
small ops and their dispatch); the kernel's call costs a few tens of microseconds (docs/gpu.md, CPU).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from ...errors import EngineError
from ...kernels.library import library_path
from ...plugins.paged_attention import KV_FLOAT, PagedAttentionAttrs

log = logging.getLogger(__name__)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# trtbuild_paged_attention's parameters, in order (c_api.cc).
ARGTYPES = (
    [_P, _P, _P, _F, _F, _P, _P, _P, _P, _P]  # qkv, caches, k/v scale, positions, tables, query_start_loc, cos_sin, out
    + [_I] * 7  # num_tokens, num_seqs, max_blocks, num_blocks, block_size, rotary_dim, rotary_rows
    + [_I] * 5  # num_heads, num_kv_heads, head_size, interleaved, cache_type
    + [_F, _I, _F, _I]  # scale, window, softcap, num_threads
)


@functools.cache
def _kernel() -> Callable[..., int] | None:
    """The C entry point, or None (logged once) where the library cannot be built or loaded here."""
    try:
        lib = ctypes.CDLL(str(library_path()))
    except (EngineError, OSError) as e:
        log.warning("the native CPU kernels are unavailable (%s): torch engines attend with torch code", e)
        return None
    fn = lib.trtbuild_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ARGTYPES
    return fn


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_attention_native(
    qkv: Tensor, key_cache: Tensor, value_cache: Tensor, positions: Tensor, block_tables: Tensor,
    query_start_loc: Tensor, cos_sin_cache: Tensor | None, attrs: PagedAttentionAttrs,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> Tensor | None:  # fmt: skip
    """``ops.paged_attention_torch``'s contract on the native kernel (CPU tensors): writes the caches in place and
    returns ``[T, Hq * D]`` float32, or returns None, having written nothing, where the kernel does not take the
    call (then run the torch code)."""
    fn = _kernel()
    ints = (positions, block_tables, query_start_loc)
    if (
        fn is None
        or qkv.dtype != torch.float32
        or (cos_sin_cache is not None and (cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()))
        or any(t.dtype != torch.int64 or not t.is_contiguous() for t in ints)
        or not (qkv.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        return None
    quantized = attrs.kv_cache_dtype != KV_FLOAT
    if quantized and (k_scale is None or v_scale is None):
        return None
    t = qkv.shape[0]
    out = torch.empty((t, attrs.num_heads * attrs.head_size), dtype=torch.float32)
    rotary = cos_sin_cache.shape if cos_sin_cache is not None else (0, 0)
    done = fn(
        qkv.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        float(k_scale) if quantized else 1.0, float(v_scale) if quantized else 1.0,  # type: ignore[arg-type]
        positions.data_ptr(), block_tables.data_ptr(), query_start_loc.data_ptr(), _ptr(cos_sin_cache),
        out.data_ptr(), t, query_start_loc.shape[0] - 1, block_tables.shape[1], key_cache.shape[0],
        key_cache.shape[1], rotary[1], rotary[0], attrs.num_heads, attrs.num_kv_heads, attrs.head_size,
        int(attrs.rotary_interleaved), attrs.kv_cache_dtype, attrs.scale, attrs.sliding_window or 0,
        attrs.softcap or 0.0, torch.get_num_threads(),
    )  # fmt: skip
    return out if done else None
