"""Reference implementation of ``trtbuild::PagedAttention`` (numpy): the oracle for every lowering and kernel.

Written for clarity, not speed: a loop over sequences, float64 accumulation. The contract is in README.md beside
this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "PagedAttention"
OP_VERSION = 1


@dataclass(frozen=True)
class PagedAttentionAttrs:
    """The op's attributes (see README.md)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    rotary_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Evaluate the op; returns ``(output, key_cache_out, value_cache_out)`` (the caches are new arrays)."""
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
            k_out[blk, off] = k[lo + i]
            v_out[blk, off] = v[lo + i]
        ctx = int(pos[-1]) + 1
        ctx_pos = np.arange(ctx)
        keys = k_out[blocks[ctx_pos // block_size], ctx_pos % block_size].astype(np.float64)  # [ctx, hkv, d]
        vals = v_out[blocks[ctx_pos // block_size], ctx_pos % block_size].astype(np.float64)
        keys = np.repeat(keys, group, axis=1)
        vals = np.repeat(vals, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[lo:hi], keys) * attrs.scale  # [hq, n, ctx]
        scores = np.where(ctx_pos[None, None, :] <= pos[None, :, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[lo:hi] = np.einsum("hqk,khd->qhd", probs, vals)
    return out.reshape(t, hq * d).astype(qkv.dtype), k_out, v_out
