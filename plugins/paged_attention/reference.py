"""Reference implementation of ``trtbuild::PagedAttention`` (numpy): the oracle for every lowering and kernel.

Written for clarity, not speed: a loop over sequences, float64 accumulation. The contract is in README.md beside
this file.

A quantized KV cache (attribute ``kv_cache_dtype`` INT8 or FLOAT8E4M3FN, inputs ``k_scale`` / ``v_scale``) stores
``quantize_kv(k, k_scale)`` and attends over ``dequantize_kv(cache, k_scale)``, the step's own new keys included.
int8 caches are ``np.int8`` arrays, fp8 caches ``ml_dtypes.float8_e4m3fn`` arrays.

Optional attributes: ``sliding_window`` (token at position p sees positions ``p - sliding_window < k <= p``) and
``softcap`` (scores ``softcap * tanh(score / softcap)`` after the scale, before the mask). With a window, the
oracle reads no block that lies wholly before its sequence's first query position minus ``sliding_window - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "PagedAttention"
OP_VERSION = 1

# ONNX TensorProto element types of the KV cache (values of the ``kv_cache_dtype`` attribute).
KV_FLOAT, KV_INT8, KV_FP8 = 1, 3, 17
FP8_MAX = 448.0  # largest finite FLOAT8E4M3FN value; quantization saturates to it


def quantize_kv(x: np.ndarray, scale: float, kv_cache_dtype: int) -> np.ndarray:
    """``x / scale`` in the cache's number format: int8 rounds half to even and saturates to [-128, 127]; fp8
    (E4M3FN) rounds to nearest even and saturates to +-448 (ONNX ``QuantizeLinear`` with ``saturate=1``)."""
    y = x.astype(np.float32) / np.float32(scale)
    if kv_cache_dtype == KV_INT8:
        return np.clip(np.rint(y), -128, 127).astype(np.int8)
    if kv_cache_dtype == KV_FP8:
        import ml_dtypes

        return np.clip(y, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is not a quantized cache type")


def dequantize_kv(q: np.ndarray, scale: float) -> np.ndarray:
    return q.astype(np.float64) * np.float64(np.float32(scale))


@dataclass(frozen=True)
class PagedAttentionAttrs:
    """The op's attributes (see README.md)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    rotary_interleaved: bool = False
    kv_cache_dtype: int = KV_FLOAT  # ONNX element type of the caches: KV_FLOAT, KV_INT8 or KV_FP8
    sliding_window: int | None = None  # attend to the last sliding_window positions (own included); None: all
    softcap: float | None = None  # scores -> softcap * tanh(score / softcap); None: no capping

    def __post_init__(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1):
            raise ValueError(f"sliding_window {window!r} is not a positive int (None: no window)")
        if self.softcap is not None and not (np.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap {self.softcap!r} is not a positive finite float (None: no capping)")
        if self.kv_cache_dtype not in (KV_FLOAT, KV_INT8, KV_FP8):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is not FLOAT (1), INT8 (3) or FLOAT8E4M3FN (17)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_onnx(cls, attributes: Mapping[str, Any]) -> PagedAttentionAttrs:
        """The attributes of one node of the op, given as ``{name: onnx.helper.get_attribute_value(a)}``, validated;
        absent optional ones take their defaults (no window, no soft-capping)."""
        window, softcap = attributes.get("sliding_window"), attributes.get("softcap")
        return cls(
            int(attributes["num_heads"]),
            int(attributes["num_kv_heads"]),
            int(attributes["head_size"]),
            float(attributes["scale"]),
            bool(attributes.get("rotary_interleaved", 0)),
            int(attributes.get("kv_cache_dtype", KV_FLOAT)),
            None if window is None else int(window),
            None if softcap is None else float(softcap),
        )

    def onnx_attributes(self) -> dict[str, int | float]:
        """These values as the op's ONNX node attributes: the optional ones only when set (absent means none)."""
        out: dict[str, int | float] = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "scale": float(self.scale),
            "rotary_interleaved": int(self.rotary_interleaved),
            "kv_cache_dtype": self.kv_cache_dtype,
        }
        if self.sliding_window is not None:
            out["sliding_window"] = int(self.sliding_window)
        if self.softcap is not None:
            out["softcap"] = float(self.softcap)
        return out


def rotary_cos_sin_cache(max_positions: int, rotary_dim: int, theta: float, scaling: float = 1.0) -> np.ndarray:
    """``[max_positions, rotary_dim]`` float32 table: ``concat(cos, sin)`` of ``p / scaling * inv_freq``."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64) / scaling, inv_freq)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x [T, H, D]`` by per-token ``cos/sin [T, R/2]``."""
    half = cos.shape[-1]
    rot = 2 * half
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * c - x2 * s
        out[..., 1:rot:2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., :half], x[..., half:rot]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rot] = x2 * c + x1 * s
    return out


def paged_attention(
    qkv: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    positions: np.ndarray,
    block_tables: np.ndarray,
    query_start_loc: np.ndarray,
    cos_sin_cache: np.ndarray | None,
    attrs: PagedAttentionAttrs,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Evaluate the op; returns ``(output, key_cache_out, value_cache_out)`` (the caches are new arrays).

    ``k_scale`` / ``v_scale`` (inputs 7, 8) are required exactly when ``attrs.kv_cache_dtype`` is not float."""
    quantized = attrs.kv_cache_dtype != KV_FLOAT
    if quantized != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale are required exactly for a quantized KV cache")
    hq, hkv, d = attrs.num_heads, attrs.num_kv_heads, attrs.head_size
    t = qkv.shape[0]
    if qkv.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(f"qkv width {qkv.shape[1]} != (num_heads + 2 * num_kv_heads) * head_size")
    if query_start_loc[0] != 0 or query_start_loc[-1] != t or np.any(np.diff(query_start_loc) <= 0):
        raise ValueError("query_start_loc must start at 0, end at T and be strictly increasing")
    block_size = key_cache.shape[1]
    group = hq // hkv

    q = qkv[:, : hq * d].reshape(t, hq, d).astype(np.float64)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d).astype(np.float64)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d).astype(np.float64)
    if cos_sin_cache is not None:
        half = cos_sin_cache.shape[1] // 2
        table = cos_sin_cache[positions].astype(np.float64)
        cos, sin = table[:, :half], table[:, half:]
        q = apply_rotary(q, cos, sin, attrs.rotary_interleaved)
        k = apply_rotary(k, cos, sin, attrs.rotary_interleaved)

    k_out, v_out = key_cache.copy(), value_cache.copy()
    out = np.zeros((t, hq, d), dtype=np.float64)
    for b in range(len(query_start_loc) - 1):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        pos = positions[lo:hi]
        if np.any(np.diff(pos) != 1):
            raise ValueError(f"positions of sequence {b} are not consecutive")
        blocks = block_tables[b]
        for i, p in enumerate(pos):
            blk, off = blocks[p // block_size], p % block_size
            if quantized:
                k_out[blk, off] = quantize_kv(k[lo + i], k_scale, attrs.kv_cache_dtype)
                v_out[blk, off] = quantize_kv(v[lo + i], v_scale, attrs.kv_cache_dtype)
            else:
                k_out[blk, off] = k[lo + i]
                v_out[blk, off] = v[lo + i]
        ctx = int(pos[-1]) + 1
        # the first position any of the sequence's tokens sees: earlier blocks are never read (the runner may
        # have freed them)
        first = 0 if attrs.sliding_window is None else max(0, int(pos[0]) - attrs.sliding_window + 1)
        ctx_pos = np.arange(first, ctx)
        keys = k_out[blocks[ctx_pos // block_size], ctx_pos % block_size]  # [ctx, hkv, d]
        vals = v_out[blocks[ctx_pos // block_size], ctx_pos % block_size]
        if quantized:
            keys, vals = dequantize_kv(keys, k_scale), dequantize_kv(vals, v_scale)
        else:
            keys, vals = keys.astype(np.float64), vals.astype(np.float64)
        keys = np.repeat(keys, group, axis=1)
        vals = np.repeat(vals, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[lo:hi], keys) * attrs.scale  # [hq, n, ctx - first]
        if attrs.softcap is not None:
            scores = attrs.softcap * np.tanh(scores / attrs.softcap)
        visible = ctx_pos[None, :] <= pos[:, None]
        if attrs.sliding_window is not None:
            visible &= ctx_pos[None, :] > pos[:, None] - attrs.sliding_window
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[lo:hi] = np.einsum("hqk,khd->qhd", probs, vals)
    return out.reshape(t, hq * d).astype(qkv.dtype), k_out, v_out
